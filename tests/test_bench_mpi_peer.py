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
from paratrain.bench.p2p import P2PSweep
from paratrain.bench.report import JSON_KEYS
from paratrain.cli import main

# MPI ranks spin while they wait: beside other tests they take the cores those need (and run
# slowly themselves), so these run alone, after the parallel part of `make test`.
pytestmark = pytest.mark.serial
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


@needs_mpi
def test_mpi_ranks_run_every_op_right_even_where_parts_are_uneven(started):
    # 3 elements over 2 ranks: parts of 2 and 1, so the MPI calls with counts (...v) run too
    sweep = Sweep(tuple((op, ("auto",)) for op in OPS), (3, 1024), "float32", 0, 1)
    result, library = mpi_peer.run_collectives(sweep, 2)
    assert (result.world_size, result.transport) == (2, "mpi")
    assert "via mpi4py" in library
    assert [(m.op, m.count) for m in result.measurements] == [
        (op, count) for op in OPS for count in ((0,) if op == "barrier" else (3, 1024))]
    for m in result.measurements:
        assert (m.algo, m.label, m.wrong) == ("mpi", "mpi", 0), m
        assert m.time_us > 0 and len(m.bursts_us) == 1
    assert not _mpi_processes(started[0][-2]), "an MPI rank outlived its run"


@needs_mpi
def test_mpi_ranks_run_the_p2p_tests():
    result, _ = mpi_peer.run_p2p_peer(P2PSweep((8, 4096), 0, 2), 2)
    assert {(r["test"], r["src"], r["dst"], r["bytes"]) for r in result.records} == {
        (test, src, dst, size) for size in (8, 4096)
        for test, src, dst in (("uni", 0, 1), ("uni", 1, 0), ("bi", 0, 1), ("all_to_all", -1, -1))}
    assert all(r["time_us"] > 0 and r["gbps"] > 0 for r in result.records)


@needs_mpi
def test_collectives_alternate_rounds_with_mpi_and_report_ours_over_mpi(tmp_path):
    path = tmp_path / "out.json"
    result = CliRunner().invoke(main, [
        "bench", "collectives", "--peer", "mpi", "--rounds", "2", "--launcher", "threads", "--nproc", "2",
        "--ops", "all_reduce,all_gather", "--min-bytes", "1K", "--max-bytes", "4K", "--factor", "4",
        "--warmup", "0", "--iters", "1", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "# ours / MPI:" in result.output and "# worst ours / MPI:" in result.output
    records = json.loads(path.read_text())
    assert {(r["op"], r["bytes"], r["transport"]) for r in records if r["algo"] == "mpi"} == {
        (op, size, "mpi") for op in ("all_reduce", "all_gather") for size in (1024, 4096)}
    assert {r["algo"] for r in records} >= {"mpi"} and any(r["algo"].startswith("auto") for r in records)
    for r in records:
        assert set(r) == {*JSON_KEYS, "rounds_us"} and len(r["rounds_us"]) == 2 and r["wrong"] == 0


@needs_mpi
def test_p2p_alternates_rounds_with_mpi_and_reports_latency_and_bandwidth(tmp_path):
    path = tmp_path / "p2p.json"
    result = CliRunner().invoke(main, [
        "bench", "p2p", "--peer", "mpi", "--launcher", "threads", "--nproc", "2", "--min-bytes", "8",
        "--max-bytes", "64", "--warmup", "0", "--iters", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "# one-way latency at 8 B" in result.output and "# bandwidth at 64 B" in result.output
    records = json.loads(path.read_text())
    assert {r["transport"] for r in records} == {"fabric", "mpi"}
    assert all(len(r["rounds_us"]) == 2 for r in records)


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
