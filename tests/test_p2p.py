"""Point-to-point: what is sent is what arrives, messages match by (source, tag) in the order
they were sent whatever order they are waited in, and receives land in non-contiguous buffers.
Each check is a module-level function returning its differences, so the same checks run on the
fabric (threads) and, as a smoke test, on gloo (processes).
"""

from __future__ import annotations

import pytest
import torch

import paratrain

RUN_TIMEOUT_S = 30.0

PAYLOADS = {  # name: the tensor rank 0 sends; built here, so both ranks know it
    "float32 3x4": lambda: torch.arange(12, dtype=torch.float32).view(3, 4) / 4,
    "float16": lambda: torch.linspace(-2, 2, 9, dtype=torch.float16),
    "bfloat16": lambda: torch.linspace(-2, 2, 9, dtype=torch.bfloat16),
    "int64": lambda: torch.arange(-5, 6, dtype=torch.int64) * 10**12,
    "uint8 2x2x2": lambda: torch.arange(8, dtype=torch.uint8).view(2, 2, 2),
    "bool": lambda: torch.tensor([True, False, True]),
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0),
}


def _payload(name: str, salt: int = 0) -> torch.Tensor:
    tensor = PAYLOADS[name]()
    return tensor if tensor.dtype == torch.bool or salt == 0 else tensor + salt


def _same(label: str, actual: torch.Tensor, expected: torch.Tensor) -> list[str]:
    if actual.dtype == expected.dtype and actual.shape == expected.shape and torch.equal(actual, expected):
        return []
    return [f"{label}: got {actual.tolist()}, expected {expected.tolist()}"]


def send_and_recv_every_payload(group) -> list[str]:
    """Rank 0 sends each payload, rank 1 sends it back incremented."""
    failures = []
    for name in PAYLOADS:
        expected = _payload(name)
        if group.rank == 0:
            group.send(expected, dst=1)
            echoed = group.recv(torch.empty_like(expected), src=1)
            failures += _same(f"echo of {name}", echoed, _payload(name, salt=1))
        elif group.rank == 1:
            buffer = torch.empty_like(expected)
            returned = group.recv(buffer, src=0)
            if returned is not buffer:
                failures.append(f"recv of {name} did not return its buffer")
            failures += _same(f"recv of {name}", buffer, expected)
            group.send(_payload(name, salt=1), dst=0)
    return failures


# (tag, value) in the order rank 0 sends them; tag 1 is used twice, so order within a tag matters.
TAGGED = [(1, 10.0), (2, 20.0), (1, 11.0), (3, 30.0), (0, 0.0), (2, 21.0)]


def tagged_messages_waited_out_of_order(group) -> list[str]:
    """Rank 1 posts its receives in another order across tags than rank 0 sent (within one tag
    the k-th receive posted takes the k-th message sent), then waits on them in reverse: each
    must still get the message sent with its tag."""
    failures = []
    if group.rank == 0:
        sends = [group.isend(torch.full((4,), value), dst=1, tag=tag) for tag, value in TAGGED]
        for handle in reversed(sends):
            handle.wait()
    elif group.rank == 1:
        post_order = [3, 1, 4, 0, 5, 2]  # indices into TAGGED
        buffers = {i: torch.zeros(4) for i in post_order}
        handles = {i: group.irecv(buffers[i], src=0, tag=TAGGED[i][0]) for i in post_order}
        for i in reversed(post_order):
            handles[i].wait()
            handles[i].wait()  # a second wait is a no-op
        for i, (tag, value) in enumerate(TAGGED):
            failures += _same(f"message #{i} (tag {tag})", buffers[i], torch.full((4,), value))
    return failures


def many_messages_on_one_tag_arrive_in_order(group, count=40) -> list[str]:
    failures = []
    if group.rank == 0:
        sends = [group.isend(torch.tensor([float(k)]), dst=1, tag=5) for k in range(count)]
        for handle in sends:
            handle.wait()
    elif group.rank == 1:
        buffers = [torch.zeros(1) for _ in range(count)]
        handles = [group.irecv(b, src=0, tag=5) for b in buffers]
        for k in sorted(range(count), key=lambda k: (k * 17) % count):  # a fixed shuffle
            handles[k].wait()
        received = [b.item() for b in buffers]
        if received != [float(k) for k in range(count)]:
            failures.append(f"40 messages on tag 5 arrived as {received}")
    return failures


