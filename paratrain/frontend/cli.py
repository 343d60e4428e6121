"""`paratrain serve`, `paratrain worker`, `paratrain top` and `paratrain frontend ...`."""

from __future__ import annotations

import os

import click

_TOKEN = dict(envvar="PARATRAIN_TOKEN", default=None,
              help="Shared secret; required to bind an address other than loopback [PARATRAIN_TOKEN].")


PORT = click.IntRange(0, 65535)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback needs --token.")
@click.option("--port", default=29700, show_default=True, type=PORT, help="Port (0: any free port).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1), help="Workers in the world.")
@click.option("--local-workers", is_flag=True,
              help="Start the workers here, one process each (else wait for `paratrain worker`s).")
@click.option("--token", **_TOKEN)
@click.option("--instruction-log", envvar=["PARATRAIN_INSTRUCTION_LOG", "GT_INSTRUCTION_LOG"],
              type=click.Path(dir_okay=False), default=None,
              help="Write one line per instruction to this file [PARATRAIN_INSTRUCTION_LOG, GT_INSTRUCTION_LOG].")
@click.option("--threads", type=click.IntRange(1), default=None,
              help="Torch threads per local worker (default: cores / workers).")
@click.option("--client-timeout", default=30.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds without a heartbeat before a client is dropped and its tensors freed.")
@click.option("--worker-timeout", default=5.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds without a heartbeat before a worker is declared lost.")
@click.option("--max-message-mb", default=1024, show_default=True, type=click.IntRange(1, 2047),
              help="Largest message (one uploaded tensor) accepted, in MiB.")
@click.option("--max-tensor-mb", default=None, type=click.IntRange(1),
              help="Largest tensor a client may make, in MiB (default: no limit).")
@click.option("--quiet", is_flag=True, help="Print only warnings (refusals, lost workers).")
@click.option("--exit-with-pid", type=int, default=None, hidden=True)
def serve(host, port, workers, local_workers, token, instruction_log, threads, client_timeout,
          worker_timeout, max_message_mb, max_tensor_mb, quiet, exit_with_pid):
    """Run a frontend dispatcher: clients connect with `gt.connect("HOST:PORT")` (or
    PARATRAIN_SERVER=HOST:PORT), workers with `paratrain worker --host HOST --port PORT`."""
    from paratrain.frontend.dispatcher.dispatcher import CannotServe
    from paratrain.frontend.dispatcher.serve import serve as run
    from paratrain.frontend.dispatcher.settings import DispatcherSettings

    try:
        settings = DispatcherSettings(host, port, workers, token, instruction_log, client_timeout, worker_timeout,
                                      max_message_mb, max_tensor_mb, quiet)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    try:
        status = run(settings, local_workers=local_workers, threads=threads, exit_with_pid=exit_with_pid)
    except (CannotServe, OSError) as error:
        raise click.ClickException(str(error)) from None
    raise SystemExit(status)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="The dispatcher's address.")
@click.option("--port", default=29700, show_default=True, type=PORT, help="The dispatcher's port.")
@click.option("--token", **_TOKEN)
@click.option("--threads", type=click.IntRange(1), default=None, help="Torch threads for this worker.")
@click.option("--connect-timeout", default=120.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds to wait for the dispatcher to answer before giving up.")
@click.option("--exit-with-pid", type=int, default=None, hidden=True)
def worker(host, port, token, threads, connect_timeout, exit_with_pid):
    """Serve a dispatcher as one worker (one device). Start as many as `serve --workers` says;
    under torchrun the workers' world is torchrun's, else the dispatcher forms it.

    Compilation follows GT's variables (GT_AUTO_COMPILE, GT_HOTPATH_*, GT_DEBUG_COMPILE,
    GT_SAVE_COMPILED_CODE, or their PARATRAIN_ names), read once here."""
    from paratrain.frontend.errors import FrontendError
    from paratrain.frontend.protocol.addresses import AddressError
    from paratrain.frontend.workers.settings import CompileSettings, SettingsError
    from paratrain.frontend.workers.worker import DeviceUnavailable, run_worker
    from paratrain.launch import in_torchrun, init_process_group_from_env

    try:
        compile_settings = CompileSettings.from_env()
    except SettingsError as error:
        raise click.UsageError(str(error)) from None
    group = init_process_group_from_env() if in_torchrun() else None
    try:
        run_worker(f"{host}:{port}", token, group=group, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   threads=threads, connect_timeout=connect_timeout, exit_with_pid=exit_with_pid,
                   compile_settings=compile_settings)
    except (AddressError, FrontendError, DeviceUnavailable) as error:
        raise click.ClickException(str(error)) from None


@click.command()
@click.option("--server", envvar="PARATRAIN_SERVER", default="127.0.0.1:29700", show_default=True,
              help="The dispatcher, HOST:PORT [PARATRAIN_SERVER].")
@click.option("--token", **_TOKEN)
@click.option("--interval", default=1.0, show_default=True, help="Seconds between updates.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
def top(server, token, interval, once):
    """Live view of a dispatcher: per worker operations/s, busy %, queue depth and memory held;
    per client instructions and tensors."""
    from paratrain.frontend.errors import FrontendError
    from paratrain.frontend.protocol.addresses import AddressError
    from paratrain.frontend.top import run_top

    try:
        run_top(server, token, interval, once)
    except (AddressError, FrontendError) as error:
        raise click.ClickException(str(error)) from None


@click.group()
def frontend():
    """Tools for the single-controller frontend."""


@frontend.command()
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", default="frontend_trace.json", show_default=True, help="Chrome trace to write.")
def trace(log, output):
    """Turn an instruction log into a Chrome trace (open it at ui.perfetto.dev): one track per
    worker, one slice per instruction."""
    from paratrain.frontend.trace import write_chrome_trace

    count = write_chrome_trace(log, output)
    click.echo(f"wrote {count} instructions to {output}")


@frontend.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--workers", type=click.IntRange(1), default=None,
              help="Check against this many workers (default: as many as the file names).")
def explain(config, workers):
    """Print what a signal configuration (GT's YAML schema) does: per signal its workers and
    layout, and the worker layout drawn as stages x tensor-parallel ranks."""
    from paratrain.frontend import signals
    from paratrain.frontend.explain import describe, draw

    try:
        parsed = signals.parse(signals.load(config), workers)
    except signals.ConfigError as error:
        for problem in error.problems:
            click.echo(f"error: {problem}", err=True)
        raise SystemExit(2) from None
    for line in describe(parsed) + draw(parsed):
        click.echo(line)
