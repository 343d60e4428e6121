"""Nothing of a run outlives it in /dev/shm or the temporary directory, even when a rank is
killed: not while setting up shared memory (its ring and doorbell are named then), not while
training (which also ends the run in one line). Our launcher removes what its ranks left and
the folder torch's elastic agent keeps its logs in; a run not started by it (torchrun, or raw
processes as here) leaves its files to the next run on the host, which removes them, naming
each.

Each test keeps its shared-memory files in a folder of its own (PARATRAIN_SHM_DIR), where the
runs of the tests beside it do not sweep; the one that leaves multiprocessing's semaphores in
/dev/shm itself runs alone (marked serial): any run beside it would remove them, and say so in
its own output."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest

import paratrain
from frontend_helpers import wait_until
from paratrain.comm.transport import shm_setup
from paratrain.failure_report import RanksFailed
from paratrain.environment import Settings

# Settings' defaults, not the environment's: a rank forked from a fork server imports this module
# (to find its function) with the server's environment, where an earlier test's folder named by
# PARATRAIN_SHM_DIR may be gone.
pytestmark = pytest.mark.skipif(not shm_setup.enabled(Settings()), reason="shared memory between processes: x86-64 Linux")


@pytest.fixture(autouse=True)
def default_polling(monkeypatch):
    """A waiting rank polls as long as it would on the user's machine (conftest shortens it for
    the parallel part), so a surviving rank is still waiting, not sweeping its dead peer's files,
    when the test stops it."""
    monkeypatch.delenv("PARATRAIN_SHM_SPIN_US", raising=False)


@pytest.fixture(autouse=True)
def shm_dir(monkeypatch) -> str:
    """A folder of shared memory of this test's own (PARATRAIN_SHM_DIR), in /dev/shm's tmpfs: the
    runs of the tests beside it sweep /dev/shm, and would remove the files a killed rank left here
    before this test's next run could (or not) remove them itself. Its ranks inherit it."""
    folder = tempfile.mkdtemp(prefix="leftovers-test-", dir="/dev/shm")
    monkeypatch.setenv("PARATRAIN_SHM_DIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _files_of(pid: int) -> list[str]:
    folder = os.environ["PARATRAIN_SHM_DIR"]
    return sorted(f"{folder}/{name}" for name in os.listdir(folder) if name.startswith("paratrain-") and f"-{pid}-" in name)


def _die_once_shared_memory_is_named(record: str, after: str | None = None) -> None:
    """In this process: once its rings and doorbell exist (the doorbell comes last), write
    their names to `record` and die by SIGKILL, before the peers have opened them; if `after`
    is given, not before that file exists."""
    make_fifo = os.mkfifo

    def mkfifo_then_die(path, mode=0o666):
        make_fifo(path, mode)
        deadline = time.monotonic() + 30
        while after is not None and not os.path.exists(after) and time.monotonic() < deadline:
            time.sleep(0.01)
        Path(record).write_text(json.dumps(_files_of(os.getpid())))
        os.kill(os.getpid(), signal.SIGKILL)

    os.mkfifo = mkfifo_then_die


# ---- under our launcher: the run removes what its killed rank left ------------------------


def _rank1_killed_setting_up_a_second_group(group, record):
    import torch.distributed as dist

    from paratrain.comm import TorchTransport, over_process_group

    if group.rank == 1:
        _die_once_shared_memory_is_named(record)
    over_process_group(TorchTransport(dist.new_group([0, 1])), group.settings)  # shared memory between the two


@pytest.mark.timeout(120)
def test_a_rank_killed_setting_up_shared_memory_leaves_nothing_after_a_processes_run(tmp_path, monkeypatch, short_tmp):
    monkeypatch.setenv("TMPDIR", str(short_tmp))  # the ranks' temporary directory, and ours:
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    record = tmp_path / "named.json"
    with pytest.raises(RanksFailed) as failed:
        paratrain.run(_rank1_killed_setting_up_a_second_group, 2, launcher="processes", args=(str(record),),
                      timeout=60)
    assert failed.value.lines()[0] == (
        "rank 1 of 2 failed (launcher=processes): killed by SIGKILL; no traceback (the process was killed)")
    named = json.loads(record.read_text())
    assert any(path.endswith("-bell") for path in named) and any("-to-0" in path for path in named), named
    assert not [path for path in named if os.path.exists(path)]
    # No torchelastic_* folder, nor ours. multiprocessing's own folder for this process (where the
    # forkserver that forks the ranks listens) lives as long as this process and goes with it;
    # torchinductor_<user> is torch's compile cache, made where the forkserver imports torch._dynamo
    # and kept for every later run.
    servers_folder = multiprocessing.util.get_temp_dir()
    assert [name for name in os.listdir(short_tmp)
            if str(short_tmp / name) != servers_folder and not name.startswith("torchinductor_")] == []


# ---- without it: the next run on the host removes them, naming them ------------------------


def _raw_rank(rank: int, store: str, record: str) -> None:
    """A rank outside any launcher (as under torchrun): rank 1 dies setting up shared memory."""
    import torch.distributed as dist

    from paratrain.comm import TorchTransport, over_process_group
    from paratrain.environment import Settings

    # Every rank sweeps dead processes' files as it sets up: rank 0's sweep must come before rank
    # 1 dies, or it (rightly) removes what this test means to leave for the next run.
    swept = record + ".swept"
    if rank == 1:
        _die_once_shared_memory_is_named(record, after=swept)
    else:
        sweep = shm_setup.remove_stale_files

        def sweep_then_say_so(folder):
            sweep(folder)
            Path(swept).touch()
        shm_setup.remove_stale_files = sweep_then_say_so
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    over_process_group(TorchTransport(), Settings.resolve())


def _nothing(group):
    return group.rank


@pytest.mark.timeout(120)
def test_the_next_run_removes_what_a_rank_killed_setting_up_left_and_names_it(tmp_path, capfd):
    record = tmp_path / "named.json"
    spawn = multiprocessing.get_context("spawn")
    ranks = [spawn.Process(target=_raw_rank, args=(r, str(tmp_path / "store"), str(record))) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        ranks[1].join(60)
        assert ranks[1].exitcode == -signal.SIGKILL
    finally:
        for process in ranks:  # rank 0 waits for a peer that is gone: stop it too
            process.kill()
            process.join(10)
    named = json.loads(record.read_text())
    assert named and all(os.path.exists(path) for path in named), named  # left behind
    capfd.readouterr()
    assert paratrain.run(_nothing, 2, launcher="processes", timeout=60) == {0: 0, 1: 1}
    said = capfd.readouterr().err.splitlines()
    for path in named:
        assert not os.path.exists(path)
        kind = "doorbell" if path.endswith("-bell") else "ring"
        line = f"removed stale shared-memory {kind} {path} left by dead process {ranks[1].pid}"
        assert said.count(line) == 1, "\n".join(said)  # by one of the ranks sweeping


# ---- the command: a rank killed while training ---------------------------------------------


@pytest.mark.timeout(120)
def test_a_rank_killed_while_training_ends_the_run_in_one_line_and_leaves_nothing(short_tmp):
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    run = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "--launcher", "processes", "--steps", "1000000",
         "--log-every", "1000000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ranks, said = [], []
    try:
        ranks = _children(run.pid, deadline=time.monotonic() + 60)
        for line in run.stdout:  # training: the first step is logged
            said.append(line)
            if line.startswith("step "):
                break
        os.kill(ranks[1], signal.SIGKILL)
        output = "".join(said) + run.communicate(timeout=60)[0]
    finally:
        if run.poll() is None:  # the test failed: leave no process behind
            for pid in [*ranks, run.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run.wait()
    lines = output.splitlines()
    after = lines[lines.index("global batch 64 (32 per replica)") + 1:]
    after = [line for line in after if not line.startswith("step ")]  # the first step's log line
    assert run.returncode == 2 and "Traceback" not in output, output
    assert after[0] == ("paratrain train: error: rank 1 of 2 failed (launcher=processes): killed by SIGKILL; "
                        "no traceback (the process was killed)"), output
    assert len(after) <= 2, output  # and where the flight records are, if rank 0 dumped its record
    assert not _files_of_children_of(run.pid)
    # torchinductor_<user> is PyTorch's compile cache, made by importing torch._dynamo (as every
    # torch.optim optimizer does) and shared by the user's torch programs: not this run's to remove.
    left = [name for name in os.listdir(short_tmp) if not name.startswith(("paratrain-trace-", "torchinductor_"))]
    assert left == [], os.listdir(short_tmp)


def _children(parent: int, deadline: float) -> list[int]:
    """The rank processes our launcher in `parent` started, oldest first: rank order. They are
    forked by the forkserver, a child of `parent` (paratrain/forking.py)."""
    while time.monotonic() < deadline:
        parents = _parents()
        servers = {pid for pid, (ppid, command) in parents.items() if ppid == parent and b"forkserver" in command}
        found = [pid for pid, (ppid, _) in parents.items() if ppid in servers]
        if len(found) == 2:
            return sorted(found)
        time.sleep(0.1)
    raise AssertionError("the ranks did not start")


def _parents() -> dict[int, tuple[int, bytes]]:
    """pid -> (its parent's pid, its command line) of every process we can see."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        found[int(pid)] = (int(stat.rsplit(")", 1)[1].split()[1]), command)
    return found


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _files_of_children_of(parent: int) -> list[str]:
    folder = os.environ["PARATRAIN_SHM_DIR"]
    return [name for name in os.listdir(folder) if name.startswith("paratrain-") and f"-{parent}-" in name]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_sweep_of_dev_shm_leaves_another_users_files_alone(monkeypatch, shm_dir):
    # A stale-looking doorbell: this namespace, a dead pid. Made by us, it is told from another
    # user's by its owner, so we pretend to be someone else.
    path = f"{shm_setup._owner(shm_dir, shm_setup._pid_namespace(), 1, _dead_pid(), 0xabc)}-bell"
    Path(path).write_bytes(b"")
    with monkeypatch.context() as pretend:
        pretend.setattr(os, "getuid", lambda: os.stat(path).st_uid + 1)
        shm_setup.remove_stale_files(shm_dir)
        assert os.path.exists(path), "another user's file was removed"
    with monkeypatch.context() as refuse:
        refuse.setattr(shm_setup.os, "unlink", lambda p: (_ for _ in ()).throw(PermissionError(13, "not yours", p)))
        shm_setup.remove_stale_files(shm_dir)  # a file we may not remove is skipped, not an error that stops set-up
        assert os.path.exists(path)
    shm_setup.remove_stale_files(shm_dir)
    assert not os.path.exists(path), "our own stale doorbell stayed"


def test_the_next_run_removes_what_dead_runs_left_and_nothing_alive(tmp_path):
    """In a semaphore folder of the test's own: /dev/shm itself is swept by the runs of the tests
    beside this one, which would remove its dead semaphore first."""
    import mmap
    import socket

    from paratrain import lifetime

    dead_run = tmp_path / f"paratrain-pid{_dead_pid()}-0badc0de-logs-abc"
    live_run = tmp_path / f"paratrain-pid{os.getpid()}-0badc0de-logs-def"
    dead_server, live_server, other = tmp_path / "pymp-dead", tmp_path / "pymp-live", tmp_path / "pymp-other"
    semaphores = tmp_path / "shm"
    for folder in (dead_run, live_run, dead_server, live_server, other, semaphores):
        folder.mkdir()
    (dead_run / "rank0.log").write_text("a log")
    (dead_server / "listener-1").write_text("")  # its socket file, bound by nobody any more
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(live_server / "listener-2"))
    listening.listen()
    unmapped, mapped, not_one = semaphores / "sem.mp-testa", semaphores / "sem.mp-testb", semaphores / "sem.other"
    for path in (unmapped, mapped, not_one):
        path.write_bytes(bytes(32))
    with open(mapped, "r+b") as held:
        view = mmap.mmap(held.fileno(), 32)
    try:
        removed = lifetime.sweep_dead_runs(str(tmp_path), str(semaphores))
        assert set(removed) == {str(dead_run), str(dead_server), str(unmapped)}
        assert not dead_run.exists() and not dead_server.exists() and not unmapped.exists()
        assert live_run.exists() and live_server.exists() and other.exists() and mapped.exists() and not_one.exists()
    finally:
        view.close()
        listening.close()


# Alone: it compares /dev/shm before and after, where the runs beside it make and sweep files, and
# the semaphores its killed run leaves there would be removed by any run beside it, which says so
# in its own output (a line the tests that read that output do not expect).
@pytest.mark.serial
@pytest.mark.timeout(180)
def test_after_a_run_killed_whole_the_next_run_leaves_dev_shm_and_tmpdir_as_they_were(tmp_path):
    """SIGKILL to a processes run's whole process group removes nothing (its log folder, its
    fork server's folder, multiprocessing's semaphores stay); the next run removes it all."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}

    def now() -> set[str]:  # torch's compile cache is meant to stay: every run reuses it
        return (set(os.listdir("/dev/shm")) | set(os.listdir(temp))) - {f"torchinductor_{os.environ.get('USER', 'root')}"}

    before = now()
    killed = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--nproc", "2",
                               "--launcher", "processes", "--steps", "1000000", "--log-every", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              start_new_session=True)
    ranks = []
    try:
        for line in killed.stdout:
            if "step" in line:
                break
        ranks = _children(killed.pid, deadline=time.monotonic() + 60)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    # the ranks see their launcher gone within a second, and exit
    wait_until(lambda: not any(_running(pid) for pid in ranks), 30, "the killed run's ranks exit")
    assert now() - before, "a run killed whole left nothing: this test would show nothing"
    done = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--nproc", "2",
                           "--launcher", "processes", "--steps", "2"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "paratrain: removed what dead runs left:" in done.stderr
    assert now() - before == set(), "left after the next run"
