"""Ring algorithms: every rank talks only to its two neighbours.

All-reduce = reduce-scatter + all-gather, each n-1 steps that move 1/n of the buffer: a rank
sends 2(n-1)/n of the buffer in total, the least any all-reduce can, which is why NCCL and
gloo use rings for large messages. Each step is cut into segments (Link.exchange) so that
reducing one segment overlaps the transfer of the next. Latency grows with n, so small
messages prefer the tree or halving-doubling.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link
from paratrain.comm.ops import part_bounds


def _views(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    return [flat[start:end] for start, end in part_bounds(flat.numel(), parts)]


def reduce_scatter_inplace(link: Link, buf: torch.Tensor, op: str) -> None:
    """Afterwards part `rank` of buf holds the reduction over all ranks (others: partial sums).

    At step s rank r passes part r-s-1 to its right and folds part r-s-2 from its left into its
    own copy; after n-1 steps part r has passed through every rank.
    """
    n, r = link.size, link.rank
    parts = _views(buf, n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        link.exchange(
            send=parts[(r - step - 1) % n], dst=right,
            recv=parts[(r - step - 2) % n], src=left, reduce=op,
        )


def all_gather_inplace(link: Link, buf: torch.Tensor) -> None:
    """Part r of buf is rank r's on entry; afterwards every part is everyone's."""
    n, r = link.size, link.rank
    parts = _views(buf, n)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):
        link.exchange(send=parts[(r - step) % n], dst=right, recv=parts[(r - step - 1) % n], src=left)


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    reduce_scatter_inplace(link, buf, op)
    all_gather_inplace(link, buf)


def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    scratch = link.scratch.copy_of("ring", input)
    reduce_scatter_inplace(link, scratch, op)
    output.copy_(_views(scratch, link.size)[link.rank])


def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    _views(output, link.size)[link.rank].copy_(input)
    all_gather_inplace(link, output)


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
    send_parts = _views(input, n)
    receive_parts = _views(output, n)  # n equal parts: each is this rank's share of one input
    receive_parts[r].copy_(send_parts[r])
    for step in range(1, n):
        to, frm = (r + step) % n, (r - step) % n
        link.exchange(send=send_parts[to], dst=to, recv=receive_parts[frm], src=frm)
