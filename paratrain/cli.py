"""The `paratrain` command. Each subcommand lives with the layer it drives; this file only
wires them together."""

from __future__ import annotations

import importlib

import click

from paratrain import __version__
from paratrain.cli_errors import OneLineErrors

# Each subcommand, where it lives. Imported when it is run (or listed by --help): every command
# pays only for its own imports (`serve` does not import the training loop and DTensor, nor
# `train` the frontend), which a process that starts many of them, a test suite, notices.
SUBCOMMANDS = {
    "train": "paratrain.train.cli:train",
    "check": "paratrain.train.check:check",
    "matrix": "paratrain.train.matrix_cli:matrix",
    "sample": "paratrain.train.sample:sample",
    "export": "paratrain.train.export_cli:export",
    "bench": "paratrain.bench.cli:bench",
    "schedule": "paratrain.parallel.pipeline.schedule_cli:schedule",
    "serve": "paratrain.frontend.cli:serve",
    "worker": "paratrain.frontend.cli:worker",
    "top": "paratrain.frontend.cli:top",
    "frontend": "paratrain.frontend.cli:frontend",
    "debug": "paratrain.comm.flight_cli:debug",
    "plan": "paratrain.plan.cli:plan",
    "model": "paratrain.plan.fit_cli:model",
    "env": "paratrain.env_cli:env",
}


class Paratrain(OneLineErrors, click.Group):
    """The `paratrain` command: a user's error is one line (cli_errors.py); subcommands are
    imported on first use."""

    def list_commands(self, ctx) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module, attribute = SUBCOMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attribute)


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


if __name__ == "__main__":
    main()
