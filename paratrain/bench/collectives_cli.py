"""`paratrain bench collectives`: nccl-tests for paratrain's collectives, ours beside the backend's.

All input is checked here (what the sweep measures, in sweep_plan.py), before any rank starts; the
ranks run `collectives.run_sweep`, rank 0 hands its measurements back, and only this process
prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click
import torch

from paratrain.cli_types import FiniteFloat, OutputPath
from paratrain.bench import report
from paratrain.bench.collective_cases import UNEVEN_OP, UNEVEN_RULE
from paratrain.bench.collectives import DTYPES, Sweep, element_counts, run_sweep
from paratrain.bench.explain import print_explain
from paratrain.plan.membw import copy_bandwidth_gbps
from paratrain.bench.overhead import overhead_lines, run_overhead
from paratrain.bench import mpi_peer
from paratrain.bench.peer import collectives_lines, side_by_side, sweep_rounds
from paratrain.bench.sweep_plan import SPLITS, ByteSize, bad_option, plan_sweep, sweep_sizes, with_splits
from paratrain.bench.tuning import tuned_choices
from paratrain.comm.algorithms import OPS
from paratrain.comm.choice import AlgorithmTable
from paratrain.launch import LAUNCHERS, algorithm_table, check_simulated_hosts, expected_transport, in_torchrun, run
from paratrain.environment import Settings


def _thread_devices(nproc: int):
    """One GPU per rank when there are enough; otherwise all ranks share the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc:
        return [f"cuda:{i}" for i in range(nproc)]
    return None


@click.command()
@click.option("--ops", metavar="LIST",
              help=f"Comma-separated ops to measure. [default: all: {','.join(OPS)}]")
@click.option("--algos", metavar="LIST",
              help="Comma-separated algorithms (ring, hd, tree, direct, native, auto; and on processes of "
                   "one host oneshot, twoshot, through a shared segment); each op runs those valid for it. "
                   "[default: all valid for each op]")
@click.option("--min-bytes", type=ByteSize(), default="1K", show_default=True,
              help="Smallest size: bytes of the per-rank buffer nccl-tests reports (all_gather: the "
                   "output, reduce_scatter: the input). Plain bytes or K/M/G, K=1024.")
@click.option("--max-bytes", type=ByteSize(), default="16M", show_default=True, help="Largest size.")
@click.option("--factor", type=click.IntRange(min=2), default=2, show_default=True,
              help="Each size is the previous one times this integer.")
@click.option("--nproc", type=click.IntRange(min=1), default=2, show_default=True,
              help="Number of ranks (ignored under torchrun, which sets the world).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="processes", show_default=True,
              help="processes: torch.distributed (gloo on CPU, NCCL on GPU); threads: the in-process fabric.")
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True,
              help="Untimed calls before timing each (op, algorithm, size).")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True,
              help="Timed calls, run in up to 10 bursts that the algorithms take turns at; time is the "
                   "median burst's per-call time on the slowest rank. With --overhead: rounds, one call of "
                   "ours and one of the bare replay each.")
@click.option("--dtype", type=click.Choice(tuple(DTYPES)), default="float32", show_default=True,
              help="Element type of the buffers.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path),
              help="Also write the measurements to this file: a list of records with keys "
                   + ", ".join(report.JSON_KEYS) + "; with --peer, also MPI's (algo mpi) and in every record"
                   " rounds_us, each round's time.")
@click.option("--plot", "plot_path", type=OutputPath(path_type=Path),
              help="Also draw busbw against size (one subplot per op) into this PNG file.")
@click.option("--tune", is_flag=True,
              help="Record per (transport, world size, op, size) the algorithm `auto` runs, in the table it "
                   "reads: the backend's own unless another was faster by more than the measured noise and "
                   "in 3 of 4 interleaved rounds. Measures every algorithm unless --algos is given.")
@click.option("--explain", is_flag=True,
              help="Print which algorithm `auto` picks for each op and size, and why. Measures nothing "
                   "unless --tune is also given (then it explains the new table).")
@click.option("--overhead", is_flag=True,
              help="Per algorithm and size, time our call beside a bare replay of the same transport calls "
                   "(torch.distributed's send/recv on processes, the fabric's on threads), one call at a time "
                   "and in bursts of back-to-back calls; and paratrain's own code per call, timed against a "
                   "transport that moves nothing (the 'path' column). [default ops: all_reduce]")
@click.option("--table", "table_path", type=click.Path(dir_okay=False, path_type=Path),
              show_default="$PARATRAIN_ALGO_TABLE or ~/.cache/paratrain/algorithms.json",
              help="The algorithm table --tune writes and `auto` reads. A table named (here or by "
                   "PARATRAIN_ALGO_TABLE) is used as it is; the cached one only where it was written on "
                   "this host for this world size.")
