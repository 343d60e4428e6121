"""The `paratrain` command. Each subcommand lives with the layer it drives; this file only
wires them together."""

from __future__ import annotations

import click

from paratrain import __version__
from paratrain.bench.cli import bench
from paratrain.cli_errors import OneLineErrors
from paratrain.comm.flight_cli import debug
from paratrain.env_cli import env
from paratrain.frontend.cli import frontend, serve, top, worker
from paratrain.parallel.pipeline.schedule_cli import schedule
from paratrain.plan.cli import plan
from paratrain.plan.fit_cli import model
from paratrain.train.check import check
from paratrain.train.cli import train
from paratrain.train.sample import sample


class Paratrain(OneLineErrors, click.Group):
    """The `paratrain` command: a user's error is one line (cli_errors.py)."""


@click.group(name="paratrain", cls=Paratrain, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="paratrain")
@click.option("--debug", is_flag=True,
              help="Print the traceback of an error, not one line (so do PARATRAIN_DEBUG=1 and a command's own --debug).")
def main(debug: bool) -> None:
    """paratrain: distributed training you can read.

    Collectives written from point-to-point beside the backend's own, on threads (an
    in-process fabric) or processes (torch.distributed: gloo on CPU, NCCL on GPU).
    """
    del debug  # cli_errors reads it from the command line: it applies even when parsing fails


main.add_command(train)
main.add_command(check)
main.add_command(sample)
main.add_command(bench)
main.add_command(schedule)
main.add_command(serve)
main.add_command(worker)
main.add_command(top)
main.add_command(frontend)
main.add_command(debug)
main.add_command(plan)
main.add_command(model)
main.add_command(env)

if __name__ == "__main__":
    main()
