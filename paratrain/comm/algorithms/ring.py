"""Ring algorithms: every rank talks only to its two neighbours.

All-reduce = reduce-scatter + all-gather, each n-1 steps that move 1/n of the buffer: a rank
sends 2(n-1)/n of the buffer in total, the least any all-reduce can, which is why NCCL and
gloo use rings for large messages. Each step is cut into segments (Link.run_steps) so that
reducing one segment overlaps the transfer of the next, and its receives are posted while the
step before is still in flight. Latency grows with n, so small messages prefer the tree or
halving-doubling.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link, Step
from paratrain.comm.ops import split_parts


def reduce_scatter_steps(link: Link, parts: tuple[torch.Tensor, ...], op: str) -> list[Step]:
    """Afterwards parts[rank] holds the reduction over all ranks (others: partial sums).

    At step s rank r passes part r-s-1 to its right and folds part r-s-2 from its left into its
    own copy; after n-1 steps part r has passed through every rank.
    """
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    return [Step(parts[(r - s - 1) % n], right, parts[(r - s - 2) % n], left, op) for s in range(n - 1)]


def all_gather_steps(link: Link, parts: tuple[torch.Tensor, ...]) -> list[Step]:
    """parts[r] is rank r's on entry; afterwards every part is everyone's."""
    n, r = link.size, link.rank
    right, left = (r + 1) % n, (r - 1) % n
    return [Step(parts[(r - s) % n], right, parts[(r - s - 1) % n], left) for s in range(n - 1)]


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    parts = split_parts(buf, link.size)
    # One run of steps, so the all-gather's first receive is posted during the last reduction.
    link.run_steps(reduce_scatter_steps(link, parts, op) + all_gather_steps(link, parts))


def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    parts = split_parts(link.scratch.copy_of("ring", input), link.size)
    link.run_steps(reduce_scatter_steps(link, parts, op))
    output.copy_(parts[link.rank])


def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    parts = split_parts(output, link.size)
    parts[link.rank].copy_(input)
    link.run_steps(all_gather_steps(link, parts))


def broadcast(link: Link, buf: torch.Tensor, root: int) -> None:
    """A pipelined chain root -> root+1 -> ...: each segment is forwarded as soon as it lands."""
    n, r = link.size, link.rank
    position = (r - root) % n
    pieces = link.segments(buf)
    receives = link.start_recvs(pieces, (r - 1) % n) if position > 0 else [None] * len(pieces)
    sends = []
    for piece, receive in zip(pieces, receives):
        if receive is not None:
            link.wait([receive])
        if position < n - 1:
            sends += link.start_sends([piece], (r + 1) % n)
    link.wait(sends)


def reduce(link: Link, buf: torch.Tensor, root: int, op: str) -> None:
    """A pipelined chain towards the root: the farthest rank starts, each adds its own."""
    n, r = link.size, link.rank
    position = (r - root) % n
    acc = buf if position == 0 else link.scratch.copy_of("ring", buf)
    pieces = link.segments(acc)
    if position < n - 1:
        receives = link.start_recvs(pieces, (r + 1) % n, reduce=op)
    else:
        receives = [None] * len(pieces)
    sends = []
    for piece, receive in zip(pieces, receives):
        if receive is not None:
            link.wait([receive])
        if position > 0:
            sends += link.start_sends([piece], (r - 1) % n)
    link.wait(sends)


def all_to_all(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    """n-1 shift steps: at step s send the part for rank r+s, receive the part from rank r-s."""
    n, r = link.size, link.rank
    send_parts = split_parts(input, n)
    receive_parts = split_parts(output, n)  # n equal parts: each is this rank's share of one input
    receive_parts[r].copy_(send_parts[r])
    # Every step reads the input and writes its own part of the output: nothing to wait for.
    link.run_steps([Step(send_parts[(r + s) % n], (r + s) % n, receive_parts[(r - s) % n], (r - s) % n)
                    for s in range(1, n)])
