"""`paratrain matrix`: run the parity matrix (train/matrix.py), or a part of it, with a progress
bar; print it as tables and write its records as JSON (docs/results.md renders them)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click
from tqdm import tqdm

from paratrain.cli_types import OutputPath
from paratrain.parallel.data.strategy import STRATEGIES
from paratrain.provenance import code_commit, utc_now
from paratrain.train.matrix import LAYOUT_NAMES, MODELS, cells, render, run_cell


def _names(text: str | None, valid, what: str) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise click.UsageError(f"--{what}: unknown {unknown[0] if unknown else 'empty list'!r}; valid: "
                               f"{', '.join(valid)}")
    return names


@contextmanager
def _ranks_quiet(progress_stream):
    """The ranks' output goes nowhere while a cell runs (threads and processes alike: the
    descriptors are redirected); the progress bar writes to its own copy of the terminal."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as devnull:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            progress_stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--models", help=f"Comma-separated rows (default every one): {', '.join(MODELS)}.")
@click.option("--strategies", help=f"Comma-separated data-parallel strategies (default every one): "
                                   f"{', '.join(STRATEGIES)}.")
@click.option("--layouts", help=f"Comma-separated layouts (default every one): {', '.join(LAYOUT_NAMES)}.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path), help="Write every cell's record to this file.")
def matrix(models, strategies, layouts, json_path):
    """Every model in every data-parallel strategy and layout, each cell checked against one process.

    A cell is PASS (the same losses and parameters as one process, fp32 tolerances), refused (the
    configuration's validation says why in one line, before any rank starts), or FAIL. Exits 1 if
    any cell fails. The whole grid takes minutes (about a second a cell); `make matrix` runs it and
    rewrites its section of docs/results.md.

    \b
    Examples:
      paratrain matrix --models llama-tiny --strategies fsdp,ddp
      paratrain matrix --layouts "dp 2,tp 2 x dp 2" --json matrix.json
    """
    grid = cells(_names(models, list(MODELS), "models"), _names(strategies, list(STRATEGIES), "strategies"),
                 _names(layouts, LAYOUT_NAMES, "layouts"))
    records, references, started = [], {}, time.perf_counter()
    terminal = os.fdopen(os.dup(2), "w")
    with tqdm(grid, desc="matrix", unit="cell", file=terminal, dynamic_ncols=True) as progress:
        for model, strategy, layout in progress:
            progress.set_postfix_str(f"{model} / {strategy} / {layout.name}")
            with _ranks_quiet(terminal):
                records.append(run_cell(model, strategy, layout, references))
            if records[-1]["status"] == "FAIL":
                progress.write(f"FAIL {model} / {strategy} / {layout.name}: {records[-1]['reason']}")
    terminal.close()
    click.echo("\n".join(render(records)))
    if json_path:
        run = {"date": utc_now(), "commit": code_commit(), "command": " ".join(["paratrain matrix", *map(shlex.quote, sys.argv[2:])]),
               "seconds": time.perf_counter() - started, "cells": records}
        json_path.write_text(json.dumps(run, indent=1) + "\n")
        click.echo(f"wrote {len(records)} cells to {json_path}")
    sys.exit(1 if any(r["status"] == "FAIL" for r in records) else 0)

