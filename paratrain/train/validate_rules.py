"""The small rules every check before a run uses: what counts as an integer or a finite number,
one of a set, at least a bound; each problem one line naming the setting."""

from __future__ import annotations

import math


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A finite int or float: nan and inf parse as floats (`--lr nan`) and would train to a loss of nan."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def choice(problems, label, value, valid) -> None:
    if value not in valid:
        problems.append(f"{label}: unknown value {value!r}; valid: {', '.join(valid)}")


def at_least(problems, label, value, low, kind="integer") -> bool:
    ok = (is_int(value) if kind == "integer" else is_number(value)) and value >= low
    if not ok:
        problems.append(f"{label} must be {'an integer' if kind == 'integer' else 'a finite number'} >= {low}, "
                        f"got {value!r}")
    return ok
