"""Sends and blocking receives that go straight through a shared-memory ring
(SharedMemoryP2P.send_now / recv_now, comm/transport/shm.py; in C where the native module is
built): either end of a ring, C or Python, reads what the other writes; on 2 processes the
short cut is taken where it may be, and every order is kept where it may not.
"""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paratrain
from paratrain.comm.transport.shm_ring import LINE, Fragment, Ring, round_up
from paratrain.environment import Settings

from test_p2p import RUN_TIMEOUT_S, _assert_no_failures


@settings(max_examples=30, deadline=None)
@given(capacity_lines=st.integers(3, 12), sizes=st.lists(st.integers(0, 300), min_size=1, max_size=30),
       native_puts=st.lists(st.booleans(), min_size=30, max_size=30))
def test_native_and_python_ends_of_a_ring_read_each_others_messages(tmp_path_factory, capacity_lines, sizes,
                                                                    native_puts):
    """Either end may be C or Python (a process without a compiler talks to one with): each
    writes the layout the other reads, through wrap-arounds; a take of the wrong tag or size, or
    of an empty ring, reads nothing."""
    from paratrain.comm import native

    kernels, why = native.load(Settings().cache_dir)
    assert kernels is not None, why
    path = str(tmp_path_factory.mktemp("ring") / "ring")
    capacity = capacity_lines * LINE
    sender, receiver = Ring(path, capacity, create=True), Ring(path, capacity, create=False)
    head = tail = 0
    generator = torch.Generator().manual_seed(len(sizes))
    for tag, (size, native_put) in enumerate(zip(sizes, native_puts)):
        size = min(size, capacity - LINE)
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        assert kernels.ring_take(receiver.address, capacity, tail, tag, payload.data_ptr(), size) == -1  # empty
        if native_put:
            word = kernels.ring_put(sender.address, capacity, head, tag, payload.data_ptr(), size)
            head, sleeping = word >> 1, word & 1
            assert sleeping == 0 and sender.head == head
        else:
            head = sender.write(head, Fragment(tag, size, 0, size), payload.data_ptr())
        landed = torch.full((size,), 7, dtype=torch.uint8)
        assert kernels.ring_take(receiver.address, capacity, tail, tag + 1, landed.data_ptr(), size) == -2
        assert kernels.ring_take(receiver.address, capacity, tail, tag, landed.data_ptr(), size + 1) == -2
        if native_put:  # the other end reads it: Python after C, C after Python
            assert receiver.fragment_at(tail) == (tag, size, 0, size)
            tail = receiver.read(tail, receiver.fragment_at(tail), landed.data_ptr())
        else:
            word = kernels.ring_take(receiver.address, capacity, tail, tag, landed.data_ptr(), size)
            tail, waiting = word >> 1, word & 1
            assert waiting == 0
        assert tail == head and receiver.tail == tail and torch.equal(landed, payload)


def _straight_and_general_calls_interleaved(group) -> list[str]:
    """First, 20 blocking sends of small messages into an empty ring, and (once the receiver
    sees all of them in the ring, without reading) 20 blocking receives: each must go straight.
    Then blocking calls mixed with isend/irecv, three tags, sizes from nothing to more than the
    ring holds: in order, then received tag by tag in reverse (so most wait in arrival buffers
    and must come out in order). Every byte checked."""
    straight = _counting_straight_moves(group.transport.p2p)
    return _blocking_calls_into_an_empty_ring_go_straight(group, straight) + _mixed_calls_arrive_in_order(group)


def _payload(i: int, size: int) -> torch.Tensor:
    return (torch.arange(size, dtype=torch.int64) * 31 + i).to(torch.uint8)


def _counting_straight_moves(rings) -> dict[str, int]:
    """Wrap the rings' send_now and recv_now to count the messages each moved straight."""
    straight = {"send": 0, "recv": 0}

    def counting(kind: str, taken):
        def counted(*args):
            moved = taken(*args)
            straight[kind] += moved
            return moved
        return counted

    rings.send_now, rings.recv_now = counting("send", rings.send_now), counting("recv", rings.recv_now)
    return straight


def _blocking_calls_into_an_empty_ring_go_straight(group, straight: dict[str, int]) -> list[str]:
    failures, peer, rings = [], 1 - group.rank, group.transport.p2p
    first = [(i % 3, 8 * i) for i in range(20)]
    group.sendrecv(torch.ones(1), peer, torch.empty(1), peer)  # each ring's pages mapped in (the general path)
    # gloo's barrier, not ours: a wait of ours reads every ring it can into arrival buffers, and
    # rank 1 must not be in one when rank 0's messages come.
    group.transport.native_barrier(RUN_TIMEOUT_S)
    before = dict(straight)
    if group.rank == 0:
        for i, (tag, size) in enumerate(first):
            group.send(_payload(i, size), peer, tag)
    else:
        ring, tail = rings._incoming[peer].ring, rings._incoming[peer].tail
        expected = tail + sum(LINE + round_up(size) for _, size in first)
        deadline = time.monotonic() + 60
        while ring.head != expected and time.monotonic() < deadline:
            time.sleep(0.001)  # looks at the head only: nothing is read into arrival buffers
        for i, (tag, size) in enumerate(first):
            landed = torch.empty(size, dtype=torch.uint8)
            group.recv(landed, peer, tag)
            if not torch.equal(landed, _payload(i, size)):
                failures.append(f"straight message {i} arrived changed")
    kind = "send" if group.rank == 0 else "recv"
    if straight[kind] - before[kind] != len(first):
        failures.append(f"{straight[kind] - before[kind]} of {len(first)} blocking {kind}s went straight")
    group.barrier()
    return failures


def _mixed_calls_arrive_in_order(group) -> list[str]:
    failures, peer = [], 1 - group.rank
    sizes = [0, 1, 7, 64, 1000, 3000, 20_000]  # bytes; the ring holds 16 KiB
    messages = [(i % 3, sizes[i % len(sizes)]) for i in range(60)]
    for phase in ("in order", "tag by tag"):
        if group.rank == 0:
            handles = []
            for i, (tag, size) in enumerate(messages):
                if i % 4 == 3:
                    handles.append(group.isend(_payload(i, size), peer, tag))
                else:
                    group.send(_payload(i, size), peer, tag)
            for handle in handles:
                handle.wait()
        else:
            order = list(enumerate(messages))
            if phase == "tag by tag":
                order.sort(key=lambda item: -item[1][0])  # stable: each tag's messages stay in order
            for i, (tag, size) in order:
                landed = torch.empty(size, dtype=torch.uint8)
                if i % 5 == 4:
                    group.irecv(landed, peer, tag).wait()
                else:
                    group.recv(landed, peer, tag)
                if not torch.equal(landed, _payload(i, size)):
                    failures.append(f"{phase}: message {i} (tag {tag}, {size} bytes) arrived changed")
        group.barrier()
    return failures


@pytest.mark.parametrize("native_code", ["1", "0"])
def test_blocking_calls_go_straight_through_the_ring_and_keep_every_order(monkeypatch, native_code):
    monkeypatch.setenv("PARATRAIN_SHM_BYTES", "16384")
    monkeypatch.setenv("PARATRAIN_NATIVE", native_code)  # the short cut in C, or in Python
    _assert_no_failures(paratrain.run(_straight_and_general_calls_interleaved, 2, launcher="processes",
                                      timeout=RUN_TIMEOUT_S))
