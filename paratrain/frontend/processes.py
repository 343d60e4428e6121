"""How a process of the frontend ended, in words (whether one is still there: paratrain/lifetime.py)."""

from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """A Popen return code in words."""
    if code < 0:
        try:
            return f"its process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"
