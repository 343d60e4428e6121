"""A rank that dies: the ranks waiting on it get an error naming the call and the lost rank
(PeerLostError, with the transport's own error as its cause), on the fabric and on gloo; the
processes launcher reports how each failed rank died, root cause first, with its traceback."""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import paratrain
from paratrain.comm import FabricAborted, Group, PeerLostError, TorchTransport, over_process_group
from paratrain.comm.flight import FlightRecords
from paratrain.failure_report import RanksFailed, describe_failed_run, failed_run_error
from paratrain.environment import Settings

from frontend_helpers import forked_program

# ---- the fabric: one rank's exception fails the calls the others are waiting in -------------


def _rank1_raises_while_others_wait(group, seen):
    if group.rank == 1:
        raise ValueError("boom")
    try:
        if group.rank == 0:
            group.recv(torch.empty(2), src=1)
        else:
            group.all_reduce(torch.ones(1000), algo="ring")
    except PeerLostError as error:
        seen[group.rank] = error
        raise


@pytest.mark.timeout(30)  # the group timeout is 300 s: finishing means the waits were woken
def test_fabric_rank_that_raises_fails_the_others_calls_naming_it():
    seen = {}
    with pytest.raises(ValueError, match="boom"):  # the root cause, not its consequences
        paratrain.run(_rank1_raises_while_others_wait, 3, args=(seen,))
    assert str(seen[0]).startswith("rank 0: recv (call #1) lost rank 1: rank 1 failed: ValueError: boom")
    assert str(seen[2]).startswith("rank 2: all_reduce (call #1) lost rank 1: rank 1 failed: ValueError: boom")
    assert (seen[2].rank, seen[2].op, seen[2].seq, seen[2].peer) == (2, "all_reduce", 1, 1)
    assert all(isinstance(error.__cause__, FabricAborted) for error in seen.values())


# ---- gloo: a process that exits mid-collective ----------------------------------------------


def _gloo_rank(rank: int, store_file: str, result_file: str) -> None:
    """Rank 1 leaves without a word after two calls on one tensor (which made it a compiled
    replay); rank 0 is then waiting on it in that replay, then in a ring all-reduce
    of a fresh tensor, and afterwards tries gloo's own all-reduce on the broken connection."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    settings = Settings.resolve()  # this process's: PARATRAIN_SHM and the trace folder, as the test set them
    flight = FlightRecords([rank], settings.trace_dir)
    group = Group(over_process_group(TorchTransport(flight=flight), settings), timeout=60)
    bucket = torch.ones(1000)
    for _ in range(2):
        group.all_reduce(bucket, algo="ring")
    if rank == 1:
        os._exit(3)
    seen = []
    for tensor, algo in ((bucket, "ring"), (torch.ones(1000), "ring"), (torch.ones(1000), "native")):
        try:
            group.all_reduce(tensor, algo=algo)
        except PeerLostError as error:
            seen.append({"type": type(error).__name__, "text": str(error), "cause": type(error.__cause__).__name__,
                         "cause_text": str(error.__cause__), "trace_dir": error.trace_dir,
                         "compiled": group.replays.kind_of(bucket) == "compiled"})
    with open(result_file, "w") as file:
        json.dump(seen, file)
    os._exit(0)  # skip destroy_process_group: its peer is gone


def rank_1_leaves(rank: int, store_file: str, result_file: str, together, waiting) -> None:
    """Two gloo ranks (over shared memory where they share this host) make `together(group)`;
    then rank 1 leaves without a word while rank 0 makes `waiting(group)`, and rank 0 writes
    what it saw into `result_file`: the PeerLostError's text and peer, and the group's kind.
    A target for run_two_gloo_ranks (with functools.partial: both calls module-level)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    group = Group(over_process_group(TorchTransport(), Settings()), timeout=60)
    together(group)
    if rank == 1:
        os._exit(3)
    try:
        waiting(group)
        seen = {"text": f"{waiting.__name__} returned"}
    except PeerLostError as error:
        seen = {"text": str(error), "peer": error.peer, "shm": group.kind == "shm"}
    with open(result_file, "w") as file:
        json.dump(seen, file)
    os._exit(0)  # skip destroy_process_group: its peer is gone


def run_gloo_ranks(target, world: int, tmp_path: Path, out: str) -> list[int | None]:
    """Run target(rank, store file, out) in `world` processes, outside any launcher (which would
    stop the survivors as soon as one exits); returns their exit codes. A process still running
    after 50 s is killed. They are forked from the fork server, which has imported torch (a
    spawned process spends seconds of CPU on that import), under the test's environment as it
    is now (PARATRAIN_SHM, the trace folder)."""
    ranks = [forked_program(target, r, str(tmp_path / "store"), out) for r in range(world)]
    try:
        for process in ranks:
            process.join(50)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [process.exitcode for process in ranks]


