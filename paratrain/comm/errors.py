"""Errors raised by communication: each names who was waiting, on what, and for whom.

A timeout, a lost peer or a mismatched call also writes every rank's flight record (see
`paratrain.comm.flight`); such an error's `trace_dir` says where, and its message ends with it.
"""

from __future__ import annotations

import re


class TransportTimeout(Exception):
    """A transport gave up waiting; `peer` is the rank it waited on (None: a native collective)."""

    def __init__(self, peer: int | None, seconds: float, detail: str = ""):
        super().__init__(detail or f"timed out after {seconds:g}s")
        self.peer = peer
        self.seconds = seconds


class TransportFailure(Exception):
    """A transport's call failed (the connection to `peer` broke, the backend raised);
    `peer` is None where the backend does not say which rank it lost."""

    def __init__(self, peer: int | None, detail: str):
        super().__init__(detail)
        self.peer = peer


class _Traced:
    """Mixed into the errors that dump flight records: the dump's folder ends the message."""

    trace_dir: str | None = None

    def __str__(self) -> str:
        text = super().__str__()
        return text if self.trace_dir is None else f"{text}\n  flight records: {self.trace_dir}"


class CommTimeoutError(_Traced, TimeoutError):
    """A blocking operation did not finish within the group's timeout."""

    def __init__(self, rank: int, op: str, seq: int, peer: int | None, seconds: float):
        waited_on = f"rank {peer}" if peer is not None else "the other ranks"
        super().__init__(
            f"rank {rank}: {op} (call #{seq}) timed out after {seconds:g}s waiting for {waited_on}"
        )
        self.rank, self.op, self.seq, self.peer, self.seconds = rank, op, seq, peer, seconds


class PeerLostError(_Traced, RuntimeError):
    """A peer died, or the transport failed, while this rank was in a call: the error names
    this rank, the call and the rank it lost; the transport's own error is its __cause__."""

    def __init__(self, rank: int, op: str, seq: int, peer: int | None, detail: str, where: str | None = None):
        lost = f"rank {peer}" if peer is not None else "a peer (the backend does not say which)"
        lost += f" ({where})" if where else ""  # in a group spread over hosts: its world rank and host
        super().__init__(f"rank {rank}: {op} (call #{seq}) lost {lost}: {_without_source_location(detail)}")
        self.rank, self.op, self.seq, self.peer = rank, op, seq, peer


class CollectiveMismatchError(_Traced, RuntimeError):
    """Ranks called different collectives (or the same one on different shapes/dtypes)."""


class FabricAborted(RuntimeError):
    """Another rank of the in-process fabric failed, so this one stops instead of hanging;
    `peer` is that rank, numbered in the fabric that raised this (None: not one of its ranks)."""

    def __init__(self, reason: str, peer: int | None = None):
        super().__init__(reason)
        self.peer = peer


def _without_source_location(detail: str) -> str:
    # gloo starts its messages with the C++ file that raised them: noise to a reader.
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", detail)
