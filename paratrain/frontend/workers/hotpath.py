"""Hot-path detection (GT_AUTO_COMPILE): compiled regions found in a stream without markers.

The detector watches one client's compilable operations on this worker, by name, and counts
every sequence of `min_ops` to `window` operations that ends at the newest one. The candidate
is the stream's current period: the shortest sequence whose last two repetitions are the
newest operations (a loop body, not a piece of one: in a five-operation body every
three-operation piece repeats as often as the body does), lengthened to whole repetitions of
at least `min_ops`. Once it has been seen `threshold` times it is hot: from the next operation
that starts it, the stream is cut into segments of up to `expand` repetitions of it, and each
segment is handed to the compiler as a region (compiled.py compiles it from its second
sighting on, like a marked region). A segment ends early where the stream stops following the
sequence; detection then starts over.

Operations that cannot be compiled (backward, optimizer steps, frees, collectives) are not
counted: a training loop's forward pass is then the repeated sequence, and the compiler cuts
each segment at them anyway.
"""

from __future__ import annotations

from collections import deque

from paratrain.frontend.workers.compile_settings import CompileSettings

MAX_COUNTED = 1 << 16  # distinct sequences remembered; a stream that never repeats starts over


class HotPaths:
    def __init__(self, settings: CompileSettings, on_hot=None):
        self.threshold, self.min_ops, self.expand = settings.threshold, settings.min_ops, settings.expand
        self.window = settings.window
        self.recent: deque = deque(maxlen=2 * settings.window)  # two repetitions of the longest body
        self.counts: dict[tuple, int] = {}
        self.pattern: tuple | None = None  # the hot sequence being followed
        self.inside = False  # within a segment (else waiting for the pattern's first operation)
        self.position = 0  # the pattern's next expected operation
        self.repeats = 0  # complete repetitions in this segment
        self.on_hot = on_hot  # called with each sequence the first time it becomes hot
        self.announced: set[tuple] = set()

    def see(self, name: str) -> tuple[bool, bool, bool]:
        """Where operation `name` falls: (a segment ends just before it, it is part of a
        segment, a segment ends just after it)."""
        ends_before = False
        if self.pattern is not None:
            if self.inside:
                if name == self.pattern[self.position]:
                    return self._follow()
                ends_before = True
            if name == self.pattern[0]:
                self.inside, self.position, self.repeats = True, 0, 0
                return (ends_before, *self._follow()[1:])
            self.pattern, self.inside = None, False
        self._count(name)
        return ends_before, False, False

    def _follow(self) -> tuple[bool, bool, bool]:
        self.position += 1
        if self.position < len(self.pattern):
            return False, True, False
        self.position = 0
        self.repeats += 1
        if self.repeats < self.expand:
            return False, True, False
        self.inside = False  # the segment is complete; the next one may start at once
        return False, True, True

    def _count(self, name: str) -> None:
        self.recent.append(name)
        recent = tuple(self.recent)
        size = len(recent)
        if len(self.counts) > MAX_COUNTED:
            self.counts.clear()
        for length in range(self.min_ops, min(size, self.window) + 1):
            sequence = recent[size - length:]
            self.counts[sequence] = self.counts.get(sequence, 0) + 1
        period = next((p for p in range(1, size // 2 + 1) if recent[size - p:] == recent[size - 2 * p:size - p]), None)
        if period is None:
            return
        length = period * -(-self.min_ops // period)  # whole repetitions, at least min_ops
        hot = recent[size - length:] if length <= min(size, self.window) else None
        if hot is not None and self.counts.get(hot, 0) >= self.threshold:
            self.pattern, self.inside = hot, False
            if hot not in self.announced and self.on_hot is not None:
                self.announced.add(hot)
                self.on_hot(hot, self.counts[hot])
