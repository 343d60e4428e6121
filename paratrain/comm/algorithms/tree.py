"""Binomial trees: log2(n) rounds, in round k every rank that has the data passes it 2^k ranks on.

The whole buffer moves each round, so trees suit small messages, where the number of rounds
(latency) matters more than the bytes. Ranks are numbered relative to the root.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link


def broadcast(link: Link, buf: torch.Tensor, root: int) -> None:
    n = link.size
    position = (link.rank - root) % n
    mask = 1
    while mask < n:
        if position < mask and position + mask < n:
            link.send(buf, (position + mask + root) % n)
        elif mask <= position < 2 * mask:
            link.recv(buf, (position - mask + root) % n)
        mask *= 2


def reduce(link: Link, buf: torch.Tensor, root: int, op: str) -> None:
    """Mirror of broadcast: in round k ranks with bit k set send their partial result down."""
    n = link.size
    position = (link.rank - root) % n
    acc = buf if position == 0 else link.scratch.copy_of("tree", buf)
    mask = 1
    while mask < n:
        if position & mask:
            link.send(acc, (position - mask + root) % n)
            return
        if position + mask < n:
            link.recv(acc, (position + mask + root) % n, reduce=op)
        mask *= 2


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    reduce(link, buf, 0, op)
    broadcast(link, buf, 0)
