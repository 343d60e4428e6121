"""The backend's own collectives ("native"): gloo's or NCCL's over torch.distributed, the
fabric's shared-memory reads on threads. One more algorithm, with the same signature as the
others, so that the Group runs every algorithm the same way; the transport carries the call
whole, and the Link only lends it its timeout.
"""

from __future__ import annotations

import torch

from paratrain.comm.link import Link
from paratrain.comm.ops import Splits


def all_reduce(link: Link, buf: torch.Tensor, op: str) -> None:
    link.transport.native_all_reduce(buf, op, link.timeout)


def reduce_scatter(link: Link, input: torch.Tensor, output: torch.Tensor, op: str) -> None:
    link.transport.native_reduce_scatter(output, input, op, link.timeout)


def all_gather(link: Link, input: torch.Tensor, output: torch.Tensor) -> None:
    link.transport.native_all_gather(output, input, link.timeout)


def broadcast(link: Link, buf: torch.Tensor, root: int) -> None:
    link.transport.native_broadcast(buf, root, link.timeout)


def reduce(link: Link, buf: torch.Tensor, root: int, op: str) -> None:
    link.transport.native_reduce(buf, root, op, link.timeout)


def all_to_all(link: Link, input: torch.Tensor, output: torch.Tensor, splits: Splits | None = None) -> None:
    link.transport.native_all_to_all(output, input, link.timeout, splits)


def barrier(link: Link, token: torch.Tensor, op: str) -> None:
    link.transport.native_barrier(link.timeout)