@click.option("--timeout", type=FiniteFloat(min=0, min_open=True),
              help="Seconds any one communication may block before it fails naming the rank and peer. "
                   "[default: $PARATRAIN_TIMEOUT or 300]")
@click.option("--debug", is_flag=True,
              help="Check before every collective that all ranks make the same call (slower), and show "
                   "full tracebacks.")
@click.option("--peer", type=click.Choice(["mpi"]),
              help="Also run the sweep through MPI (mpi4py, ranks started by mpiexec: pip install -e '.[mpi]'), "
                   "in rounds alternating with ours, and print ours / MPI per size. [default --algos: auto]")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --peer: rounds of each side, alternating (ours, the peer, ours, ...).")
@click.option("--simulate-hosts", type=click.IntRange(min=1), default=None, metavar="N",
              help="Play N hosts on this machine (processes launcher): each block of nproc/N consecutive ranks "
                   "gets a host name of its own (PARATRAIN_HOST), so they share memory only inside the block and "
                   "talk gloo between blocks. Adds hier, the hierarchical algorithms, and a column of the bytes "
                   "each call sent between hosts.")
@click.option("--splits", type=click.Choice(SPLITS), default="even", show_default=True,
              help=f"all_to_all in equal parts, in uneven ones (rows '{UNEVEN_OP}', with split sizes; with --peer, "
                   f"MPI's Alltoallv) or both. Uneven: {UNEVEN_RULE}. The JSON gives each size's parts.")
def collectives(ops, algos, min_bytes, max_bytes, factor, nproc, launcher, warmup, iters, dtype,
                json_path, plot_path, tune, explain, overhead, table_path, timeout, debug, peer, rounds,
                simulate_hosts, splits) -> None:
    """Measure collectives like nccl-tests: time, algbw, busbw and #wrong per op, algorithm, size.

    Our algorithms (ring, hd = halving-doubling, tree, direct) run beside the backend's own
    (native) and auto (the algorithm table's pick, shown as e.g. "auto(ring)"); 'vs native' is
    native's time over each row's time at the same size. busbw = algbw x 2(n-1)/n for
    all_reduce; (n-1)/n for reduce_scatter, all_gather, all_to_all; 1 for broadcast, reduce. The
    barrier reports time only (null bandwidths in JSON). Exits with 1 if any element is wrong.

    \b
    Examples:
      paratrain bench collectives --ops all_reduce --algos ring,native --max-bytes 1M
      paratrain bench collectives --tune
      paratrain bench collectives --explain --ops all_reduce,all_gather
      paratrain bench collectives --overhead --algos ring,hd,native --min-bytes 16K --max-bytes 1M
      paratrain bench collectives --peer mpi --ops all_reduce --min-bytes 16K --max-bytes 64M --factor 4
      paratrain bench collectives --nproc 4 --simulate-hosts 2 --ops all_reduce --min-bytes 1M
    """
    if max_bytes < min_bytes:
        raise bad_option("--max-bytes", f"{max_bytes} is smaller than --min-bytes ({min_bytes})")
    mode = _mode_of(tune, explain, overhead, peer, dtype, json_path, plot_path)
    if splits != "even" and mode not in ("sweep", "peer") or splits != "even" and tune:
        raise click.UsageError("--splits uneven or both measures; it takes no --tune, --explain or --overhead")
    if simulate_hosts and mode != "sweep":
        raise click.UsageError("--simulate-hosts measures a sweep: it takes no --tune, --explain, --overhead or --peer")
    request = _request(ops, algos, min_bytes, max_bytes, factor, nproc, launcher, warmup, iters, dtype,
                       json_path, plot_path, tune, explain, overhead, peer, table_path, timeout, debug, rounds,
                       splits, simulate_hosts or 0)
    MODES[mode](request)


@dataclass(frozen=True)
class Request:
    """What every mode reads: the command line, checked and resolved once."""

    plan: list[tuple[str, tuple[str, ...]]]  # (op, algorithms) pairs, as plan_sweep makes them
    notes: list[str]  # printed under the header
    counts: list[int]  # elements per size
    sizes: str  # the sizes as asked, for the header
    dtype: str
    warmup: int
    iters: int  # with --overhead: rounds
    table: AlgorithmTable
    nproc: int
    launcher: str
    settings: Settings
    world: int
    transport: str | None  # the transport the ranks will use, as far as it is known before they start
    json_path: Path | None
    plot_path: Path | None
    tune: bool
    explain: bool  # after measuring (with --tune); --explain alone is a mode of its own
    rounds: int  # with --peer
    simulate_hosts: int = 0  # hosts this machine plays (0: itself alone)


