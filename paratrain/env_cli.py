"""`paratrain env`: every setting, its value and where it came from; the algorithm table and
whether a world would use it; the transport each kind of world gets on this host."""

from __future__ import annotations

import click

from paratrain.comm import native
from paratrain.launch import LAUNCHERS, algorithm_table, expected_transport
from paratrain.environment import SPECS, Settings, SettingsError

# Variables click reads itself, as the defaults of options (`paratrain serve --token`, ...).
OPTION_VARIABLES = (
    ("PARATRAIN_TOKEN", "serve, worker --token"),
    ("PARATRAIN_SERVER", "top, frontend --server"),
    ("PARATRAIN_INSTRUCTION_LOG / GT_INSTRUCTION_LOG", "serve --instruction-log"),
    ("PARATRAIN_AUTO_SHARD / GT_AUTO_SHARD", "serve --auto-shard"),
    ("PARATRAIN_AUTO_SHARD_MIN_BYTES", "serve --auto-shard-min-bytes"),
)

_TRANSPORTS = {
    "fabric": "ranks as threads of this process; p2p a tensor copy",
    "shm": "processes of this host; messages through /dev/shm rings, the backend's collectives through gloo",
    "gloo": "torch.distributed's gloo: messages through sockets",
    "nccl": "torch.distributed's NCCL: one GPU per rank",
}


def setting_lines(settings: Settings) -> list[str]:
    rows = []
    for spec in SPECS:
        value = getattr(settings, spec.name)
        if spec.name == "host" and value is None:
            value = settings.host_name  # the machine's: what the ranks here will say
        shown = "(set)" if spec.secret and value else ("-" if value is None else str(value))
        rows.append((spec.name, shown, settings.source(spec.name), " / ".join(spec.variables), spec.meaning))
    width = max(len(row[1]) for row in rows)
    lines = [f"# {'setting':<19} {'value':<{width}}  {'source':<32} {'variable'}"]
    for name, shown, source, variables, meaning in rows:
        lines.append(f"  {name:<19} {shown:<{width}}  {source:<32} {variables}: {meaning}")
    return lines


@click.command("env")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True,
              help="The world size the algorithm table and the transports are judged for.")
def env(nproc: int) -> None:
    """Print every setting (value and source: default, environment or flag), the algorithm table
    `algo="auto"` would use (the file, and whether it is in use for a world of --nproc ranks),
    and the transport each launcher gives a world here.

    Settings are read once when a run starts (paratrain/environment.py); a flag such as `train
    --timeout` overrides its variable for that run.
    """
    try:
        settings = Settings.resolve()
    except SettingsError as error:
        raise click.UsageError(str(error)) from None
    lines = ["# paratrain env: the settings a run started here would take", *setting_lines(settings), ""]
    named = "named by PARATRAIN_ALGO_TABLE" if settings.algo_table else "the cache's (XDG_CACHE_HOME)"
    try:
        status = algorithm_table(settings, nproc).status
    except ValueError as error:
        status = str(error)
    lines += [f"# algorithm table for algo='auto' (file: {named})",
              f"  path     {settings.table_path}",
              f"  world {nproc}: {status}", ""]
    lines.append(f"# transport of a world of {nproc} ranks (and of its subgroups, the mesh's axes, of 2 ranks or more)")
    for launcher in LAUNCHERS:
        kind = expected_transport(launcher, nproc, settings)
        lines.append(f"  --launcher {launcher:<10} {kind:<6} {_TRANSPORTS[kind]}")
    if settings.shm and settings.native:  # loading builds the kernels on first use, as a world's setup would
        lines.append(f"  shared segment: {native.load(settings.cache_dir, settings.cc)[1]}")
    elif settings.shm:
        lines.append("  shared segment: torch's ops (native kernels off: PARATRAIN_NATIVE)")
    where = settings.launch
    if where.in_torchrun:
        lines.append(f"  this process (torchrun): rank {where.rank} of {where.world_size}, "
                     f"{expected_transport('processes', where.world_size, settings)}")
    lines += ["", "# read by the options they are the defaults of"]
    lines += [f"  {variable:<48} {option}" for variable, option in OPTION_VARIABLES]
    click.echo("\n".join(lines))
