"""Messages between processes of one host through shared memory (comm/transport/shm.py):
the ring keeps every byte whatever the sizes and wrap-arounds, ranks on processes use it
(with gloo's semantics: match by tag, in order, any size), a message larger than the ring
passes in pieces both ways at once, our collectives' messages (reducing receives included)
go the same way, also from the communication thread while the main thread sends, a sleeping
receiver is woken, a silent peer times out, a peer that exits is named, nothing is left in
/dev/shm, PARATRAIN_SHM=0 leaves it to gloo, and a wait polls only where the host has a core
for each rank.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paratrain
from paratrain.comm import CommTimeoutError, Group, SharedMemoryTransport, TorchTransport
from paratrain.comm.transport import over_process_group, shm_setup
from paratrain.comm.transport.shm_ring import LINE, Fragment, Ring, round_up
from paratrain.environment import Settings, SettingsError

from test_failures import rank_1_leaves, run_two_gloo_ranks
from test_p2p import RUN_TIMEOUT_S, _assert_no_failures, every_p2p_check, sendrecv_around_the_ring

# ---- the ring alone: one process, both ends mapped -------------------------------------------


@settings(max_examples=40, deadline=None)
@given(capacity_lines=st.integers(2, 12), sizes=st.lists(st.integers(0, 700), min_size=1, max_size=25))
def test_the_ring_returns_every_fragment_as_written_across_wrap_arounds(tmp_path_factory, capacity_lines, sizes):
    path = str(tmp_path_factory.mktemp("ring") / "ring")
    capacity = capacity_lines * LINE
    sender, receiver = Ring(path, capacity, create=True), Ring(path, capacity, create=False)
    head = tail = 0
    pending = []  # fragments written, not yet read: (fragment, payload)
    generator = torch.Generator().manual_seed(len(sizes))
    for tag, size in enumerate(sizes):
        length = min(size, capacity - LINE)  # what one fragment can carry in an empty ring
        payload = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)
        while capacity - (head - receiver.tail) < LINE + round_up(length):  # full: the reader makes room
            fragment, expected = pending.pop(0)
            assert receiver.head == head and receiver.fragment_at(tail) == fragment
            landed = torch.empty(fragment.length, dtype=torch.uint8)
            tail = receiver.read(tail, fragment, landed.data_ptr())
            assert torch.equal(landed, expected)
        fragment = Fragment(tag, 10_000 + tag, 0, length)
        head = sender.write(head, fragment, payload.data_ptr())
        pending.append((fragment, payload))
    for fragment, expected in pending:
        assert receiver.fragment_at(tail) == fragment
        landed = torch.empty(fragment.length, dtype=torch.uint8)
        tail = receiver.read(tail, fragment, landed.data_ptr())
        assert torch.equal(landed, expected)
    assert sender.tail == tail == head


def test_a_ring_refuses_a_capacity_that_is_not_whole_lines(tmp_path):
    with pytest.raises(ValueError, match="multiple of 64"):
        Ring(str(tmp_path / "ring"), 100, create=True)


# ---- ranks on processes ----------------------------------------------------------------------


def _shared_memory_checks(group) -> list[str]:
    """Every p2p check of test_p2p through a 4 KiB ring (so nearly every message is cut in
    pieces), then 1 MiB both ways at once, and a receive of the wrong size."""
    failures = []
    transport = group.transport
    if not isinstance(transport, SharedMemoryTransport) or transport.p2p.neighbours != (1 - group.rank,):
        return [f"p2p goes through {group.describe()}, not shared memory to the other rank"]
    failures += every_p2p_check(group)
    peer = 1 - group.rank
    mine = torch.arange(1 << 18, dtype=torch.float32) * (group.rank + 1)
    theirs = torch.empty_like(mine)
    sending, receiving = group.isend(mine, peer, tag=5), group.irecv(theirs, peer, tag=5)
    sending.wait()
    receiving.wait()
    if not torch.equal(theirs, torch.arange(1 << 18, dtype=torch.float32) * (peer + 1)):
        failures.append("1 MiB sent both ways at once through a 4 KiB ring arrived changed")
    if group.rank == 0:
        group.send(torch.ones(5), 1, tag=6)
    else:
        try:
            group.recv(torch.empty(4), 0, tag=6)
            failures.append("a 4-element receive took a 5-element message")
        except ValueError as error:
            if "the message has 20 bytes, the receive's buffer 16" not in str(error):
                failures.append(f"size mismatch said: {error}")
    return failures


def _paratrain_files() -> set[str]:
    """Our runs' rings and doorbells: those of ranks this process launched (other runs on the
    host, a test beside this one, make and remove their own)."""
    parent = f"-{os.getpid()}-"
    return {name for name in os.listdir("/dev/shm") if name.startswith("paratrain-") and parent in name}


def test_processes_of_one_host_pass_every_message_through_shared_memory(monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM_BYTES", "4096")
    before = _paratrain_files()
    _assert_no_failures(paratrain.run(_shared_memory_checks, 2, launcher="processes", timeout=RUN_TIMEOUT_S))
    assert _paratrain_files() == before  # the rings' and doorbells' names went once both ends had them


def _everyone_sends_to_everyone_at_once(group) -> list[str]:
    """Each rank posts 256 KiB to every other before receiving any, through 4 KiB rings: no
    ring can hold a message, so each rank must read its peers' rings while its own sends wait
    for room (or all would wait forever); then the ring shift of test_p2p."""
    failures = []
    if len(group.transport.p2p.neighbours) != group.size - 1:
        return [f"shared memory reaches {group.transport.p2p.neighbours}, not every other rank"]
    peers = [r for r in range(group.size) if r != group.rank]
    sends = [group.isend(torch.full((1 << 16,), float(10 * group.rank + peer)), peer, tag=3) for peer in peers]
    received = {peer: torch.empty(1 << 16) for peer in peers}
    receives = [group.irecv(received[peer], peer, tag=3) for peer in peers]
    for handle in sends + receives:
        handle.wait()
    for peer, tensor in received.items():
        if not torch.equal(tensor, torch.full((1 << 16,), float(10 * peer + group.rank))):
            failures.append(f"the 256 KiB from rank {peer} arrived changed")
    return failures + sendrecv_around_the_ring(group)




def _collectives_through_small_rings(group) -> list[str]:
    """Every all-reduce algorithm (its receives reduce into staging buffers) and all-gather
    through 4 KiB rings, then an async all-reduce on the communication thread (which never
    polls: it sleeps on the doorbell) while the main thread exchanges point-to-point."""
    failures = []
    if group.kind != "shm" or not isinstance(group.transport, SharedMemoryTransport):
        return [f"the group's messages do not go through shared memory (transport {group.describe()})"]
    n, r = group.size, group.rank
    for algo in ("ring", "hd", "tree", "direct"):
        for op, want in (("sum", sum(range(1, n + 1))), ("max", n)):
            tensor = torch.full((20_000,), float(r + 1))  # 80 KB: twenty times a ring
            group.all_reduce(tensor, op=op, algo=algo)
            if not torch.equal(tensor, torch.full_like(tensor, float(want))):
                failures.append(f"all_reduce {algo} {op}: wrong values")
    gathered = torch.empty(n * 3000)
    group.all_gather(gathered, torch.full((3000,), float(r)), algo="ring")
    if not torch.equal(gathered, torch.arange(n).repeat_interleave(3000).float()):
        failures.append("all_gather ring: wrong values")
    bucket = torch.full((50_000,), float(r))
    handle = group.all_reduce(bucket, algo="ring", async_op=True)
    failures += sendrecv_around_the_ring(group)
    handle.wait()
    if not torch.equal(bucket, torch.full_like(bucket, float(sum(range(n))))):
        failures.append("an async all_reduce beside point-to-point: wrong values")
    group.barrier()
    held = [(peer, list(channel.posted), list(channel.arrived))
            for peer, channel in group.transport.p2p._incoming.items() if channel.posted or channel.arrived]
    if held:  # each call's tag is its own: none may stay behind once its messages are in
        failures.append(f"rank {r}: tags still held after every call completed: {held}")
    return failures


def _three_ranks_through_small_rings(group) -> list[str]:
    """Both checks of three ranks through 4 KiB rings, in one launch (a launch costs more than
    either): every rank to every other at once, then the collectives."""
    return _everyone_sends_to_everyone_at_once(group) + _collectives_through_small_rings(group)


def test_three_processes_pass_p2p_and_collectives_through_rings_smaller_than_a_message(monkeypatch):
    """Each rank sends every other more than a ring holds, all at once; then every all-reduce
    algorithm and an all-gather, and an all-reduce from the communication thread."""
    monkeypatch.setenv("PARATRAIN_SHM_BYTES", "4096")
    _assert_no_failures(paratrain.run(_three_ranks_through_small_rings, 3, launcher="processes",
                                      timeout=RUN_TIMEOUT_S))


def _some_ranks_without_shared_memory(group) -> list[str]:
    """Rank 2's settings turn shared memory off for a new group: ranks 0 and 1 reach each other
    through it and rank 2 through gloo, within one collective. The group's kind (the algorithm
    table's key) is then gloo's on every rank (not every message goes through shared memory)."""
    import torch.distributed as dist

    settings = group.settings.with_flags(shm=group.rank != 2)
    made = TorchTransport(dist.new_group([0, 1, 2]), group.transport.flight)
    mixed = Group(over_process_group(made, settings), timeout=group.timeout)
    failures = []
    reached = mixed.transport.p2p.neighbours if isinstance(mixed.transport, SharedMemoryTransport) else ()
    expected = {0: (1,), 1: (0,), 2: ()}[group.rank]
    if reached != expected or mixed.kind != "gloo":
        failures.append(f"rank {group.rank}: shared memory to {reached}, kind {mixed.kind}")
    for algo in ("ring", "hd", "direct"):
        tensor = torch.full((30_000,), float(group.rank + 1))
        mixed.all_reduce(tensor, algo=algo)
        if not torch.equal(tensor, torch.full_like(tensor, 6.0)):
            failures.append(f"rank {group.rank}: all_reduce {algo} over both routes: wrong values")
    return failures + sendrecv_around_the_ring(mixed)


def test_a_group_whose_ranks_differ_in_shared_memory_mixes_both_routes():
    _assert_no_failures(paratrain.run(_some_ranks_without_shared_memory, 3, launcher="processes",
                                      timeout=RUN_TIMEOUT_S))


def _sleeps_then_times_out(group) -> list[str]:
    """Rank 1 waits longer than it polls (PARATRAIN_SHM_SPIN_US=0: it sleeps at once) for a
    message rank 0 sends late; then waits on a group with a short timeout for one never sent.
    The run has the default settings but for the spinning: its transport is also the check that
    processes of one host get shared memory."""
    failures = []
    if (type(group.transport).__name__, group.kind) != ("SharedMemoryTransport", "shm"):
        failures.append(f"rank {group.rank}: transport {group.describe()}, not shared memory")
    if group.rank == 0:
        time.sleep(0.3)
        group.send(torch.full((3,), 7.0), 1, tag=1)
    else:
        if not torch.equal(group.recv(torch.empty(3), 0, tag=1), torch.full((3,), 7.0)):
            failures.append("a sleeping receiver got the wrong message")
        try:
            Group(group.transport, timeout=0.5).recv(torch.empty(3), src=0, tag=2)
            failures.append("a receive from a silent rank returned")
        except CommTimeoutError as error:
            if not str(error).startswith("rank 1: recv (call #1) timed out after 0.5s waiting for rank 0"):
                failures.append(f"the timeout said: {error}")
    group.barrier()
    return failures


def test_a_sleeping_receiver_is_woken_and_a_silent_peer_times_out(monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM_SPIN_US", "0")
    _assert_no_failures(paratrain.run(_sleeps_then_times_out, 2, launcher="processes", timeout=RUN_TIMEOUT_S))


def _which_transport(group) -> str:
    group.send(torch.ones(2), 1 - group.rank, tag=0) if group.rank == 0 else group.recv(torch.empty(2), 0, tag=0)
    return type(group.transport).__name__, group.kind


def test_paratrain_shm_0_leaves_processes_of_one_host_to_gloo(monkeypatch):
    """(Without it they get shared memory: test_a_sleeping_receiver_is_woken_... checks that.)"""
    monkeypatch.setenv("PARATRAIN_SHM", "0")
    assert paratrain.run(_which_transport, 2, launcher="processes", timeout=RUN_TIMEOUT_S) == {
        0: ("TorchTransport", "gloo"), 1: ("TorchTransport", "gloo")}


def _barrier(group) -> None:
    group.barrier()


def _receive_from_rank_1(group) -> None:
    group.recv(torch.empty(4), src=1, tag=0)


@pytest.mark.timeout(60)  # the group's timeout is 60 s: finishing first means the exit was noticed
def test_a_peer_process_that_exits_is_named_by_the_rank_waiting_for_it(tmp_path):
    exit_codes, result_file = run_two_gloo_ranks(
        functools.partial(rank_1_leaves, together=_barrier, waiting=_receive_from_rank_1), tmp_path)
    assert exit_codes == [0, 3]
    seen = json.loads(result_file.read_text())
    assert seen["shm"] and seen["peer"] == 1
    assert seen["text"].startswith("rank 0: recv (call #1) lost rank 1: rank 1's process (pid ")
    assert "has exited" in seen["text"]


# ---- settings ----------------------------------------------------------------------------------


def test_a_wait_polls_only_where_each_rank_of_the_host_has_a_core():
    cores = len(os.sched_getaffinity(0))

    def spin_s(ranks_here: int, **environment: str) -> float:
        return shm_setup.spin_s(Settings.resolve(environment), ranks_here)

    assert spin_s(cores) == shm_setup.DEFAULT_SPIN_S
    assert spin_s(cores + 1) == 0.0
    assert spin_s(1, LOCAL_WORLD_SIZE=str(cores + 1)) == 0.0  # torchrun's count of this host's ranks
    assert spin_s(cores + 1, PARATRAIN_SHM_SPIN_US="250") == 250e-6
    with pytest.raises(SettingsError, match="PARATRAIN_SHM_SPIN_US must be a whole number, got 'soon'"):
        Settings.resolve({"PARATRAIN_SHM_SPIN_US": "soon"})
    with pytest.raises(SettingsError, match="PARATRAIN_SHM_BYTES must be at least 256, got '100'"):
        Settings.resolve({"PARATRAIN_SHM_BYTES": "100"})
    assert not shm_setup.enabled(Settings.resolve({"PARATRAIN_SHM": "0"}))


def test_a_process_rings_stay_within_a_budget_on_a_crowded_host():
    assert shm_setup.ring_bytes(Settings(), 7) == 4 << 20  # 8 ranks a host: 28 MiB of rings each
    assert shm_setup.ring_bytes(Settings(), 63) == round_up((64 << 20) // 63)  # 64 ranks: 1 MiB each
    assert shm_setup.ring_bytes(Settings(), 1023) == 256 << 10  # never less than this unless asked
    assert shm_setup.ring_bytes(Settings(shm_bytes=8192), 63) == 8192
