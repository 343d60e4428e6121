"""Failing loudly, early and with a name: timeouts say who waited on what for whom, debug mode
catches ranks making different calls, bad arguments are refused before anything is sent, and
one rank's exception ends the whole threads world at once instead of leaving it hanging.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

import paratrain
from paratrain.comm import CollectiveMismatchError, CommTimeoutError, Fabric, Group
from paratrain.comm.algorithms import algorithms_for
from paratrain.environment import Settings, SettingsError

from collective_checks import sweep  # the fabric matrix's checkers, for debug mode

SHORT_TIMEOUT_S = 0.5


# ---- timeouts ---------------------------------------------------------------------------------


def _rank0_makes_a_second_all_reduce_alone(group):
    group.all_reduce(torch.ones(4), algo="ring")  # call #1, made by both ranks
    if group.rank == 0:
        group.all_reduce(torch.ones(4), algo="ring")  # call #2: rank 1 never joins


def test_collective_timeout_names_rank_op_call_number_and_peer(tmp_path):
    with pytest.raises(CommTimeoutError) as raised:
        paratrain.run(_rank0_makes_a_second_all_reduce_alone, 2, timeout=SHORT_TIMEOUT_S)
    assert str(raised.value) == (
        "rank 0: all_reduce (call #2) timed out after 0.5s waiting for rank 1\n"
        f"  flight records: {tmp_path / 'flight-records'}"  # conftest's PARATRAIN_TRACE_DIR
    )
    error = raised.value
    assert (error.rank, error.op, error.seq, error.peer) == (0, "all_reduce", 2, 1)
    assert isinstance(error, TimeoutError)


def _rank1_receives_from_a_silent_rank0(group):
    if group.rank == 1:
        group.recv(torch.empty(3), src=0)


def test_recv_timeout_names_the_rank_it_waited_for():
    with pytest.raises(CommTimeoutError, match=re.escape(
        "rank 1: recv (call #1) timed out after 0.5s waiting for rank 0"
    )):
        paratrain.run(_rank1_receives_from_a_silent_rank0, 2, timeout=SHORT_TIMEOUT_S)


def _rank2_enters_a_native_barrier_alone(group):
    if group.rank == 2:
        group.barrier(algo="native")


def test_native_collective_timeout_says_it_waited_for_the_other_ranks():
    with pytest.raises(CommTimeoutError, match=re.escape(
        "rank 2: barrier (call #1) timed out after 0.5s waiting for the other ranks"
    )):
        paratrain.run(_rank2_enters_a_native_barrier_alone, 3, timeout=SHORT_TIMEOUT_S)


def _time_out_on_gloo(group):
    # The world keeps its long timeout (a slow process start on a busy host must not fail the
    # rendezvous); rank 0 talks through a group that gives up after SHORT_TIMEOUT_S. Rank 1 stays
    # out of gloo, where rank 0's exit would fail it too, until the launcher stops it.
    if group.rank == 0:
        Group(group.transport, timeout=SHORT_TIMEOUT_S).all_reduce(torch.ones(4), algo="ring")
    else:
        time.sleep(60)


def test_gloo_timeout_names_rank_op_call_number_and_peer():
    with pytest.raises(RuntimeError, match=re.escape(
        "rank 0: all_reduce (call #1) timed out after 0.5s waiting for rank 1"
    )):
        paratrain.run(_time_out_on_gloo, 2, launcher="processes", timeout=60)


def _report_timeout(group):
    return group.timeout


def test_paratrain_timeout_env_var_sets_the_group_timeout(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "0.5")
    assert paratrain.run(_report_timeout, 2) == {0: 0.5, 1: 0.5}
    with pytest.raises(CommTimeoutError, match=r"timed out after 0\.5s waiting for rank 0"):
        paratrain.run(_rank1_receives_from_a_silent_rank0, 2)


def test_explicit_timeout_overrides_the_env_var(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "0.5")
    assert paratrain.run(_report_timeout, 2, timeout=7) == {0: 7.0, 1: 7.0}


@pytest.mark.parametrize("raw, problem", [
    ("abc", "PARATRAIN_TIMEOUT must be a number of seconds, got 'abc'"),
    ("0", "PARATRAIN_TIMEOUT must be positive and finite, got '0'"),
    ("-3", "PARATRAIN_TIMEOUT must be positive and finite, got '-3'"),
    ("inf", "PARATRAIN_TIMEOUT must be positive and finite, got 'inf'"),
    ("nan", "PARATRAIN_TIMEOUT must be positive and finite, got 'nan'"),
])
def test_bad_paratrain_timeout_is_refused_with_its_value(monkeypatch, raw, problem):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", raw)
    with pytest.raises(SettingsError, match=re.escape(problem)):
        Settings.resolve()
    assert Group(Fabric(1).endpoint(0)).timeout == Settings.timeout  # a Group reads no environment


def test_bad_paratrain_timeout_fails_the_threads_run(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="PARATRAIN_TIMEOUT must be a number of seconds"):
        paratrain.run(_report_timeout, 2)


# ---- debug mode: every rank must make the same call ----------------------------------------


MISMATCHES = {
    # name: (what rank 1 calls while the others call all_reduce(float32[4], op=sum), how it reads)
    "other_op": (lambda g: g.all_gather(torch.zeros(4 * g.size), torch.ones(4)),
                 "all_gather(float32[12])"),
    "other_shape": (lambda g: g.all_reduce(torch.ones(5)), "all_reduce(float32[5], op=sum)"),
    "other_dtype": (lambda g: g.all_reduce(torch.ones(4, dtype=torch.int64)),
                    "all_reduce(int64[4], op=sum)"),
    "other_reduce_op": (lambda g: g.all_reduce(torch.ones(4), op="max"),
                        "all_reduce(float32[4], op=max)"),
}


def _rank1_calls_something_else(group, name):
    if group.rank == 1:
        MISMATCHES[name][0](group)
    else:
        group.all_reduce(torch.ones(4))


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_debug_mode_names_the_ranks_that_called_something_else(name):
    with pytest.raises(CollectiveMismatchError) as raised:
        paratrain.run(_rank1_calls_something_else, 3, args=(name,), debug=True, timeout=10)
    message = str(raised.value)
    assert "collective call #1 differs across ranks" in message
    assert re.search(r"ranks 0, 2 called all_reduce\(float32\[4\], op=sum\) \[algo=\w+\]", message), message
    assert re.search(rf"rank 1 called {re.escape(MISMATCHES[name][1])} \[algo=\w+\]", message), message


def _broadcast_from(group, roots):
    group.broadcast(torch.ones(4), root=roots[group.rank])


def test_debug_mode_catches_ranks_broadcasting_from_different_roots():
    with pytest.raises(CollectiveMismatchError, match=r"rank 1 called broadcast\(float32\[4\], root=1\)"):
        paratrain.run(_broadcast_from, 2, args=([0, 1],), debug=True, timeout=10)


def test_paratrain_debug_env_var_turns_the_check_on(monkeypatch):
    monkeypatch.setenv("PARATRAIN_DEBUG", "1")
    with pytest.raises(CollectiveMismatchError, match=r"rank 1 called all_gather\(float32\[8\]\)"):
        paratrain.run(_rank1_calls_something_else, 2, args=("other_op",), timeout=10)


def _matching_calls_in_debug_mode(group):
    failures = []
    for op_name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all"):
        failures += sweep(group, op_name, [torch.float32], counts=[0, 5, 300])
    for algo in algorithms_for("barrier"):
        group.barrier(algo=algo)
    return group.debug, failures


def test_debug_mode_lets_matching_calls_through_with_correct_results():
    results = paratrain.run(_matching_calls_in_debug_mode, 3, debug=True, timeout=30)
    assert all(debug for debug, _ in results.values())
    failures = [line for _, lines in results.values() for line in lines]
    assert not failures, "\n".join(failures[:40])


# ---- bad arguments: refused on the calling rank, before anything is sent ----------------------


@pytest.fixture
def rank0_of_two():
    """Rank 0 of a two-rank fabric whose rank 1 never runs: a call that is not refused up
    front waits for rank 1 and fails with a timeout instead of the expected error."""
    return Group(Fabric(2).endpoint(0), timeout=2.0)


def _valid(op_name: str) -> str:
    return re.escape(f"valid: {', '.join(algorithms_for(op_name))}")


BAD_CALLS = {
    "unknown_algorithm": (
        lambda g: g.all_reduce(torch.ones(4), algo="bogus"),
        ValueError, r"all_reduce: unknown algorithm 'bogus'; " + _valid("all_reduce"),
    ),
    "tree_is_not_an_all_gather": (
        lambda g: g.all_gather(torch.zeros(8), torch.ones(4), algo="tree"),
        ValueError, r"all_gather: unknown algorithm 'tree'; " + _valid("all_gather"),
    ),
    "hd_is_not_a_broadcast": (
        lambda g: g.broadcast(torch.ones(4), algo="hd"),
        ValueError, r"broadcast: unknown algorithm 'hd'; " + _valid("broadcast"),
    ),
    "tree_is_not_an_all_to_all": (
        lambda g: g.all_to_all(torch.zeros(4), torch.ones(4), algo="tree"),
        ValueError, r"all_to_all: unknown algorithm 'tree'; " + _valid("all_to_all"),
    ),
    "unknown_reduce_op": (
        lambda g: g.all_reduce(torch.ones(4), op="prod"),
        ValueError, r"unknown reduce op 'prod'; valid ops: sum, avg, max, min",
    ),
    "unknown_reduce_op_in_reduce_scatter": (
        lambda g: g.reduce_scatter(torch.zeros(2), torch.ones(4), op="mean"),
        ValueError, r"unknown reduce op 'mean'",
    ),
    "unknown_reduce_op_in_reduce": (
        lambda g: g.reduce(torch.ones(4), op="product"),
        ValueError, r"unknown reduce op 'product'",
    ),
    "broadcast_root_too_large": (
        lambda g: g.broadcast(torch.ones(4), root=2),
        ValueError, re.escape("broadcast: root 2 out of range [0, 2)"),
    ),
    "reduce_root_negative": (
        lambda g: g.reduce(torch.ones(4), root=-1),
        ValueError, re.escape("reduce: root -1 out of range [0, 2)"),
    ),
    "reduce_scatter_output_too_small": (
        lambda g: g.reduce_scatter(torch.zeros(4), torch.ones(10)),
        ValueError, re.escape("reduce_scatter: 'output' has 4 elements, expected 5 (part 0 of 10)"),
    ),
    "reduce_scatter_uneven_output": (
        lambda g: g.reduce_scatter(torch.zeros(5), torch.ones(11)),  # rank 0 gets 6 of 11
        ValueError, re.escape("'output' has 5 elements, expected 6"),
    ),
    "all_gather_input_wrong_size": (
        lambda g: g.all_gather(torch.zeros(10), torch.ones(6)),
        ValueError, re.escape("all_gather: 'input' has 6 elements, expected 5"),
    ),
    "all_to_all_output_wrong_size": (
        lambda g: g.all_to_all(torch.zeros(9), torch.ones(10)),
        ValueError, re.escape("all_to_all: 'output' has 9 elements, expected 10"),
    ),
    "all_reduce_non_tensor": (
        lambda g: g.all_reduce([1.0, 2.0]),
        TypeError, r"all_reduce: 'tensor' must be a torch.Tensor, got list",
    ),
    "all_gather_non_tensor_output": (
        lambda g: g.all_gather(None, torch.ones(2)),
        TypeError, r"all_gather: 'output' must be a torch.Tensor, got NoneType",
    ),
    "send_non_tensor": (
        lambda g: g.send(3.0, 1),
        TypeError, r"'tensor' must be a torch.Tensor, got float",
    ),
    "all_gather_mixed_dtypes": (
        lambda g: g.all_gather(torch.zeros(8), torch.ones(4, dtype=torch.int64)),
        TypeError, r"all_gather: output dtype torch.float32 differs from input dtype torch.int64",
    ),
    "reduce_scatter_mixed_dtypes": (
        lambda g: g.reduce_scatter(torch.zeros(2, dtype=torch.float16), torch.ones(4)),
        TypeError, r"reduce_scatter: output dtype torch.float16 differs from input dtype torch.float32",
    ),
    "all_to_all_mixed_dtypes": (
        lambda g: g.all_to_all(torch.zeros(4, dtype=torch.int64), torch.ones(4)),
        TypeError, r"all_to_all: output dtype torch.int64 differs",
    ),
    "send_to_missing_rank": (
        lambda g: g.send(torch.ones(2), 2),
        ValueError, re.escape("peer rank 2 out of range [0, 2)"),
    ),
    "recv_from_negative_rank": (
        lambda g: g.recv(torch.ones(2), -1),
        ValueError, re.escape("peer rank -1 out of range [0, 2)"),
    ),
    "isend_tag_out_of_range": (
        lambda g: g.isend(torch.ones(2), 1, tag=-1),
        ValueError, r"tag must be an int in \[0, 1048576\), got -1",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_argument_is_refused_with_a_clear_message(rank0_of_two, name):
    call, error_type, pattern = BAD_CALLS[name]
    with pytest.raises(error_type, match=pattern):
        call(rank0_of_two)


def test_group_refuses_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout must be positive"):
        Group(Fabric(1).endpoint(0), timeout=0)


def _rank0_makes_a_bad_call_first(group):
    if group.rank == 0:
        with pytest.raises(ValueError):
            group.all_reduce(torch.ones(4), algo="bogus")
    tensor = torch.full((4,), float(group.rank + 1))
    return group.all_reduce(tensor, algo="ring").tolist()


def test_refused_call_does_not_put_ranks_out_of_step():
    results = paratrain.run(_rank0_makes_a_bad_call_first, 2, timeout=10)
    assert results == {0: [3.0] * 4, 1: [3.0] * 4}


def _receive_into_wrong_size(group):
    if group.rank == 0:
        group.send(torch.ones(3), 1)
    else:
        group.recv(torch.empty(4), 0)


def test_receive_buffer_of_the_wrong_size_names_both_sizes():
    with pytest.raises(ValueError, match=r"message from rank 0 has 3 elements, the receive buffer 4"):
        paratrain.run(_receive_into_wrong_size, 2, timeout=10)


def _noop(group):
    return group.rank


@pytest.mark.parametrize("launcher, nproc, problem", [
    ("mpi", 2, "unknown launcher 'mpi'; valid: threads, processes"),
    ("threads", 0, "nproc must be a positive integer, got 0"),
    ("threads", -2, "nproc must be a positive integer, got -2"),
    ("processes", 0, "nproc must be a positive integer, got 0"),
    ("threads", 2.0, "nproc must be a positive integer, got 2.0"),
])
def test_run_refuses_bad_launcher_or_world_size(launcher, nproc, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        paratrain.run(_noop, nproc, launcher=launcher)


# ---- one rank failing ends the threads world ---------------------------------------------------


def _rank1_fails_while_the_others_wait(group):
    if group.rank == 1:
        raise ValueError("rank one gave up")
    if group.rank == 0:
        group.recv(torch.empty(2), src=1)  # a message rank 1 will never send
    elif group.rank == 2:
        group.all_reduce(torch.ones(1000), algo="ring")
    else:
        group.barrier(algo="native")


@pytest.mark.timeout(30)  # the ranks' own timeout is 300 s: finishing at all means they woke up
def test_exception_on_one_rank_reaches_the_caller_and_names_the_rank():
    with pytest.raises(ValueError, match="rank one gave up") as raised:
        paratrain.run(_rank1_fails_while_the_others_wait, 4)
    assert "(raised on rank 1 of 4, launcher=threads)" in raised.value.__notes__


def test_more_ranks_than_gpus_run_on_gloo_with_a_warning(monkeypatch):
    """NCCL refuses two ranks on one GPU: a 1-GPU machine asked for 2 ranks runs them on the
    CPU (gloo) and says so, instead of failing in torch.cuda.set_device(1)."""
    from paratrain.launch import gpus_for, transport_kind

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpus_for(1)
    with pytest.warns(UserWarning, match="2 ranks on a machine with 1 GPU"):
        assert not gpus_for(2)
    assert transport_kind("processes", 1) == "nccl"
    assert transport_kind("processes", 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gpus_for(1)