def _mode_of(tune, explain, overhead, peer, dtype, json_path, plot_path) -> str:
    """Which of MODES the flags ask for; a usage error where they ask for two at once."""
    if explain and not tune and (json_path or plot_path):
        raise click.UsageError("--json and --plot need measurements; --explain alone measures nothing")
    if overhead and (tune or explain or json_path or plot_path):
        raise click.UsageError("--overhead prints its own table: it takes no --tune, --explain, --json or --plot")
    if peer and (tune or explain or overhead or in_torchrun()):
        raise click.UsageError("--peer runs ranks of its own beside ours: it takes no --tune, --explain or"
                               " --overhead, and does not run under torchrun")
    if peer and dtype not in mpi_peer.DTYPES:
        raise bad_option("--dtype", f"--peer mpi measures {' or '.join(mpi_peer.DTYPES)}: MPI has no standard {dtype} type")
    if explain and not tune:
        return "explain"
    return "overhead" if overhead else "peer" if peer else "sweep"


def _request(ops, algos, min_bytes, max_bytes, factor, nproc, launcher, warmup, iters, dtype, json_path,
             plot_path, tune, explain, overhead, peer, table_path, timeout, debug, rounds, splits,
             simulate_hosts) -> Request:
    settings = Settings.resolve(timeout=timeout, debug=debug or None)
    try:
        check_simulated_hosts(simulate_hosts, nproc, launcher)
    except ValueError as error:
        raise bad_option("--simulate-hosts", str(error)) from None
    transport = expected_transport(launcher, nproc, settings, simulate_hosts)
    spans = simulate_hosts > 1 or settings.launch.in_torchrun and transport == "gloo"
    plan, notes = plan_sweep(ops or ("all_reduce" if overhead else None), algos or ("auto" if peer else None),
                             tune or overhead, transport, spans)
    if splits != "even" and not any(op == "all_to_all" for op, _ in plan):
        raise bad_option("--splits", "splits apply to all_to_all alone: add it to --ops")
    plan, split_notes = with_splits(plan, splits)
    notes += split_notes
    if table_path is not None:
        settings = settings.with_flags(algo_table=str(table_path))
    world = settings.launch.world_size if settings.launch.in_torchrun else nproc
    try:
        # tuning adds to the table as it is; measuring uses it only where `auto` would
        table = AlgorithmTable.load(settings.table_path) if tune else algorithm_table(settings, world)
    except ValueError as error:
        if not tune:
            raise bad_option("--table", str(error)) from None
        table = AlgorithmTable({}, settings.table_path)  # tuning writes a whole new table anyway
        notes.append(f"{error}: replacing it")
    counts = element_counts(sweep_sizes(min_bytes, max_bytes, factor), dtype)
    sizes = f"minBytes {min_bytes}  maxBytes {max_bytes}  step: {factor}(factor)"
    return Request(plan, notes, counts, sizes, dtype, warmup, iters, table, nproc, launcher, settings, world,
                   transport, json_path, plot_path, tune, explain, rounds, simulate_hosts)


def _explain(request: Request) -> None:
    """--explain alone: what auto would pick, measuring nothing."""
    print_explain(request.table, request.plan, request.counts, request.dtype, request.world, request.transport)


def _sweep(request: Request) -> None:
    """The sweep (with --tune, the table recorded from it; with --explain too, explained after)."""
    _report(request, _launch(_sweep_of(request), request.nproc, request.launcher, request.settings,
                             simulate_hosts=request.simulate_hosts), None)


def _sweep_beside_mpi(request: Request) -> None:
    """--peer mpi: the sweep in rounds alternating with MPI's, then ours / MPI per size."""
    sweep = _sweep_of(request)
    mpi_peer.mpiexec_command(request.nproc)  # the extra's one-line message, before any rank starts
    result, peer_rows, library = sweep_rounds(
        request.rounds, lambda: _launch(sweep, request.nproc, request.launcher, request.settings),
        lambda: mpi_peer.run_collectives(sweep, request.nproc))
    request.notes.append(f"peer: {library}, {request.rounds} rounds of each side alternating, "
                         "every figure the median round")
    _report(request, result, peer_rows)


def _sweep_of(request: Request) -> Sweep:
    return Sweep(tuple(request.plan), tuple(request.counts), request.dtype, request.warmup, request.iters,
                 request.table)


