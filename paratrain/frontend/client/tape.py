"""The tape: what this client has issued, newest last (`gt.debug.get_tape`).

Every instruction the program issued, as the client numbered it, with its operation, input
and output handles and the outputs' shapes; frees are not on it (they are the garbage
collector's, not the program's). Only the newest `LENGTH` are kept: a training loop issues
millions.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

LENGTH = 10_000


class Output(NamedTuple):
    handle: int
    shape: tuple | None  # None: made by the caller of `Session.issue` (a gradient, an optimizer)
    dtype: str | None
    requires_grad: bool


class Entry(NamedTuple):
    seq: int  # the client's number for the instruction (errors name it too)
    op: str
    inputs: list  # tensor handles
    outputs: list  # Output
    worker: int | None  # the worker asked for (gt.worker); None: where its inputs, or the client's home, are


class Tape:
    """Plain tuples go in (this is on every instruction's path); `entries()` names them."""

    def __init__(self, length: int = LENGTH):
        self.kept: deque = deque(maxlen=length)

    def record(self, seq: int, op: str, inputs: list, outputs: list, worker: int | None) -> None:
        """`outputs`: (handle, shape, dtype, requires_grad) tuples (never the tensors: the tape
        must not keep them alive, their garbage is what frees them)."""
        self.kept.append((seq, op, inputs, outputs, worker))

    def entries(self) -> list[Entry]:
        return [Entry(seq, op, inputs, [Output(*out) for out in outputs], worker)
                for seq, op, inputs, outputs, worker in self.kept]
