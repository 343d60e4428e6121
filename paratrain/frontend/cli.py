"""`paratrain serve`, `paratrain worker`, `paratrain top` and `paratrain frontend ...`."""

from __future__ import annotations

import click

from paratrain.cli_errors import OneLineCommand
from paratrain.cli_types import FiniteFloat, OutputPath

_TOKEN = dict(envvar="PARATRAIN_TOKEN", default=None,
              help="Shared secret; required to bind an address other than loopback, and then at least 16 "
                   "characters other than spaces [PARATRAIN_TOKEN].")


PORT = click.IntRange(0, 65535)


@click.command(cls=OneLineCommand)
@click.option("-H", "--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --token.")
@click.option("-p", "--port", default=29700, show_default=True, type=PORT, help="Port (0: any free port).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1), help="Workers in the world.")
@click.option("--local-workers", is_flag=True,
              help="Start the workers here, one process each (else wait for `paratrain worker`s).")
@click.option("--spawn-gpu-workers", "--spawn_gpu_workers", "spawn", type=click.IntRange(0), default=0,
              help="GT's flag: start N workers here, one per GPU where there are GPUs (--workers N --local-workers).")
@click.option("--token", **_TOKEN)
@click.option("--instruction-log", "--log-file", "instruction_log",
              envvar=["PARATRAIN_INSTRUCTION_LOG", "GT_INSTRUCTION_LOG"], type=OutputPath(), default=None,
              help="Write the instruction log (one line per instruction and message) to this file "
                   "[PARATRAIN_INSTRUCTION_LOG, GT_INSTRUCTION_LOG].")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="Torch threads per local worker (default: cores / workers).")
