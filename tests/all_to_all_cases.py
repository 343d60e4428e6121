"""What the all-to-all tests build their cases from (tests/test_all_to_all_uneven.py): every
rank's input for a case of split sizes and what each rank should receive, and the cases a world
of processes on one host runs through the shared segment (calls made again, parts larger than a
slot, a rank that may not read its peers' memory, mismatched sizes)."""

from __future__ import annotations

import torch

from paratrain.comm import Group
from paratrain.comm.ops import part_bounds, part_sizes
from paratrain.comm.transport import cross_memory
from paratrain.comm.transport.shm_arena import slot_bytes_for

DTYPES = (torch.float32, torch.int64, torch.bfloat16)
ROW_SHAPES = ((), (3,), (2, 5))  # a row: one element, a vector, a matrix
SENTINEL = -77  # what an output holds before a call: a part never written shows
EVERY_ALGORITHM = ("direct", "native", "auto", "oneshot")  # that takes split sizes on one host


def rank_input(case, rank: int) -> torch.Tensor:
    dtype_index, shape_index, seed, matrix = case
    rows = sum(matrix[rank])
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    values = torch.randint(-100, 100, (rows, *ROW_SHAPES[shape_index]), generator=generator)
    return values.to(DTYPES[dtype_index])  # small integers: exact in every dtype


def expected_output(case, rank: int) -> torch.Tensor:
    """Rank `rank`'s output, from every rank's input (each a function of the case)."""
    matrix = case[3]
    parts = []
    for source in range(len(matrix)):
        start = sum(matrix[source][:rank])
        parts.append(rank_input(case, source)[start : start + matrix[source][rank]])
    return torch.cat(parts)


# ---- through the shared segment ----------------------------------------------------------------


def uneven_parts_made_again(world) -> dict:
    """Uneven parts, made again on the same tensors with the same sizes (new values each call):
    from the third call they run straight (checks skipped, replays.RepeatedCalls); then ranks 2
    and 3 change what they send each other while 0 and 1 keep their sizes and tensors, so 0 and
    1 go straight on while 2 and 3 take the whole path; then rank 2 alone changes its part for
    itself, which moves its part for rank 3 in its input: 3 goes straight on with the same sizes
    and tensors, and must not copy from where that part lay before (the native plan checks its
    peers' sizes, shared_all_to_all.py). Every result is right. (On a group of its own: one that
    has made an async call never runs straight.)"""
    group = Group(world.transport, timeout=world.timeout)
    first = [[1, 2, 0, 3], [4, 0, 1, 1], [2, 2, 2, 2], [0, 5, 1, 1]]
    second = [row[:] for row in first]
    second[2][3], second[3][2] = 6, 0  # only between ranks 2 and 3
    third = [row[:] for row in second]
    third[2][2] = 5  # only rank 2's part for itself
    wrong, straight, tensors = 0, [], {}
    for matrix in (first, second, third):
        send, receive = matrix[group.rank], [row[group.rank] for row in matrix]
        inp, out = tensors.setdefault((tuple(send), tuple(receive)),
                                      (torch.empty(sum(send), 3), torch.empty(sum(receive), 3)))
        before = group.straight_calls
        for call in range(4):
            case = (0, 0, 11 + call, matrix)
            inp.copy_(rank_input(case, group.rank).view(-1, 1).expand(-1, 3))
            out.fill_(SENTINEL)
            group.all_to_all(out, inp, algo="oneshot", output_split_sizes=receive, input_split_sizes=send)
            wrong += int(not torch.equal(out, expected_output(case, group.rank).view(-1, 1).expand(-1, 3)))
        straight.append(group.straight_calls - before)
    return {"wrong": wrong, "straight": straight}


def where_one_rank_may_not_read(group) -> dict:
    """Rank 1 is refused the reads of its peers' memory (transport/cross_memory.py): its pair
    (0, 1) passes every part through the slots, both ranks alike, with the same results; the
    other pair (2, 3) reads where this machine allows it."""
    if group.rank == 1:
        cross_memory._process_vm_readv = lambda: None  # as where the kernel has no process_vm_readv
    pair = group.split([[0, 1], [2, 3]])
    wrong = {**equal_parts_made_again(pair), **larger_than_a_slot(pair, EVERY_ALGORITHM)}
    return {"wrong": sum(wrong.values()), "reads": bool(pair.transport.arena.cross_memory)}


def equal_parts_made_again(group) -> dict[int, int]:
    """Equal parts through the shared segment, each size called four times on the same tensors
    with new values (from the third on, the call runs its worked-out copies, shared_replays.py):
    sizes that do not divide by the ranks, and one over a slot (in pieces). Wrong calls per size."""
    n, me = group.size, group.rank
    wrong = {}
    for count in (1, n + 1, 1000, slot_bytes_for(n) // 4 * n + 5):
        sizes = part_sizes(count, n)
        starts = [low for low, _ in part_bounds(count, n)]
        inp, out = torch.empty(count), torch.empty(n * sizes[me])
        wrong[count] = 0
        for call in range(4):
            made = [torch.arange(count, dtype=torch.float32) + 1000 * rank + 100000 * call for rank in range(n)]
            inp.copy_(made[me])
            out.fill_(SENTINEL)
            group.all_to_all(out, inp, algo="oneshot")
            expected = torch.cat([made[peer][starts[me]:starts[me] + sizes[me]] for peer in range(n)])
            wrong[count] += int(not torch.equal(out, expected))
    return wrong


def larger_than_a_slot(group, algos) -> dict[str, int]:
    """Rank 0 sends rank 1 two and a half slots (the shared segment passes it in pieces), the
    rest a row each way."""
    n, row = group.size, slot_bytes_for(group.size) // 4 // 2  # half a slot of float32 per row
    matrix = [[5 if (i, j) == (0, 1) else 1 for j in range(n)] for i in range(n)]
    case = (0, 0, 7, matrix)
    inp = rank_input(case, group.rank).view(-1, 1).expand(-1, row).contiguous()
    expected = expected_output(case, group.rank).view(-1, 1).expand(-1, row)
    receive = [r[group.rank] for r in matrix]
    wrong = {}
    for algo in algos:
        out = torch.full_like(expected, SENTINEL)
        group.all_to_all(out, inp, algo=algo, output_split_sizes=receive, input_split_sizes=matrix[group.rank])
        wrong[algo] = int(not torch.equal(out, expected))
    return wrong


def mismatched_splits(group) -> str:
    """Rank 0 sends rank 1 two rows where rank 1 expects one: through the shared segment every
    rank reads every rank's sizes first, so all raise the same error; then the segment works on."""
    n = group.size
    send = [2 if (group.rank, j) == (0, 1) else 1 for j in range(n)]
    receive = [1] * n
    try:
        group.all_to_all(torch.zeros(n), torch.zeros(sum(send)), algo="oneshot",
                         output_split_sizes=receive, input_split_sizes=send)
        message = "no error"
    except ValueError as error:
        message = str(error)
    after = torch.zeros(n)
    group.all_to_all(after, torch.full((n,), float(group.rank)), algo="oneshot",
                     output_split_sizes=[1] * n, input_split_sizes=[1] * n)
    assert after.tolist() == [float(r) for r in range(n)], after
    return message