def sendrecv_around_the_ring(group) -> list[str]:
    """n-1 shifts to the right: at shift s rank r holds rank (r-s)'s value."""
    n, r = group.size, group.rank
    failures, current = [], torch.full((3,), float(r))
    for shift in range(1, n):
        incoming = torch.empty(3)
        returned = group.sendrecv(current, (r + 1) % n, incoming, (r - 1) % n, tag=shift)
        if returned is not incoming:
            failures.append("sendrecv did not return its receive buffer")
        failures += _same(f"shift {shift}", incoming, torch.full((3,), float((r - shift) % n)))
        current = incoming
    return failures


def non_contiguous_send_and_receive(group) -> list[str]:
    """A transposed tensor sent, received into a transposed view and into a strided slice;
    the elements a strided view skips stay untouched."""
    failures = []
    matrix = torch.arange(12, dtype=torch.float32).view(3, 4)
    if group.rank == 0:
        group.send(matrix.t(), dst=1)  # 4x3, non-contiguous
        group.send(matrix[:, ::2], dst=1)  # 3x2 strided
    elif group.rank == 1:
        transposed = torch.zeros(3, 4).t()
        group.recv(transposed, src=0)
        failures += _same("into a transposed view", transposed, matrix.t())
        storage = torch.full((3, 4), -1.0)
        handle = group.irecv(storage[:, ::2], src=0)
        handle.wait()
        failures += _same("into a strided slice", storage[:, ::2], matrix[:, ::2])
        failures += _same("elements between the slice's", storage[:, 1::2], torch.full((3, 2), -1.0))
    return failures


def p2p_beside_a_collective(group) -> list[str]:
    """A user message in flight across a collective is neither taken by it nor in its way."""
    failures = []
    if group.rank == 0:
        pending = group.isend(torch.tensor([7.0, 8.0]), dst=1, tag=0)
    total = group.all_reduce(torch.ones(5), algo="ring")
    failures += _same("all_reduce beside a pending send", total, torch.full((5,), float(group.size)))
    if group.rank == 1:
        failures += _same("message sent before the collective",
                          group.recv(torch.zeros(2), src=0, tag=0), torch.tensor([7.0, 8.0]))
    if group.rank == 0:
        pending.wait()
    return failures


def _assert_no_failures(results: dict[int, list[str]]) -> None:
    failures = [f"rank {rank}: {line}" for rank, lines in sorted(results.items()) for line in lines]
    assert not failures, "\n".join(failures)


def test_send_and_recv_deliver_every_dtype_and_shape():
    _assert_no_failures(paratrain.run(send_and_recv_every_payload, 2, timeout=RUN_TIMEOUT_S))


def test_tagged_messages_match_by_tag_even_when_waited_out_of_order():
    _assert_no_failures(paratrain.run(tagged_messages_waited_out_of_order, 2, timeout=RUN_TIMEOUT_S))


def test_messages_on_one_tag_arrive_in_the_order_sent():
    _assert_no_failures(paratrain.run(many_messages_on_one_tag_arrive_in_order, 2, timeout=RUN_TIMEOUT_S))


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_sendrecv_shifts_values_around_a_ring(world_size):
    _assert_no_failures(paratrain.run(sendrecv_around_the_ring, world_size, timeout=RUN_TIMEOUT_S))


def test_non_contiguous_tensors_are_sent_and_received_in_logical_order():
    _assert_no_failures(paratrain.run(non_contiguous_send_and_receive, 2, timeout=RUN_TIMEOUT_S))


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_message_in_flight_is_not_taken_by_a_collective(world_size):
    _assert_no_failures(paratrain.run(p2p_beside_a_collective, world_size, timeout=RUN_TIMEOUT_S))


def every_p2p_check(group) -> list[str]:
    failures = []
    for check in (send_and_recv_every_payload, tagged_messages_waited_out_of_order,
                  many_messages_on_one_tag_arrive_in_order, sendrecv_around_the_ring,
                  non_contiguous_send_and_receive, p2p_beside_a_collective):
        failures += [f"{check.__name__}: {line}" for line in check(group)]
    return failures


def test_p2p_works_the_same_on_gloo_processes():
    _assert_no_failures(paratrain.run(every_p2p_check, 2, launcher="processes", timeout=RUN_TIMEOUT_S))