def _report(request: Request, result, peer_rows: list | None) -> None:
    """Print rank 0's measurements (beside the peer's, `peer_rows`, where there is one); write the JSON and the
    plot, record the tuned table and explain it as asked."""
    if result is None:  # under torchrun, a rank other than 0: rank 0's process prints
        return
    launched_by = "torchrun" if in_torchrun() else request.launcher
    device = result.device if result.device.startswith("cuda") else "cpu"
    info = report.RunInfo(
        result.world_size, launched_by, result.transport, result.device, torch.__version__,
        copy_bandwidth_gbps(device),
        f"ops {','.join(op for op, _ in request.plan)}  {request.sizes}"
        f"  warmup iters: {request.warmup}  iters: {request.iters}  dtype: {request.dtype}",
    )
    measurements = side_by_side(result.measurements, peer_rows) if peer_rows is not None else result.measurements
    lines = report.header_lines(info) + [f"# note: {note}" for note in request.notes]
    lines += report.table_lines(measurements, result.world_size) + report.summary_lines(measurements)
    lines += report.auto_lines(measurements) + report.hosts_lines(measurements)
    if peer_rows is not None:
        lines += collectives_lines(result.measurements, peer_rows, "MPI")
    click.echo("\n".join(lines))
    if request.json_path:
        report.write_json(request.json_path, result.measurements, launched_by, result.world_size, result.transport,
                          peer_rows or [])
        click.echo(f"# wrote {len(measurements)} records to {request.json_path}")
    if request.plot_path:
        drawn = report.write_plot(request.plot_path, measurements, info)
        click.echo(f"# plotted to {request.plot_path}" if drawn else "# nothing plotted: the barrier has no bandwidth")
    if request.tune:
        _record_tuned(request.table, measurements, result.transport, result.world_size)
        click.echo(f"# tuned: the algorithm auto runs per op and size for {result.transport} x{result.world_size}"
                   f" (native unless another beat it beyond the noise) saved to "
                   f"{request.table.save(request.settings.table_path)}")
        request.table.status = "in use (written now, on this host)"
    if request.explain:
        print_explain(request.table, request.plan, request.counts, request.dtype, result.world_size,
                       result.transport)
    if any(m.wrong for m in measurements):
        raise click.ClickException("some collectives returned wrong elements (see #wrong)")


def _overhead(request: Request) -> None:
    """--overhead: our call beside a bare replay of its transport calls, and our own code's time."""
    _print_overhead(request.plan, request.counts, request.dtype, request.warmup, request.iters, request.table,
                    request.nproc, request.launcher, request.settings, request.notes)


def _print_overhead(plan, counts, dtype, warmup, rounds, table, nproc, launcher, settings, notes) -> None:
    result = _launch(None, nproc, launcher, settings,
                     function=run_overhead_with_table, args=(table, plan, counts, dtype, warmup, rounds))
    if result is None:
        return
    kind, rows = result
    world = nproc if not in_torchrun() else "torchrun's"
    lines = [f"# paratrain bench collectives --overhead: world size {world}  launcher {launcher}"
             f"  transport {report.describe_kind(kind)}  dtype {dtype}  warmup {warmup}  rounds {rounds}"]
    lines += [f"# note: {note}" for note in notes]
    click.echo("\n".join(lines + overhead_lines(rows, rounds)))


def run_overhead_with_table(group, table, plan, counts, dtype, warmup, rounds):
    group.table = table  # auto resolves as it would in the sweep
    rows = run_overhead(group, plan, counts, dtype, warmup, rounds)
    return None if rows is None else (group.kind, rows)


def _launch(sweep: Sweep | None, nproc: int, launcher: str, settings: Settings,
            function=run_sweep, args: tuple | None = None, simulate_hosts: int = 0):
    """Run `function` (the sweep) on every rank; rank 0's result, or None in a process without rank 0."""
    devices = _thread_devices(nproc) if launcher == "threads" else None
    results = run(function, nproc, launcher=launcher, args=args or (sweep,), devices=devices,
                  settings=settings, simulate_hosts=simulate_hosts)
    if 0 not in results and not in_torchrun():
        raise click.ClickException("benchmark failed: rank 0 returned no measurements")
    return results.get(0)


def _record_tuned(table: AlgorithmTable, measurements, transport: str, world_size: int) -> None:
    """What auto runs at each measured size: native, unless another algorithm beat it beyond the
    noise (tuning.judge); each entry keeps the line that says why."""
    for (op, nbytes), verdict in tuned_choices(measurements).items():
        table.record(transport, world_size, op, nbytes, verdict.algo, verdict.why)


# One function per mode of `bench collectives`; _mode_of says which the flags ask for.
MODES = {
    "sweep": _sweep,
    "peer": _sweep_beside_mpi,
    "explain": _explain,
    "overhead": _overhead,
}
