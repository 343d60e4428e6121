"""Which signal regions the program is in: a stack per thread, as `with` blocks nest.

`gt.signal.context(name)` pushes a name; every instruction issued inside carries the
innermost one, and the dispatcher places it as that signal's configuration says.

The stack is a tuple replaced on every enter and leave, so that a session can tell with one
identity test whether the program changed regions since its last instruction (it marks where
compiled regions begin and end). Each entry is its own object: leaving a region and entering
it again is a new execution of it, even with nothing issued in between.
"""

from __future__ import annotations

import threading

_state = threading.local()


class Entry:
    """One execution of a region: the name, and an identity of its own."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def stack() -> tuple:
    """The regions this thread is in, outermost first (the same object until one is entered
    or left)."""
    return getattr(_state, "stack", ())


def current() -> str | None:
    """The innermost active signal of this thread (None outside every region)."""
    regions = getattr(_state, "stack", ())
    return regions[-1].name if regions else None


def enter(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a signal name must be a non-empty string, got {name!r}")
    _state.stack = (*stack(), Entry(name))


def leave(name: str) -> None:
    regions = stack()
    if not regions or regions[-1].name != name:
        raise RuntimeError(f"signal.exit({name!r}) does not match the innermost region {current()!r}")
    _state.stack = regions[:-1]
