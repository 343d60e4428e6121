"""Option types the commands share: a number that must be finite, a path to write to. Each
refuses a bad value while the command line is read, naming the option."""

from __future__ import annotations

import math

import click

from paratrain.paths import cannot_write


class FiniteFloat(click.FloatRange):
    """A float in a range, never nan or +-inf: `float()` reads "nan" and "inf", and a range
    check lets nan through (every comparison with it is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


class OutputPath(click.Path):
    """A file (or with `file_okay=False` a folder) the command will write: refused now if it
    cannot be, not after the work that produces it."""

    def __init__(self, **kwargs):
        kwargs.setdefault("dir_okay", False)
        super().__init__(**kwargs)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        reason = cannot_write(path, directory=not self.file_okay)
        if reason:
            self.fail(f"cannot write {value}: {reason}", param, ctx)
        return path
