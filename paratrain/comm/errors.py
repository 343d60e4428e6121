"""Errors raised by communication: each names who was waiting, on what, and for whom."""

from __future__ import annotations


class TransportTimeout(Exception):
    """A transport gave up waiting; `peer` is the rank it waited on (None: a native collective)."""

    def __init__(self, peer: int | None, seconds: float, detail: str = ""):
        super().__init__(detail or f"timed out after {seconds:g}s")
        self.peer = peer
        self.seconds = seconds


class CommTimeoutError(TimeoutError):
    """A blocking operation did not finish within the group's timeout."""

    def __init__(self, rank: int, op: str, seq: int, peer: int | None, seconds: float):
        waited_on = f"rank {peer}" if peer is not None else "the other ranks"
        super().__init__(
            f"rank {rank}: {op} (call #{seq}) timed out after {seconds:g}s waiting for {waited_on}"
        )
        self.rank, self.op, self.seq, self.peer, self.seconds = rank, op, seq, peer, seconds


class CollectiveMismatchError(RuntimeError):
    """Ranks called different collectives (or the same one on different shapes/dtypes)."""


class FabricAborted(RuntimeError):
    """Another rank of the in-process fabric failed, so this one stops instead of hanging."""
