"""`paratrain bench ...`: one subcommand per benchmark."""

from __future__ import annotations

import click

from paratrain.bench.collectives_cli import collectives
from paratrain.bench.cp import cp
from paratrain.bench.ddp import ddp
from paratrain.bench.frontend import frontend
from paratrain.bench.moe import moe
from paratrain.bench.p2p_cli import p2p
from paratrain.bench.pipeline import pipeline
from paratrain.bench.scaling import scaling
from paratrain.bench.tp import tp
from paratrain.bench.train import train


@click.group()
def bench() -> None:
    """Measure what this machine's communication and training can do."""


bench.add_command(collectives)
bench.add_command(cp)
bench.add_command(ddp)
bench.add_command(frontend)
bench.add_command(moe)
bench.add_command(p2p)
bench.add_command(pipeline)
bench.add_command(scaling)
bench.add_command(tp)
bench.add_command(train)
