"""The dispatcher's warnings about misbehaving peers, rate-limited per kind."""

from __future__ import annotations

import time


class Complaints:
    """Warnings about misbehaving peers, at most one line a second per kind: a flood of bad
    messages must not become a flood of lines."""

    def __init__(self, say):
        self.say, self.last, self.held = say, {}, {}

    def __call__(self, kind: str, text: str) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -1e9) < 1.0:
            self.held[kind] = self.held.get(kind, 0) + 1
            return
        held = self.held.pop(kind, 0)
        self.last[kind] = now
        self.say(text + (f" (and {held} more like it)" if held else ""), warning=True)
