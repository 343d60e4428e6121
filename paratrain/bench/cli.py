"""`paratrain bench ...`: one subcommand per benchmark."""

from __future__ import annotations

import click

from paratrain.bench.collectives_cli import collectives


@click.group()
def bench() -> None:
    """Measure what this machine's communication and training can do."""


bench.add_command(collectives)
