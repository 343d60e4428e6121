"""What a page shows against what ran: each shown line, numbers as any number and runs of spaces
as one, must appear in the output in order; the first that does not is reported beside the
actual line nearest to it."""

from __future__ import annotations

import difflib
import re

# A sign belongs to a number only where no word comes right before it: "-6%", not "pid-3f2a".
NUMBER = re.compile(r"(?:(?<![\w)])[-+])?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def normal(line: str) -> str:
    """A line as compared: numbers as `#`, runs of spaces as one, no spaces at the ends."""
    return " ".join(NUMBER.sub("#", line).split())


def _line_matches(shown: str, actual: str) -> bool:
    at = 0
    for part in shown.split("..."):
        found = actual.find(part.strip(), at)
        if found < 0:
            return False
        at = found + len(part.strip())
    return True


def compare(shown: list[str], actual: str) -> str | None:
    """None when every shown line appears in `actual` in order; else which line did not, and the
    actual line nearest to it."""
    lines = actual.splitlines()
    wanted = [normal(line) for line in shown]
    got = [normal(line) for line in lines]
    at = 0
    for raw, want in zip(shown, wanted):
        if not want or want == "...":
            continue
        found = next((k for k in range(at, len(got)) if _line_matches(want, got[k])), None)
        if found is None:
            pool = range(at, len(got)) if at < len(got) else range(len(got))
            nearest = max(pool, key=lambda k: difflib.SequenceMatcher(None, want, got[k]).ratio(), default=None)
            near = lines[nearest].strip() if nearest is not None else "(no output)"
            return f"shown line not found: {raw.strip()}\n  nearest actual line: {near}"
        at = found + 1
    return None

