"""MPI as the benchmarks' peer (`bench collectives|p2p --peer mpi`): the MPI ranks return right
results through the same sweep code as ours, the rounds alternate and land in the table and the
JSON, nothing of the MPI side outlives a run, and without the `mpi` extra the command says so in
one line.

Sizes are tiny and iterations one or two: speed is never asserted. The tests that start MPI
ranks are skipped only where mpi4py is not installed (`make test` installs it: the `mpi` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain import lifetime
from paratrain.bench import collectives_cli, mpi_peer
from paratrain.bench.collectives import Sweep
from paratrain.bench.report import JSON_KEYS
from paratrain.cli import main

# These run beside the rest of `make test`. MPI ranks spin while they wait, but here they wait
# little: the file took 36 CPU-seconds on two cores and the same on one (`taskset -c 0`), where
# spinning ranks would have taken every core they were given.
needs_mpi = pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                               reason="the mpi extra is not installed: pip install -e '.[mpi]'")
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "barrier")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test reads the user's algorithm table or spends time measuring memory bandwidth."""
    monkeypatch.setenv("PARATRAIN_ALGO_TABLE", str(tmp_path / "default-table.json"))
    monkeypatch.setattr(collectives_cli, "copy_bandwidth_gbps", lambda device: 12.5)


def _mpi_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (a run's own spec file)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if marker in command:
            found.append(f"{pid}: {command}")
    return found


@pytest.fixture
def started(monkeypatch) -> list[list[str]]:
    """The command lines of the mpiexec runs a test starts."""
    commands: list[list[str]] = []
    popen = subprocess.Popen

    def recording(command, **kwargs):
        commands.append(list(command))
        return popen(command, **kwargs)

    monkeypatch.setattr(mpi_peer.subprocess, "Popen", recording)
    return commands


# Each start of MPI ranks costs two fresh interpreters (seconds of CPU): each test below runs two
# rounds of each side once, and checks both what the MPI ranks measured and what the command made
# of it.

@needs_mpi
def test_collectives_alternate_rounds_with_mpi_whose_ranks_run_every_op_right_even_in_uneven_parts(tmp_path, started):
    # 12 B are 3 elements over 2 ranks: parts of 2 and 1, so the MPI calls with counts (...v) run too
    path = tmp_path / "out.json"
    result = CliRunner().invoke(main, [
        "bench", "collectives", "--peer", "mpi", "--rounds", "2", "--launcher", "threads", "--nproc", "2",
        "--ops", ",".join(OPS), "--min-bytes", "12", "--max-bytes", "3K", "--factor", "256",
        "--warmup", "0", "--iters", "1", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "# ours / MPI:" in result.output and "# worst ours / MPI:" in result.output
    assert "via mpi4py" in result.output
    records = json.loads(path.read_text())
    mpi = [r for r in records if r["algo"] == "mpi"]
    assert sorted((r["op"], r["count"]) for r in mpi) == sorted(
        (op, count) for op in OPS for count in ((0,) if op == "barrier" else (3, 768)))
    assert all((r["transport"], r["world_size"]) == ("mpi", 2) and r["time_us"] > 0 for r in mpi)
    assert any(r["algo"].startswith("auto") for r in records)
    for r in records:
        assert set(r) == {*JSON_KEYS, "rounds_us"} and len(r["rounds_us"]) == 2 and r["wrong"] == 0, r
    assert len(started) == 2, "one start of MPI ranks per round"
    assert not [line for command in started for line in _mpi_processes(command[-2])], "an MPI rank outlived its run"


@needs_mpi
def test_p2p_alternates_rounds_with_mpi_whose_ranks_run_every_p2p_test(tmp_path):
    path = tmp_path / "p2p.json"
    result = CliRunner().invoke(main, [
        "bench", "p2p", "--peer", "mpi", "--launcher", "threads", "--nproc", "2", "--min-bytes", "8",
        "--max-bytes", "4K", "--factor", "512", "--warmup", "0", "--iters", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "# one-way latency at 8 B" in result.output and "# bandwidth at 4096 B" in result.output
    records = json.loads(path.read_text())
    assert {(r["transport"], r["test"], r["src"], r["dst"], r["bytes"]) for r in records} == {
        (transport, test, src, dst, size) for transport in ("fabric", "mpi") for size in (8, 4096)
        for test, src, dst in (("uni", 0, 1), ("uni", 1, 0), ("bi", 0, 1), ("all_to_all", -1, -1))}
    assert all(r["time_us"] > 0 and r["gbps"] > 0 and len(r["rounds_us"]) == 2 for r in records)


class InterruptedWhileWaiting(subprocess.Popen):
    """mpiexec, started; then the wait for it is interrupted, as by Ctrl-C once the ranks run."""

    trees: list[list[tuple[int, int]]] = []  # each run's (pid, start time), mpiexec's first

    def wait(self, timeout=None):
        if timeout is None:  # the wait for the whole run
            time.sleep(1.0)
            self.trees.append([(self.pid, lifetime.start_time(self.pid)), *lifetime.descendants(self.pid)])
            raise KeyboardInterrupt
        return super().wait(timeout)


@needs_mpi
def test_an_interrupted_run_ends_every_mpi_process(monkeypatch):
    monkeypatch.setattr(mpi_peer.subprocess, "Popen", InterruptedWhileWaiting)
    with pytest.raises(KeyboardInterrupt):
        mpi_peer.run_collectives(Sweep((("all_reduce", ("auto",)),), (1024,), "float32", 0, 1), 2)
    tree = InterruptedWhileWaiting.trees[-1]
    assert len(tree) >= 3, tree  # mpiexec, a proxy, the ranks: all were running
    alive = [pid for pid, started in tree if lifetime.start_time(pid) == started]
    assert not alive, f"MPI processes outlived an interrupted run: {alive}"


@pytest.mark.parametrize("command", ["collectives", "p2p"])
def test_without_the_mpi_extra_peer_mpi_says_how_to_install_it_in_one_line(monkeypatch, command):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # as if not installed: find_spec gives None
    result = CliRunner().invoke(main, ["bench", command, "--peer", "mpi", "--launcher", "threads"])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"paratrain bench {command}: error: --peer mpi needs mpi4py and an MPI library: pip install -e '.[mpi]'"]


@pytest.mark.parametrize("args, said", [
    (["--dtype", "bfloat16"], "Invalid value for '--dtype': --peer mpi measures float32 or int64"),
    (["--tune"], "--peer runs ranks of its own beside ours: it takes no --tune"),
])
def test_what_peer_mpi_cannot_measure_is_refused_in_one_line(args, said):
    result = CliRunner().invoke(main, ["bench", "collectives", "--peer", "mpi", *args])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1
    assert said in result.output