def run_two_gloo_ranks(target, tmp_path) -> tuple[list[int | None], Path]:
    """run_gloo_ranks of 2, which write rank 0's result to the file returned."""
    result_file = tmp_path / "rank0.json"
    return run_gloo_ranks(target, 2, tmp_path, str(result_file)), result_file


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", ["0", "1"])
def test_gloo_peer_that_exits_mid_collective_is_named_with_the_call(tmp_path, shared_memory, monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM", shared_memory)  # our algorithms' messages on gloo's sockets, or not
    exit_codes, result_file = run_two_gloo_ranks(_gloo_rank, tmp_path)
    assert exit_codes == [0, 3]
    replay, ring, native = json.loads(result_file.read_text())
    # The bucket's third call is a replay: compiled to gloo's own calls where gloo carries it.
    assert replay["compiled"] == (shared_memory == "0")
    for seq, seen in ((3, replay), (4, ring)):
        assert seen["text"].startswith(f"rank 0: all_reduce (call #{seq}) lost rank 1: ")
        if shared_memory == "1":  # the wait saw rank 1's process gone (transport/shm.py)
            assert "rank 1's process (pid" in seen["text"] and "has exited" in seen["text"]
            assert seen["cause"] == "TransportFailure"
            continue
        assert "by peer" in seen["text"]  # gloo: "Connection closed by peer" or "reset by peer"
        assert ".cc:" not in seen["text"]  # gloo's C++ source location is left out
        assert seen["cause"] == "RuntimeError" and "by peer" in seen["cause_text"]  # gloo's own error
    assert native["text"].startswith("rank 0: all_reduce (call #5) lost rank 1: ")
    assert native["cause"] == "RuntimeError"
    # The failed calls are in rank 0's flight record, dumped where the error says.
    assert ring["trace_dir"] == str(tmp_path / "flight-records")  # conftest's PARATRAIN_TRACE_DIR
    record = json.loads((tmp_path / "flight-records" / "rank0.json").read_text())
    failed = [(c["seq"], c["op"], c["algo"], c["state"]) for c in record["calls"] if c["state"] != "completed"]
    assert failed == [(3, "all_reduce", "ring", "failed"), (4, "all_reduce", "ring", "failed"),
                      (5, "all_reduce", "native", "failed")]


def _gloo_rank_of_three(rank: int, store_file: str, folder: str) -> None:
    """Rank 2 leaves once the group is up; ranks 0 and 1 then wait in a direct barrier and write
    down which rank they say they lost."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=60))
    group = Group(over_process_group(TorchTransport(), Settings.resolve()), timeout=60)
    group.barrier(algo="native")  # every connection is up
    if rank == 2:
        os._exit(3)
    try:
        group.barrier(algo="direct")
        lost = None
    except PeerLostError as error:
        lost = error.peer
    Path(folder, f"rank{rank}.json").write_text(json.dumps(lost))
    os._exit(0)  # skip destroy_process_group: its peer is gone


@pytest.mark.timeout(60)
def test_a_direct_barrier_names_the_lost_rank_on_every_survivor(tmp_path, monkeypatch):
    """(`auto`'s barrier across hosts, where gloo's own does not say which rank it lost.) As a
    reduce to rank 0 and a broadcast back, rank 1 would wait on rank 0 and name it."""
    monkeypatch.setenv("PARATRAIN_SHM", "0")  # gloo's sockets between the three
    assert run_gloo_ranks(_gloo_rank_of_three, 3, tmp_path, str(tmp_path)) == [0, 0, 3]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [2, 2]


# ---- the processes launcher: how each failed rank died --------------------------------------


def _rank1_kills_itself_mid_run(group):
    group.all_reduce(torch.ones(4))
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    group.all_reduce(torch.ones(4))  # rank 0 waits here for a rank that is gone


@pytest.mark.timeout(90)  # the ranks' timeout is 120 s: finishing first means nobody hung
def test_processes_run_names_the_rank_killed_by_a_signal():
    with pytest.raises(RuntimeError) as raised:
        paratrain.run(_rank1_kills_itself_mid_run, 2, launcher="processes", timeout=120)
    first_line = str(raised.value).splitlines()[0]
    assert first_line == (
        "rank 1 of 2 failed (launcher=processes): killed by SIGKILL; no traceback (the process was killed)"
    )


def _rank1_raises_boom(group):
    group.barrier()
    if group.rank == 1:
        raise ValueError("boom")
    group.all_reduce(torch.ones(4))


@pytest.mark.timeout(90)
def test_processes_run_shows_the_failed_rank_traceback():
    with pytest.raises(RuntimeError) as raised:
        paratrain.run(_rank1_raises_boom, 2, launcher="processes", timeout=120)
    lines = str(raised.value).splitlines()
    assert lines[0] == "rank 1 of 2 failed (launcher=processes): ValueError: boom [exit code 1]"
    assert "  Traceback (most recent call last):" in lines
    assert any("in _rank1_raises_boom" in line for line in lines)
    assert 'raise ValueError("boom")' in [line.strip() for line in lines]
    assert "  ValueError: boom" in lines


# ---- the report itself, from torch's failure records ---------------------------------------


def _error_file(path, message: str, traceback: str, timestamp: int) -> str:
    # the layout torch's @record writes
    data = {"message": {"message": message, "extraInfo": {"py_callstack": traceback, "timestamp": str(timestamp)}}}
    path.write_text(json.dumps(data))
    return str(path)


def test_report_puts_the_rank_that_died_before_the_ranks_that_lost_it(tmp_path):
    lost = _error_file(tmp_path / "error0.json", "PeerLostError: rank 0: all_reduce (call #5) lost rank 2: gone",
                       "Traceback (most recent call last):\n  File \"x.py\", line 1\nPeerLostError: gone\n", 100)
    failures = {
        0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=lost),  # reported earlier...
        2: ProcessFailure(local_rank=2, pid=12, exitcode=-9, error_file="<N/A>"),  # ...but the cause
        3: ProcessFailure(local_rank=3, pid=13, exitcode=3, error_file="<N/A>"),
    }
    # rank 1 was stopped by the launcher before it was reported: its flight record tells
    (tmp_path / "rank1.json").write_text(json.dumps({
        "rank": 1, "run_id": "run-x", "dumped_at": 50.0, "calls": [], "capacity": 64,
        "error": "PeerLostError: rank 1: all_reduce (call #5) lost rank 2: gone",
    }))
    (tmp_path / "rank4.json").write_text(json.dumps({  # another run's record: not ours
        "rank": 4, "run_id": "run-y", "dumped_at": 50.0, "calls": [], "capacity": 64, "error": "PeerLostError: old",
    }))
    lines = describe_failed_run(failures, 5, "run-x", str(tmp_path)).splitlines()
    heads = [line for line in lines if line.startswith("rank ")]
    assert heads[0] == (
        "rank 2 of 5 failed (launcher=processes): killed by SIGKILL; no traceback (the process was killed)"
    )
    assert heads[1] == (
        "rank 3 of 5 failed after it: exit code 3; no traceback (it exited without raising: os._exit, "
        "or a crash in native code)"
    )
    assert set(heads[2:]) == {
        "rank 0 of 5 failed after it: PeerLostError: rank 0: all_reduce (call #5) lost rank 2: gone [exit code 1]",
        "rank 1 of 5 failed after it: PeerLostError: rank 1: all_reduce (call #5) lost rank 2: gone "
        "(from its flight record; the launcher stopped it)",
    }
    assert "  PeerLostError: gone" in lines  # rank 0's traceback, indented
    assert lines[-1] == f"flight records: {tmp_path} (read them with: paratrain debug hang {tmp_path})"


@pytest.mark.parametrize("message, exitcode, users", [
    (None, -signal.SIGKILL, True),  # killed: by someone, or the out-of-memory killer
    (None, -signal.SIGSEGV, False),  # a crash: a bug
    ("CheckpointError: checkpoint file x is corrupted", 1, True),
    ("PermissionError: [Errno 13] Permission denied: 'ckpt'", 1, True),
    ("PeerLostError: rank 0: all_reduce (call #5) lost rank 1: gone", 1, True),
    ("ValueError: boom", 1, False),
])
def test_a_failed_run_is_one_line_when_the_user_can_act_on_its_root_cause(tmp_path, message, exitcode, users):
    import paratrain.train.checkpoint  # noqa: F401 - as `paratrain train` has: the class a rank raised is known
    error_file = _error_file(tmp_path / "error.json", message, "Traceback ...\n", 100) if message else "<N/A>"
    failure = ProcessFailure(local_rank=1, pid=11, exitcode=exitcode, error_file=error_file)
    error = failed_run_error({1: failure}, 2, "run-x")
    assert isinstance(error, RanksFailed) == users
    assert str(error).splitlines()[0].startswith("rank 1 of 2 failed (launcher=processes): ")
    if users:
        assert error.lines() == [str(error).splitlines()[0]]  # the traceback only with --debug
