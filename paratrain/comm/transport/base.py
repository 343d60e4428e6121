"""What every transport offers: batched point-to-point ops and the backend's own collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from paratrain.comm.ops import Splits


@dataclass(slots=True)
class P2POp:
    """One send or receive. A receive with `reduce` set combines into `tensor` instead of
    overwriting it, which lets a transport reduce straight out of the peer's buffer."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    reduce: str | None = None


# What a call did at its transport, in order: ("post", ops) started `ops`; ("wait", numbers)
# completed the messages with those numbers (in the order they were posted, from 0). Link
# records one for a replay (replays.py), which runs it again, or has the transport compile it.
POST, WAIT = "post", "wait"
Schedule = list[tuple[str, list]]


class Work(Protocol):
    peer: int
    kind: str  # "send" or "recv"

    def wait(self, timeout: float) -> None:
        """Block until done; raise TransportTimeout after `timeout` seconds, TransportFailure
        (or, on the fabric, FabricAborted) when the peer or the connection is gone."""


class Transport(Protocol):
    rank: int
    size: int
    kind: str  # "fabric", "gloo", "nccl" or "shm": the key the algorithm table is indexed by
    global_ranks: tuple[int, ...]  # rank r of this transport is rank global_ranks[r] of the world
    flight: object  # the FlightRecords (flight.py) of this process's ranks
    segment_bytes: int  # how large a piece of a ring step suits this transport
    posts_ahead: bool  # may receives be posted in a batch of their own, before the sends they pair with

    def describe(self) -> str:
        """One line: the kind, and what carries the messages (`--explain`, `paratrain env`)."""

    def start(self, ops: list[P2POp]) -> list[Work]:
        """Start all `ops` together (NCCL needs paired sends/receives posted as one batch).
        Raise TransportFailure when the backend refuses (a peer known to be gone)."""

    # Optional: compile(schedule) -> a function (tag, timeout) -> works, running a recorded
    # call with nothing between the backend's own calls (TorchTransport has one for gloo).

    def native_all_reduce(self, tensor: torch.Tensor, op: str, timeout: float) -> None: ...

    def native_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str, timeout: float
    ) -> None: ...

    def native_all_gather(self, output: torch.Tensor, input: torch.Tensor, timeout: float) -> None: ...

    def native_broadcast(self, tensor: torch.Tensor, root: int, timeout: float) -> None: ...

    def native_reduce(self, tensor: torch.Tensor, root: int, op: str, timeout: float) -> None: ...

    def native_all_to_all(self, output: torch.Tensor, input: torch.Tensor, timeout: float,
                          splits: Splits | None = None) -> None: ...

    def native_barrier(self, timeout: float) -> None: ...


class Traffic:
    """The bytes this process has sent to ranks on other hosts, shared by every group of its
    world (a subgroup's transport is handed its parent's). `counted`: messages of paratrain's
    own algorithms and point-to-point, byte for byte. `modelled`: the backend's own collectives,
    whose messages we cannot see, as the rings gloo runs them (see TorchTransport)."""

    __slots__ = ("counted", "modelled")

    def __init__(self):
        self.counted = 0
        self.modelled = 0

    @property
    def total(self) -> int:
        return self.counted + self.modelled
