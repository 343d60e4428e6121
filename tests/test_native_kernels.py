"""The shared segment's one-shot calls in native code (comm/native): the library builds once per
source into the cache and is found there after, a compiler that fails leaves the torch path with
a reason, and a replayed call through the kernels gives the same bits as the same call through
torch's ops, on 2 and 3 processes, for each dtype they take, for one piece and several, when the
peers arrive at once, late
(the wait goes back to Python) and asleep on their doorbell (they must be rung); a plan's copies,
reads and checks (the all-to-alls'; their results are tested in test_all_to_all_uneven.py); with
PARATRAIN_NATIVE=0 no group loads them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

import pytest
import torch

import paratrain
from paratrain.comm import Group, native
from paratrain.comm.transport.shm_arena import Arena, slot_bytes_for

from collective_checks import assert_no_failures
from test_p2p import RUN_TIMEOUT_S

DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)
CALLS = 6  # the first two take the whole path, the rest run the replay; both halves, twice


@pytest.fixture(scope="module")
def buildable(tmp_path_factory):
    """The kernels as `native.load` built them into an empty cache: (kernels, why, the cache).
    The tests of the kernels themselves need a C compiler and Python's headers; a machine
    without them skips those tests, saying which is missing (their fallback is tested below
    on every machine, by making the compiler go missing). One compile serves every test."""
    cache = tmp_path_factory.mktemp("native-cache")
    kernels, why = native.load(str(cache))
    missing = why.removeprefix("native kernels not built: ")
    if kernels is None and missing.startswith(("no C compiler", "no Python.h")):
        pytest.skip(f"native kernels cannot be built here: {missing}")
    return kernels, why, cache


def test_the_library_is_built_once_into_the_cache_and_loaded_from_there(buildable):
    kernels, why, cache = buildable
    assert kernels is not None, why
    assert kernels.path.parent == cache / "paratrain" / "native" and str(kernels.path) in why
    built = kernels.path.stat().st_mtime_ns
    again, _ = native.load(str(cache))
    assert again.path == kernels.path and again.path.stat().st_mtime_ns == built
    assert native.build(str(cache)) == kernels.path and kernels.path.stat().st_mtime_ns == built  # another process
    assert [p.name for p in kernels.path.parent.iterdir()] == [kernels.path.name]  # no partial files left


def test_a_compiler_that_fails_leaves_torchs_path_and_says_why(tmp_path):
    kernels, why = native.load(str(tmp_path), "false")
    assert kernels is None and why == "native kernels not built: false failed (exit code 1)", why
    assert list((tmp_path / "paratrain" / "native").iterdir()) == []


@functools.lru_cache(maxsize=None)  # the native and the torch path take the same inputs: made once (read-only)
def _inputs(rank: int, dtype: torch.dtype, count: int, call: int) -> torch.Tensor:
    """Values whose float sums round differently in different orders, so a kernel that folded
    in another order than the torch path would show. Drawn in the dtype's own precision
    (float32's draw costs a fifth of float64's)."""
    generator = torch.Generator().manual_seed(1000 * call + rank)
    if dtype.is_floating_point:
        return torch.randn(count, generator=generator, dtype=dtype) * 10 ** (rank % 3)
    return torch.randint(-1000, 1000, (count,), generator=generator, dtype=dtype)


def _after_rank_1_waits(arena, late: float) -> None:
    """Return `late` seconds after rank 1 has taken the step this rank takes next (it waits for
    us), and where it sleeps once it has waited long enough (no spinning), once it sleeps: a late
    arrival whatever the load on the machine (rank 1 might be later still)."""
    deadline = time.monotonic() + 10
    while arena.seen(1)[0] <= arena.step and time.monotonic() < deadline:
        time.sleep(0.0001)
    time.sleep(late)
    while arena.spin_s == 0 and not arena.seen(1)[1] and time.monotonic() < deadline:
        time.sleep(0.0001)


def _calls(group: Group, late: float, dtypes: tuple) -> dict:
    """CALLS all-reduces and reduce-scatters of each dtype on the same tensors (so they are replayed),
    and an all-reduce of 2.5 slots (three pieces, never replayed), with rank 0 arriving `late`
    seconds after rank 1 at every call (_after_rank_1_waits)."""
    results = {}
    big_count = slot_bytes_for(group.size) * 5 // 16  # 2.5 slots of 8-byte elements, 5 of 4-byte ones
    for dtype in dtypes:
        count = 1000 * group.size + 3
        buf, rs_in = torch.empty(count, dtype=dtype), torch.empty(count, dtype=dtype)
        big = torch.empty(big_count, dtype=dtype)
        rs_out = torch.empty(len(torch.tensor_split(rs_in, group.size)[group.rank]), dtype=dtype)
        for call in range(CALLS):
            buf.copy_(_inputs(group.rank, dtype, count, call))
            rs_in.copy_(_inputs(group.rank, dtype, count, call + 100))
            big.copy_(_inputs(group.rank, dtype, big_count, call + 200))
            if late and group.rank == 0:
                _after_rank_1_waits(group.transport.arena, late)
            group.all_reduce(buf)
            group.reduce_scatter(rs_out, rs_in)
            group.all_reduce(big, algo="oneshot")  # auto takes twoshot for it beyond 2 ranks
            results[(dtype, call)] = (buf.clone(), rs_out.clone(), big.clone())
        results[(dtype, "native")] = group.replays.kinds().count("kernel") == 2  # the big one has no replay
    return results


class _Counting:
    """The kernels, counting what each oneshot call returned."""

    def __init__(self, kernels: native.Kernels):
        self.kernels, self.returned = kernels, []
        self.finish = kernels.finish

    def oneshot(self, plan, step, poll_ns):
        status = self.kernels.oneshot(plan, step, poll_ns)
        self.returned.append(status)
        return status


def _native_against_torch(group: Group, late: float = 0.0, expected: tuple = (), dtypes: tuple = DTYPES) -> list[str]:
    """Native and torch's results compared, for each of `dtypes`; `expected`: (rank, status)
    pairs that some oneshot call of that rank must have returned."""
    arena = group.transport.arena
    if arena is None or arena.native is None:
        return [f"rank {group.rank}: no native kernels in the segment"]
    kernels, failures = arena.native, []
    arena.native = counting = _Counting(kernels)
    through_native = Group(group.transport, timeout=group.timeout)
    natively = _calls(through_native, late, dtypes)
    # Every call through the kernels: each round's pieces of the big all-reduce (ceil of 2.5 or 1.25
    # slots), the small all-reduce's every call (those not replayed go through the piece loop), and
    # the reduce-scatter's replayed ones.
    pieces = sum(-(-slot_bytes_for(group.size) * 5 // 16 * torch.empty(0, dtype=d).element_size()
                   // slot_bytes_for(group.size)) for d in dtypes)
    expected_calls = CALLS * pieces + len(dtypes) * (CALLS + CALLS - 2)
    if len(counting.returned) != expected_calls:
        failures.append(f"rank {group.rank}: {len(counting.returned)} native calls, expected {expected_calls}")
    for rank, status in expected:
        if rank == group.rank and status not in counting.returned:
            failures.append(f"rank {rank}: no oneshot call returned {status}: {sorted(set(counting.returned))}")
    arena.native = None  # a new group works its replays out anew, through torch's ops
    through_torch = Group(group.transport, timeout=group.timeout)
    plain = _calls(through_torch, late, dtypes)
    arena.native = kernels
    for key, result in natively.items():
        if key[1] == "native":
            if not result or plain[key]:
                failures.append(f"rank {group.rank}: {key[0]}: the replays ran native {result}, then {plain[key]}")
        else:
            for name, mine, theirs in zip(("all-reduce", "reduce-scatter", "pieces"), result, plain[key]):
                if not torch.equal(mine, theirs):
                    failures.append(f"rank {group.rank}: {key}: the {name}'s native and torch's results differ")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_native_calls_give_the_bits_of_torchs_ops(buildable, world_size):
    assert_no_failures(paratrain.run(_native_against_torch, world_size, launcher="processes", timeout=RUN_TIMEOUT_S))


def test_a_late_peer_is_waited_for_and_a_sleeping_one_is_rung(buildable, monkeypatch):
    # Rank 0 comes 5 ms late: past rank 1's poll in the kernel, so its wait goes on in Python
    # (WAIT); with no spinning there, rank 1 sleeps on its doorbell, and rank 0's kernel finds its
    # flag up and returns to ring it (WAIT_AND_RING). One dtype: after a wait the kernel's
    # `finish` folds through the same per-dtype loop as an undelayed call (sum_rows), whose every
    # dtype the test above runs; the lateness is at every call, so each status has many chances.
    late = dict(launcher="processes", timeout=RUN_TIMEOUT_S)
    float32 = (torch.float32,)
    assert_no_failures(paratrain.run(_native_against_torch, 2, args=(0.005, ((1, native.WAIT),), float32), **late))
    monkeypatch.setenv("PARATRAIN_SHM_SPIN_US", "0")
    assert_no_failures(paratrain.run(_native_against_torch, 2, args=(0.005, ((0, native.WAIT_AND_RING),), float32),
                                     **late))


def test_a_plan_copies_before_and_after_its_step_reads_a_published_address_and_checks_first(buildable):
    # A segment of our own (its steps wait for nobody) and a read of our own memory: what the
    # all-to-alls' plans do (algorithms/shared_all_to_all.py), each part alone.
    kernels, _, _ = buildable
    arena = Arena.alone(2, 0)
    arena.native = kernels
    source, into = torch.arange(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    published = torch.tensor([source.data_ptr()])  # as a peer publishes its input's address
    seen, expected = torch.tensor([5]), torch.tensor([5])
    at, read_from = into.data_ptr(), source.data_ptr()
    plan = arena.native_plan()
    plan.set_copies([(at, read_from, 16)], [(at + 16, read_from + 16, 16)])
    plan.set_reads([(at + 32, published.data_ptr(), 32, 32, os.getpid())])  # elements 4..7, at offset 32
    plan.set_checks([(seen.data_ptr(), expected.data_ptr(), 8)])
    assert arena.run_native(ctypes.addressof(plan), 1.0) == native.DONE and into.tolist() == list(range(8))
    into.zero_()
    seen[0] = 6  # a peer wrote other sizes than the plan was made for: nothing after the step
    assert arena.run_native(ctypes.addressof(plan), 1.0) == native.CHANGED and into.tolist() == [0, 1] + [0] * 6
    seen[0], published[0] = 5, 8  # an address no process maps
    with pytest.raises(OSError, match="reading a peer's memory .process_vm_readv.: Bad address"):
        arena.run_native(ctypes.addressof(plan), 1.0)


def _has_native(group: Group) -> bool:
    return group.transport.arena.native is not None


def test_paratrain_native_0_keeps_every_group_on_torchs_ops(monkeypatch):
    monkeypatch.setenv("PARATRAIN_NATIVE", "0")
    assert paratrain.run(_has_native, 2, launcher="processes", timeout=RUN_TIMEOUT_S) == {0: False, 1: False}


def test_without_a_compiler_load_says_so_and_every_group_runs_on_torchs_ops(tmp_path, monkeypatch):
    monkeypatch.setattr(native.shutil, "which", lambda name: None)  # no cc, gcc or clang on the PATH
    kernels, why = native.load.__wrapped__(str(tmp_path))
    assert kernels is None and why == "native kernels not built: no C compiler (cc, gcc or clang; or set CC)"
    # In the ranks (processes of their own): a compiler that is not there, and an empty cache
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert paratrain.run(_has_native, 2, launcher="processes", timeout=RUN_TIMEOUT_S) == {0: False, 1: False}
