"""How close the dispatcher is to running out of file descriptors: each connection holds one,
and at the limit new peers (real clients among them) fail to connect with nothing said.

`Descriptors.check()` is called once a tick and returns a line to print when the process holds
WARN_AT of its limit or more: at the first crossing, then at most once a minute while it lasts.
"""

from __future__ import annotations

import os
import time

WARN_AT = 0.8  # of RLIMIT_NOFILE's soft limit
REPEAT_S = 60.0


def in_use() -> tuple[int, int] | None:
    """(descriptors open, the soft limit) of this process; None where it cannot be read."""
    try:
        import resource

        used = len(os.listdir("/proc/self/fd"))
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError):  # no /proc (macOS), no resource module (Windows)
        return None
    return (used, limit) if limit > 0 else None


class Descriptors:
    def __init__(self, read=in_use):
        self.read, self.said_at = read, None

    def check(self, now: float | None = None) -> str | None:
        found = self.read()
        now = time.monotonic() if now is None else now
        if found is None or found[0] < WARN_AT * found[1]:
            self.said_at = None  # below again: the next crossing is said at once
            return None
        if self.said_at is not None and now - self.said_at < REPEAT_S:
            return None
        self.said_at = now
        used, limit = found
        return (f"{used} of {limit} file descriptors in use (one per connection): new connections will fail at "
                f"the limit; raise it (ulimit -n) or see who holds them (paratrain top)")
