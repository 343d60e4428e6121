"""One block run: in a fresh folder of links to the repository, in a process group of its own that
is killed when the block ends or outlives its time, and judged by exit status and shown output."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.docs_check.compare import compare
from paratrain.docs_check.pages import ROOT, Block
from paratrain.environment import child_environment

BIN = Path(sys.executable).parent  # the virtual environment this runs in
MARKER = "@@docs-check-status"


@dataclass
class Result:
    block: Block
    status: str  # PASS, FAIL, skipped
    seconds: float = 0.0
    why: str = ""


def workspace(block: Block) -> Path:
    """A fresh folder of links to the repository root's entries (or FOLDER's), and the page's files."""
    folder = Path(tempfile.mkdtemp(prefix="docs-check-"))
    source = ROOT / block.folder if block.folder else ROOT
    for entry in source.iterdir():
        (folder / entry.name).symlink_to(entry)
    for name, text in block.files.items():
        target = folder / name
        if target.is_symlink():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return folder


def shell_script(block: Block) -> str:
    """One bash script for the block, so that `cd`, variables and `$!` carry from line to line;
    after each command a marker line gives its exit status, which splits the output."""
    parts = []
    for k, command in enumerate(block.commands):
        text = command.text
        if text.startswith("make "):
            text = f'(cd "$DOCS_CHECK_ROOT" && {text}\n)'  # on its own line: the command may end in a comment
        must_succeed = not (command.shown or block.shown)
        parts.append(f"{text}\n__status=$?\nprintf '\\n{MARKER} {k} %s\\n' \"$__status\"")
        if must_succeed:
            parts.append('[ "$__status" = 0 ] || exit "$__status"')
    return "\n".join(parts) + "\n"


def execute(argv: list[str], cwd: Path, timeout_s: float, cache: Path | None = None) -> tuple[int | None, str]:
    """Run argv in its own process group; (exit status or None when it timed out, output). The
    group is killed at the end either way: nothing the block started outlives it."""
    env = child_environment(VIRTUAL_ENV=str(BIN.parent), PYTHONUNBUFFERED="1", DOCS_CHECK_ROOT=str(ROOT))
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the venv's paratrain, python and torchrun first
    if cache:
        env["XDG_CACHE_HOME"] = str(cache)
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
        status: int | None = process.returncode
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        try:
            output, _ = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # something outside the group holds the pipe open
            process.stdout.close()
            output = b""
        status = None
    _kill_group(process.pid)
    return status, output.decode(errors="replace")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_block(block: Block, cache: Path | None = None) -> Result:
    """Run one block; `cache` stands for the user's ~/.cache (XDG_CACHE_HOME), so that what the
    docs' commands leave there (the table `bench collectives --tune` measures, which `auto` then
    follows) stays out of the user's."""
    if block.skip:
        return Result(block, "skipped", why=block.skip)
    start = time.monotonic()
    folder = workspace(block)
    try:
        if block.lang == "python":
            script = folder / (block.save_as or "snippet.py")
            script.write_text(block.body)
            status, output = execute([str(BIN / "python"), script.name], folder, block.timeout_s, cache)
            why = _judge_python(block, status, output)
        else:
            (folder / ".docs-check.sh").write_text(shell_script(block))
            status, output = execute(["bash", ".docs-check.sh"], folder, block.timeout_s, cache)
            why = _judge_shell(block, status, output)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    seconds = time.monotonic() - start
    return Result(block, "FAIL" if why else "PASS", seconds, why or "")


def _tail(output: str, lines: int = 15) -> str:
    return "\n".join("  | " + line for line in output.splitlines()[-lines:])


def _judge_python(block: Block, status: int | None, output: str) -> str | None:
    if status is None:
        return f"timed out after {block.timeout_s:g} s; killed\n{_tail(output)}"
    if block.shown:
        mismatch = compare(block.shown, output)
        return mismatch and f"{mismatch}\n{_tail(output)}"
    return None if status == 0 else f"exit status {status}\n{_tail(output)}"


def _judge_shell(block: Block, status: int | None, output: str) -> str | None:
    pieces, statuses, current = [], {}, []  # each command's output, split at the markers
    for line in output.splitlines():
        if line.startswith(MARKER):
            k, code = line.split()[1:3]
            statuses[int(k)] = int(code)
            pieces.append("\n".join(current))
            current = []
        else:
            current.append(line)
    unmarked = "\n".join([*pieces, *current])
    first_line = [command.text.splitlines()[0] for command in block.commands]
    if status is None:
        running = first_line[min(len(pieces), len(first_line) - 1)]
        return f"timed out after {block.timeout_s:g} s in `{running}`; killed\n{_tail(unmarked)}"
    for k, command in enumerate(block.commands):
        if k >= len(pieces):  # the shell ended in this command (`exit`, a signal)
            return f"exit status {status} from `{first_line[k]}`\n{_tail(unmarked)}"
        if command.shown:
            mismatch = compare(command.shown, pieces[k])
            if mismatch:
                return f"$ {first_line[k]}\n  {mismatch}\n{_tail(pieces[k])}"
        elif not block.shown and statuses.get(k):
            return f"exit status {statuses[k]} from `{first_line[k]}`\n{_tail(pieces[k])}"
    if block.shown:
        mismatch = compare(block.shown, unmarked)
        return mismatch and f"{mismatch}\n{_tail(unmarked)}"
    return None

