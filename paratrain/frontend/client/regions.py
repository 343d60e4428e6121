"""Which signal region the program is in: a stack per thread, as `with` blocks nest.

`gt.signal.context(name)` pushes a name; every instruction issued inside carries the
innermost one, and the dispatcher places it as that signal's configuration says.
"""

from __future__ import annotations

import threading

_state = threading.local()


def current() -> str | None:
    """The innermost active signal of this thread (None outside every region)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def enter(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a signal name must be a non-empty string, got {name!r}")
    if not hasattr(_state, "stack"):
        _state.stack = []
    _state.stack.append(name)


def leave(name: str) -> None:
    stack = getattr(_state, "stack", [])
    if not stack or stack[-1] != name:
        raise RuntimeError(f"signal.exit({name!r}) does not match the innermost region {current()!r}")
    stack.pop()
