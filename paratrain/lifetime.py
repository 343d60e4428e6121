"""How long a process of ours lives: no longer than the process it serves.

A rank of `paratrain train` is forked from a fork server (paratrain/forking.py), not from the
launcher, so it does not die with it: a launcher killed with SIGKILL left its ranks training at
full speed. Each rank therefore watches its launcher's pid and ends itself within a second of the
launcher's end (`end_with`). A pid alone is not enough to say a process lives: a killed process
whose parent has not yet reaped it still answers signals (a zombie), so /proc's state is read
where there is one.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

WATCH_S = 0.5  # how often a rank looks at its launcher


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (an exited one not yet reaped, a
    zombie, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, and belongs to someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # "pid (command) state ...": the command may hold spaces and parentheses
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here (macOS): the signal's answer stands
    return state not in (b"Z", b"X")


def end_with(pid: int, who: str, poll_s: float = WATCH_S) -> threading.Thread:
    """Watch process `pid` from a daemon thread and end this process (exit status 1) once it
    is gone, saying so on stderr as `who`. -> the thread."""

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_s):
            if not process_alive(pid):
                print(f"{who}: the process that started it (pid {pid}) is gone; exiting", file=sys.stderr, flush=True)
                os._exit(1)  # no clean-up can wait on peers that will never answer

    thread = threading.Thread(target=watch, name=f"end-with-{pid}", daemon=True)
    thread.start()
    return thread


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), which tells a pid reused by a new
    process from the one seen before; None: no such process, or it has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command, which may hold ")"
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])  # the state; field 22


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of `root`, read from /proc."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(parent, []).append(int(name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        started = start_time(pid)
        if started is not None:
            found.append((pid, started))
        todo += children.get(pid, [])
    return found


# ---- what dead runs leave ------------------------------------------------------------------------
#
# A run killed whole (SIGKILL to its process group) removes nothing: its launcher's folder of
# rank logs, its fork server's folder (pymp-*, holding the server's socket) and the named
# semaphores of multiprocessing (/dev/shm/sem.mp-*) stay. The next run removes them, each only
# when it is provably this user's and dead: a folder named by a launcher's pid that no longer
# runs; a fork server folder whose socket nobody listens on; a semaphore no live process has
# mapped. Another user's files are never touched (the temp folders are shared and sticky).

RUN_FOLDER = re.compile(r"paratrain-pid(\d+)-[0-9a-f]+-logs-")
SEMAPHORE_DIR = "/dev/shm"  # where glibc's sem_open makes POSIX named semaphores, always


def run_folder_prefix() -> str:
    """The prefix of the folder a launcher keeps its ranks' logs in: its pid says when it is dead."""
    return f"paratrain-pid{os.getpid()}-{os.urandom(4).hex()}-logs-"


def sweep_dead_runs(temp_dir: str, semaphore_dir: str = SEMAPHORE_DIR) -> list[str]:
    """Remove what dead runs of this user left in `temp_dir` and their semaphores no process
    maps in `semaphore_dir` (a test names a folder of its own); -> what was removed."""
    removed = []
    for name in _names(temp_dir):
        path = os.path.join(temp_dir, name)
        match = RUN_FOLDER.match(name)
        dead = (match is not None and not process_alive(int(match[1]))) or (
            name.startswith("pymp-") and _abandoned_fork_server_folder(path))
        if dead and _mine(path) and _remove_tree(path):
            removed.append(path)
    semaphores = [os.path.join(semaphore_dir, name) for name in _names(semaphore_dir) if name.startswith("sem.mp-")]
    if semaphores:
        mapped = _mapped_inodes(semaphore_dir)
        for path in semaphores:
            if _inode(path) not in mapped and _mine(path):
                try:
                    os.unlink(path)
                    removed.append(path)
                except OSError:  # removed meanwhile, or not ours to remove
                    pass
    return removed


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _mine(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


def _remove_tree(path: str) -> bool:
    import shutil

    try:
        shutil.rmtree(path)
    except OSError:
        return False
    return True


def _abandoned_fork_server_folder(path: str) -> bool:
    """A multiprocessing folder with a fork server's socket (listener-*) that nothing listens
    on: its server is gone. Other pymp-* folders are left alone (a live program may use one)."""
    sockets = [os.path.join(path, name) for name in _names(path) if name.startswith("listener-")]
    if not sockets:
        return False
    try:
        with open("/proc/net/unix") as table:
            bound = {line.split()[-1] for line in list(table)[1:] if len(line.split()) >= 8}
    except OSError:
        return False  # no way to tell here
    return not any(socket in bound for socket in sockets)


def _inode(path: str) -> int | None:
    try:
        return os.lstat(path).st_ino
    except OSError:
        return None


def _mapped_inodes(folder: str) -> set[int]:
    """The inodes of the files in `folder` some process of this user has mapped (/proc/*/maps).
    By inode, not name: a semaphore is mapped under the temporary name it was made with, then
    given its own by a link."""
    mapped, inside = set(), os.path.join(folder, "")
    for pid in filter(str.isdigit, _names("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    if inside in line:
                        mapped.add(int(line.split(maxsplit=5)[4]))
        except (OSError, ValueError, IndexError):
            continue  # gone, or another user's
    return mapped
