"""Direct algorithms: everyone talks to everyone (or to the root) at once.

The naive baseline: all-reduce as reduce-to-root followed by a broadcast from the root, so the
root moves n-1 whole buffers each way. It is what the seeds' first versions do, and what the
others are measured against.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link
from paratrain.comm.ops import Splits, all_to_all_parts, combine_, split_parts
from paratrain.comm.transport.base import P2POp


def _others(link: Link) -> list[int]:
    return [peer for peer in range(link.size) if peer != link.rank]


def reduce(link: Link, buf: torch.Tensor, root: int, op: str) -> None:
    if link.rank != root:
        link.send(buf, root)
        return
    staging = [link.scratch.get(("direct", peer), buf) for peer in _others(link)]
    link.wait(link.start([P2POp("recv", s, p) for s, p in zip(staging, _others(link))]))
    for part in staging:  # fold in rank order: the same order on every run
        combine_(buf, part, op)


def broadcast(link: Link, buf: torch.Tensor, root: int) -> None:
    if link.rank != root:
        link.recv(buf, root)
        return
    link.wait(link.start([P2POp("send", buf, peer) for peer in _others(link)]))


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    reduce(link, buf, 0, op)
    broadcast(link, buf, 0)


def barrier(link: Link, token: torch.Tensor, op: str) -> None:
    """Every rank sends its token (zeros) to every other and hears from every other: done once
    all have entered. A rank lost meanwhile is the peer whose message fails, on every survivor;
    as reduce-and-broadcast, the others would wait on the root, and name it once it gave up."""
    staging = [link.scratch.get(("direct", peer), token) for peer in _others(link)]
    ops = [P2POp("send", token, peer) for peer in _others(link)]
    ops += [P2POp("recv", part, peer) for part, peer in zip(staging, _others(link))]
    link.wait(link.start(ops))


def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    """Each rank sends part j straight to rank j and folds in what the others send it."""
    parts = split_parts(input, link.size)
    output.copy_(parts[link.rank])
    ops = [P2POp("send", parts[peer], peer) for peer in _others(link) if parts[peer].numel()]
    ops += [P2POp("recv", output, peer, reduce=op) for peer in _others(link) if output.numel()]
    link.wait(link.start(ops))


def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    parts = split_parts(output, link.size)
    parts[link.rank].copy_(input)
    ops = [P2POp("send", input, peer) for peer in _others(link) if input.numel()]
    ops += [P2POp("recv", parts[peer], peer) for peer in _others(link) if parts[peer].numel()]
    link.wait(link.start(ops))


def all_to_all(link: Link, input: torch.Tensor, output: torch.Tensor, splits: Splits | None = None) -> None:
    """Every part posted at once; an empty part is no message at all (its peer posts no receive
    for it either: both ends know its size)."""
    send_parts, receive_parts = all_to_all_parts(input, output, link.size, splits)
    receive_parts[link.rank].copy_(send_parts[link.rank])
    ops = [P2POp("send", send_parts[p], p) for p in _others(link) if send_parts[p].numel()]
    ops += [P2POp("recv", receive_parts[p], p) for p in _others(link) if receive_parts[p].numel()]
    link.wait(link.start(ops))
