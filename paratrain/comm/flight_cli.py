"""`paratrain debug`: tools for a run that failed. `paratrain debug hang DIR` reads the flight
records the ranks dumped into DIR and says which rank is behind or which calls differ."""

from __future__ import annotations

import click

from paratrain.comm.flight import read_dumps
from paratrain.comm.hang import report


@click.group()
def debug() -> None:
    """Look into a run that failed or hung."""


@debug.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.pass_context
def hang(ctx: click.Context, directory: str) -> None:
    """Say which rank is behind, or which calls differ, from the flight records in DIRECTORY
    (rank<N>.json, written on a timeout, a lost peer or a mismatched call into
    $PARATRAIN_TRACE_DIR or the folder the error names). Exits 1 when it finds a problem."""
    dumps = read_dumps(directory)
    if not dumps:
        raise click.UsageError(f"no flight records (rank<N>.json) in {directory}")
    lines, problem = report(dumps, directory)
    click.echo("\n".join(lines))
    ctx.exit(1 if problem else 0)
