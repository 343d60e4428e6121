"""The flight recorder keeps each rank's last 64 calls; a timeout, a lost peer or a mismatch
dumps every rank's record; `paratrain debug hang` reads the dumps and names the rank behind or
the calls that differ."""

from __future__ import annotations

import json
import re
import tempfile

import pytest
import torch
from click.testing import CliRunner

import paratrain
from paratrain.cli import main
from paratrain.comm import CollectiveMismatchError, CommTimeoutError, dump_flight_record
from paratrain.comm.flight import CAPACITY


def _hang(directory) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["debug", "hang", str(directory)])
    return result.exit_code, result.output.splitlines()


# ---- what is recorded -----------------------------------------------------------------------


def _many_calls_then_dump(group, directory):
    for _ in range(CAPACITY + 6):
        group.all_reduce(torch.ones(3, 2), algo="ring")
    pairs = group.split([[0, 2], [1, 3]])  # a subgroup records into the same per-rank buffer
    pairs.broadcast(torch.ones(5, dtype=torch.float64), root=1, algo="tree")
    if pairs.rank == 0:
        pairs.send(torch.ones(7, dtype=torch.int32), dst=1)
    else:
        pairs.recv(torch.empty(7, dtype=torch.int32), src=0)
    group.barrier()
    if group.rank == 0:
        dump_flight_record(group, directory)


def test_recorder_keeps_the_last_64_calls_with_shapes_algorithms_and_global_ranks(tmp_path):
    paratrain.run(_many_calls_then_dump, 4, args=(str(tmp_path),), timeout=30)
    records = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)}  # all threads'
    calls = records[3]["calls"]
    assert len(calls) == CAPACITY
    oldest, *_, reduce, broadcast, recv, barrier = calls
    made = CAPACITY + 6 + 3  # the all-reduces, then a broadcast, a receive and a barrier
    assert (oldest["op"], oldest["seq"]) == ("all_reduce", made - CAPACITY + 1)
    assert {k: reduce[k] for k in ("group", "kind", "seq", "op", "shape", "dtype", "reduce_op", "algo", "state")} == {
        "group": [0, 1, 2, 3], "kind": "collective", "seq": CAPACITY + 6, "op": "all_reduce", "shape": [3, 2],
        "dtype": "float32", "reduce_op": "sum", "algo": "ring", "state": "completed",
    }
    assert reduce["started"] <= reduce["finished"]
    assert {k: broadcast[k] for k in ("group", "seq", "op", "shape", "dtype", "root", "algo")} == {
        "group": [1, 3], "seq": 1, "op": "broadcast", "shape": [5], "dtype": "float64", "root": 1, "algo": "tree",
    }
    # a p2p call names its peer by its rank in the world (rank 1 of the world is rank 0 of [1, 3])
    assert {k: recv[k] for k in ("group", "kind", "seq", "op", "peer", "shape", "dtype", "state")} == {
        "group": [1, 3], "kind": "p2p", "seq": 1, "op": "recv", "peer": 1, "shape": [7], "dtype": "int32",
        "state": "completed",
    }
    assert (barrier["seq"], barrier["op"], barrier["group"]) == (CAPACITY + 7, "barrier", [0, 1, 2, 3])
    assert records[3]["rank"] == 3 and records[3]["error"] is None


def test_debug_hang_finds_no_problem_in_a_healthy_run(tmp_path):
    paratrain.run(_many_calls_then_dump, 4, args=(str(tmp_path),), timeout=30)
    code, lines = _hang(tmp_path)
    assert code == 0, lines
    assert lines[0] == "no problem found: every rank is at the same call of every group"


# ---- a staged hang: rank 2 skips an all-reduce ------------------------------------------------


def _rank2_skips_the_third_all_reduce(group):
    for call in range(1, 4):
        if group.rank == 2 and call == 3:
            continue
        group.all_reduce(torch.ones(4))


