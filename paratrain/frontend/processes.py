"""Processes of the frontend watching each other: is one still there, and how did it end."""

from __future__ import annotations

import os
import signal


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, and belongs to someone else
    return True


def describe_exit(code: int) -> str:
    """A Popen return code in words."""
    if code < 0:
        try:
            return f"its process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"its process was killed by signal {-code}"
    return f"its process exited with code {code}"