@click.option("--client-timeout", default=30.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Seconds without a heartbeat before a client is dropped and its tensors freed.")
@click.option("--worker-timeout", default=5.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Seconds without a heartbeat before a worker is declared lost.")
@click.option("--join-timeout", default=10.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Seconds a connection may stay open without its peer joining (its hello admitted; with a "
                   "token, the challenge answered) before it is closed.")
@click.option("--max-message-mb", default=1024, show_default=True, type=click.IntRange(1, 2047),
              help="Largest message (one uploaded tensor) accepted, in MiB.")
@click.option("--max-tensor-mb", default=None, type=click.IntRange(1),
              help="Largest tensor a client may make, in MiB (default: no limit).")
@click.option("--auto-shard/--no-auto-shard", envvar=["PARATRAIN_AUTO_SHARD", "GT_AUTO_SHARD"], default=False,
              help="Split large new tensors over every worker, batch axis first (see docs/frontend.md) "
                   "[PARATRAIN_AUTO_SHARD, GT_AUTO_SHARD].")
@click.option("--auto-shard-min-bytes", envvar="PARATRAIN_AUTO_SHARD_MIN_BYTES", default=None, type=click.IntRange(0),
              help="With --auto-shard: smaller tensors stay whole on one worker (default: 4 MiB) "
                   "[PARATRAIN_AUTO_SHARD_MIN_BYTES].")
@click.option("--quiet", "--no-console-log", "quiet", is_flag=True, help="Print only warnings (refusals, lost workers).")
@click.option("--exit-with-pid", type=int, default=None, hidden=True)
@click.pass_context
def serve(ctx, host, port, workers, local_workers, spawn, token, instruction_log, threads, client_timeout,
          worker_timeout, join_timeout, max_message_mb, max_tensor_mb, auto_shard, auto_shard_min_bytes, quiet,
          exit_with_pid):
    """Run a frontend dispatcher: clients connect with `gt.connect("HOST:PORT")` (or
    PARATRAIN_SERVER=HOST:PORT), workers with `paratrain worker --host HOST --port PORT`.
    GT's `python -m gt.server -p PORT --spawn_gpu_workers N` is `python -m paratrain.frontend.server`
    with the same flags (but the host stays loopback unless given)."""
    from paratrain.frontend.dispatcher.listener import CannotServe
    from paratrain.frontend.dispatcher.serve import serve as run
    from paratrain.frontend.dispatcher.serve_options import DispatcherSettings

    if spawn:
        if ctx.get_parameter_source("workers") is not click.core.ParameterSource.DEFAULT and workers != spawn:
            raise click.UsageError(f"--spawn-gpu-workers {spawn} starts {spawn} workers, but --workers says {workers}")
        workers, local_workers = spawn, True

    try:
        settings = DispatcherSettings(host, port, workers, token, instruction_log, client_timeout, worker_timeout,
                                      join_timeout, max_message_mb, max_tensor_mb, quiet, auto_shard,
                                      **({} if auto_shard_min_bytes is None else {"auto_shard_min_bytes": auto_shard_min_bytes}))
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    try:
        status = run(settings, local_workers=local_workers, threads=threads, exit_with_pid=exit_with_pid)
    except (CannotServe, OSError) as error:
        raise click.ClickException(str(error)) from None
    raise SystemExit(status)


@click.command(cls=OneLineCommand)
@click.option("--host", default="127.0.0.1", show_default=True, help="The dispatcher's address.")
@click.option("-p", "--port", default=29700, show_default=True, type=PORT, help="The dispatcher's port.")
@click.option("--token", **_TOKEN)
@click.option("--threads", type=click.IntRange(1), default=None, help="Torch threads for this worker.")
@click.option("--connect-timeout", default=120.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Seconds to wait for the dispatcher to answer before giving up.")
@click.option("--backend", type=click.Choice(["pytorch", "cuda", "cpu", "numpy"]), default=None,
              help="The device: cuda, or cpu (GT's 'numpy'); pytorch: a GPU if there is one "
                   "[default: PARATRAIN_BACKEND / GT_BACKEND, else pytorch].")
@click.option("--id", "name", default=None, help="This worker's name (GT's --id), in the dispatcher's line saying it joined.")
@click.option("--exit-with-pid", type=int, default=None, hidden=True)
def worker(host, port, token, threads, connect_timeout, backend, name, exit_with_pid):
    """Serve a dispatcher as one worker (one device). Start as many as `serve --workers` says;
    under torchrun the workers' world is torchrun's, else the dispatcher forms it. GT's
    `python -m gt.worker --host H -p PORT` is `python -m paratrain.frontend.worker` with the same flags.

    Compilation follows GT's variables (GT_AUTO_COMPILE, GT_HOTPATH_*, GT_DEBUG_COMPILE,
    GT_SAVE_COMPILED_CODE, or their PARATRAIN_ names), read once here with every other setting."""
    from paratrain.frontend.errors import FrontendError
    from paratrain.frontend.protocol.addresses import AddressError
    from paratrain.frontend.workers.compile_settings import CompileSettings
    from paratrain.frontend.workers.worker import DeviceUnavailable, run_worker
    from paratrain.launch import init_process_group_from_env
    from paratrain.environment import Settings, SettingsError

    try:
        settings = Settings.resolve()
        compile_settings = CompileSettings.from_settings(settings)
    except SettingsError as error:
        raise click.UsageError(str(error)) from None
    group = init_process_group_from_env(settings) if settings.launch.in_torchrun else None
    try:
        run_worker(f"{host}:{port}", token, group=group, local_rank=settings.launch.local_rank,
                   threads=threads, connect_timeout=connect_timeout, exit_with_pid=exit_with_pid,
                   backend=backend or settings.backend, name=name, compile_settings=compile_settings,
                   settings=settings)
    except (AddressError, FrontendError, DeviceUnavailable) as error:
        raise click.ClickException(str(error)) from None


@click.command()
@click.option("--server", envvar="PARATRAIN_SERVER", default="127.0.0.1:29700", show_default=True,
              help="The dispatcher, HOST:PORT [PARATRAIN_SERVER].")
@click.option("--token", **_TOKEN)
@click.option("--interval", default=1.0, show_default=True, type=FiniteFloat(min=0, min_open=True),
              help="Seconds between updates.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@click.option("-n", "--iterations", type=click.IntRange(min=1), default=None,
              help="Stop after this many updates (default: until Ctrl-C).")
def top(server, token, interval, once, iterations):
    """Live view of a dispatcher: per worker operations/s, busy %, queue depth and memory held;
    per client instructions and tensors. On a terminal the view is redrawn in place; into a pipe
    or a file each update is printed after the last."""
    from paratrain.frontend.errors import FrontendError
    from paratrain.frontend.protocol.addresses import AddressError
    from paratrain.frontend.top import run_top

    try:
        run_top(server, token, interval, once, snapshots=iterations)
    except (AddressError, FrontendError) as error:
        raise click.ClickException(str(error)) from None


@click.group()
def frontend():
    """Tools for the single-controller frontend."""


@frontend.command()
@click.argument("log", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--live", type=FiniteFloat(0, 3600, min_open=True), default=None, metavar="SECONDS",
              help="Instead of reading LOG, capture SECONDS of a running dispatcher's log (see --server).")
@click.option("--server", envvar="PARATRAIN_SERVER", default="127.0.0.1:29700", show_default=True,
              help="With --live: the dispatcher, HOST:PORT [PARATRAIN_SERVER].")
@click.option("--token", **_TOKEN)
@click.option("-n", "--max-events", type=click.IntRange(1), default=None,
              help="With --live: stop after this many lines.")
@click.option("--save", type=OutputPath(), default=None,
              help="With --live: also write the captured log here (default: it is kept in memory only).")
@click.option("-o", "--output", type=OutputPath(), default="frontend_trace.json", show_default=True, help="Chrome trace to write.")
@click.option("--png", type=OutputPath(), default=None,
              help="Also draw a timeline here: a lane per worker, a bar per instruction.")
def trace(log, live, server, token, max_events, save, output, png):
    """Turn an instruction log into a Chrome trace (open it at ui.perfetto.dev): one track per
    worker, one slice per instruction; with --png, a timeline picture too."""
    from paratrain.frontend.trace import read_events, read_log, write_chrome_trace

    if (log is None) == (live is None):
        raise click.UsageError("give either a LOG file or --live SECONDS")
    if live is not None:
        lines = _capture(server, token, live, max_events, save)
        events = read_events(lines)
    else:
        events = read_log(log)
    count = write_chrome_trace(events, output)
    click.echo(f"wrote {count} instructions to {output}")
    if png:
        from paratrain.frontend.timeline import draw_timeline

        drawn = draw_timeline(events, png)
        click.echo(f"drew {drawn} instructions in {png}")


def _capture(server: str, token: str | None, seconds: float, max_events: int | None, save: str | None) -> list[str]:
    """Capture a running dispatcher's log lines; with `save`, write them there as a log file."""
    from paratrain.frontend.dispatcher.log import HEADER
    from paratrain.frontend.errors import FrontendError
    from paratrain.frontend.monitor import capture
    from paratrain.frontend.protocol.addresses import AddressError

    try:
        lines, missed = capture(server, token, seconds, max_events)
    except (AddressError, FrontendError) as error:
        raise click.ClickException(str(error)) from None
    if save:
        with open(save, "w") as out:
            out.write(HEADER + f"# captured {seconds:g}s from {server}\n" + "".join(line + "\n" for line in lines))
    click.echo(f"captured {len(lines)} lines from {server}" + (f" into {save}" if save else "")
               + (f" ({missed} missed: the capture fell behind)" if missed else ""))
    return lines


@frontend.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Check against this many workers (default: as many as the file names).")
def explain(config, workers):
    """Print what a signal configuration (GT's YAML schema) does: per signal its workers and
    layout, and the worker layout drawn as stages x tensor-parallel ranks."""
    from paratrain.frontend import signals
    from paratrain.frontend.explain import describe, draw

    parsed = signals.parse(signals.load(config), workers)  # a signals.ConfigError: one line per problem
    for line in describe(parsed) + draw(parsed):
        click.echo(line)