def test_staged_hang_dumps_every_rank_and_debug_hang_names_the_rank_behind(tmp_path, monkeypatch):
    trace_dir = tmp_path / "traces"
    monkeypatch.setenv("PARATRAIN_TRACE_DIR", str(trace_dir))
    with pytest.raises(CommTimeoutError) as raised:
        paratrain.run(_rank2_skips_the_third_all_reduce, 3, timeout=1)
    error = raised.value
    assert error.trace_dir == str(trace_dir)
    assert str(error).splitlines()[1] == f"  flight records: {trace_dir}"
    assert sorted(p.name for p in trace_dir.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]

    code, lines = _hang(trace_dir)
    assert code == 1
    assert re.fullmatch(
        r"rank 2 is behind in group \[0, 1, 2\]: it never started call #3, "
        r"all_reduce\(float32\[4\], op=sum\) \[algo=\w+\], which ranks 0, 1 started", lines[0]), lines[0]
    assert any(re.match(r"  rank 2: call #2 all_reduce\(.*\] completed", line) for line in lines), lines
    assert any(re.match(r"  rank 0: call #3 all_reduce\(.*\] failed", line) for line in lines), lines


def test_default_trace_dir_is_a_fresh_temporary_folder_named_in_the_error(tmp_path, monkeypatch):
    monkeypatch.delenv("PARATRAIN_TRACE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # so the folder is made under tmp_path
    with pytest.raises(CommTimeoutError) as raised:
        paratrain.run(_rank2_skips_the_third_all_reduce, 3, timeout=0.5)
    (folder,) = tmp_path.glob("paratrain-trace-*")
    assert raised.value.trace_dir == str(folder)
    assert str(raised.value).endswith(f"flight records: {folder}")
    assert sorted(p.name for p in folder.iterdir()) == ["rank0.json", "rank1.json", "rank2.json"]


# ---- calls that differ -----------------------------------------------------------------------


def _rank2_broadcasts_instead(group):
    group.all_reduce(torch.ones(4))
    if group.rank == 2:
        group.broadcast(torch.ones(4))
    else:
        group.all_reduce(torch.ones(4))


@pytest.mark.parametrize("debug", [True, False])
def test_debug_hang_says_which_calls_differ(tmp_path, debug):
    # Debug mode's check raises CollectiveMismatchError on every rank; without it the ranks
    # run into each other's different calls and fail some other way. Either way the dumps
    # show the difference.
    with pytest.raises(CollectiveMismatchError if debug else Exception):
        paratrain.run(_rank2_broadcasts_instead, 3, timeout=1, debug=debug)
    code, lines = _hang(tmp_path / "flight-records")  # conftest's PARATRAIN_TRACE_DIR
    assert code == 1
    assert re.fullmatch(
        r"call #2 differs in group \[0, 1, 2\]: ranks 0, 1 called all_reduce\(float32\[4\], op=sum\) "
        r"\[algo=\w+\]; rank 2 called broadcast\(float32\[4\], root=0\) \[algo=\w+\]", lines[0]), lines[0]


# ---- point-to-point --------------------------------------------------------------------------


def _rank1_receives_from_a_silent_rank0(group):
    group.barrier()
    if group.rank == 1:
        group.recv(torch.empty(3), src=0)


def test_debug_hang_names_a_receive_that_never_completed(tmp_path):
    with pytest.raises(CommTimeoutError):
        paratrain.run(_rank1_receives_from_a_silent_rank0, 2, timeout=0.5)
    code, lines = _hang(tmp_path / "flight-records")
    assert code == 1
    assert re.fullmatch(
        r"rank 1 did not complete recv\(float32\[3\]\) from rank 0 \(p2p call #1 in group \[0, 1\]\): "
        r"failed after 0\.5\d*s", lines[0]), lines[0]


def test_debug_hang_refuses_a_folder_without_records(tmp_path):
    code, lines = _hang(tmp_path)
    assert code == 2
    assert f"no flight records (rank<N>.json) in {tmp_path}" in lines[-1]
