"""`paratrain bench p2p`: the book chapter's comprehensive bandwidth test for paratrain's ranks.

Matrices (row = sender, column = receiver) of unidirectional and bidirectional bandwidth at the
largest size and of latency at the smallest; links below --flag-below x the median are named;
the all-to-all aggregate per size; JSON and a heatmap on request.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import click

from paratrain.cli_types import FiniteFloat, OutputPath
from paratrain.bench.sweep_plan import ByteSize, sweep_sizes
from paratrain.bench.p2p import P2PSweep, run_p2p
from paratrain.bench import mpi_peer
from paratrain.bench.peer import p2p_lines, p2p_rounds
from paratrain.bench.report import describe_kind
from paratrain.bench.simulated_hosts import checked_hosts, simulate_hosts_option
from paratrain.launch import LAUNCHERS, in_torchrun, run


def matrix(records: list[dict], test: str, size: int, n: int, key: str = "gbps") -> list[list[float | None]]:
    """values[src][dst] of `test` at `size`; a bidirectional pair fills both of its cells."""
    values: list[list[float | None]] = [[None] * n for _ in range(n)]
    for r in records:
        if r["test"] == test and r["bytes"] == size:
            values[r["src"]][r["dst"]] = r[key]
            if test == "bi":
                values[r["dst"]][r["src"]] = r[key]
    return values


def slow_links(records: list[dict], size: int, fraction: float) -> list[tuple[str, int, int, float, float]]:
    """(test, src, dst, GB/s, median GB/s) of every link below `fraction` x its test's median."""
    flagged = []
    for test in ("uni", "bi"):
        rows = [r for r in records if r["test"] == test and r["bytes"] == size and r["gbps"]]
        if len(rows) < 2:
            continue
        median = statistics.median(r["gbps"] for r in rows)
        flagged += [(test, r["src"], r["dst"], r["gbps"], median) for r in rows if r["gbps"] < fraction * median]
    return flagged


def _matrix_lines(title: str, values, fmt: str) -> list[str]:
    n = len(values)
    lines = [f"# {title}", "  " + " " * 6 + "".join(f"{dst:>9}" for dst in range(n))]
    for src, row in enumerate(values):
        cells = "".join(f"{'-':>9}" if v is None else f"{v:>9{fmt}}" for v in row)
        lines.append(f"  {src:>4}  {cells}")
    return lines


def report_lines(records: list[dict], n: int, fraction: float) -> list[str]:
    sizes = sorted({r["bytes"] for r in records})
    big, small = sizes[-1], sizes[0]
    lines = _matrix_lines(f"unidirectional bandwidth (GB/s) at {big} B; row = sender, column = receiver",
                          matrix(records, "uni", big, n), ".2f")
    lines += _matrix_lines(f"bidirectional bandwidth (GB/s, both directions counted) at {big} B",
                           matrix(records, "bi", big, n), ".2f")
    lines += _matrix_lines(f"latency (us: half a {small}-byte round trip)", matrix(records, "uni", small, n, "latency_us"), ".1f")
    lines += ["# per size, over links: median (slowest)",
              f"# {'size (B)':>12}  {'round us':>9}  {'uni GB/s':>20}  {'bi GB/s':>20}  {'all-to-all GB/s/rank (aggregate)':>34}"]
    for size in sizes:
        cells = []
        for test in ("uni", "bi"):
            rows = [r for r in records if r["test"] == test and r["bytes"] == size and r["gbps"]]
            cells.append(f"{statistics.median(r['gbps'] for r in rows):>9.3f} ({min(r['gbps'] for r in rows):>8.3f})"
                         if rows else f"{'-':>20}")
        micros = [r["time_us"] for r in records if r["test"] == "uni" and r["bytes"] == size]
        a2a = next((r for r in records if r["test"] == "all_to_all" and r["bytes"] == size), None)
        a2a_text = f"{a2a['gbps']:.3f} ({a2a['aggregate_gbps']:.3f})" if a2a and a2a["gbps"] else "-"
        lines.append(f"  {size:>12}  {statistics.median(micros):>9.1f}  {cells[0]}  {cells[1]}  {a2a_text:>34}")
    flagged = slow_links(records, big, fraction)
    if flagged:
        lines.append(f"# SLOW LINKS (below {fraction:g} x the median at {big} B):")
        lines += [f"#   {test} {src} -> {dst}: {gbps:.3f} GB/s, median {median:.3f}" for test, src, dst, gbps, median in flagged]
    else:
        lines.append(f"# no link below {fraction:g} x the median at {big} B")
    return lines


def write_heatmap(path: Path, records: list[dict], n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    big = max(r["bytes"] for r in records)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, test, label in zip(axes, ("uni", "bi"), ("unidirectional", "bidirectional")):
        values = [[float("nan") if v is None else v for v in row] for row in matrix(records, test, big, n)]
        image = ax.imshow(values, cmap="viridis")
        for src in range(n):
            for dst in range(n):
                if values[src][dst] == values[src][dst]:  # not NaN
                    ax.text(dst, src, f"{values[src][dst]:.2f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.set_title(f"{label} GB/s at {big} B")
        ax.set_xlabel("receiver")
        ax.set_ylabel("sender")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


@click.command()
@click.option("--nproc", type=click.IntRange(min=2), default=2, show_default=True, help="Ranks (ignored under torchrun).")
@click.option("--launcher", type=click.Choice(LAUNCHERS), default="processes", show_default=True,
              help="processes: torch.distributed (gloo on CPU, NCCL on GPU); threads: the in-process fabric.")
@click.option("--min-bytes", type=ByteSize(), default="8", show_default=True, help="Smallest message (its time is the latency).")
@click.option("--max-bytes", type=ByteSize(), default="4M", show_default=True, help="Largest message.")
@click.option("--factor", type=click.IntRange(min=2), default=8, show_default=True, help="Each size is the previous one times this.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed messages first.")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Timed rounds per test (the median counts).")
@click.option("--flag-below", type=FiniteFloat(0, 1), default=0.8, show_default=True,
              help="Name links below this fraction of the median bandwidth.")
@click.option("--json", "json_path", type=OutputPath(path_type=Path),
              help="Write the records (test, src, dst, bytes, time_us, gbps, ...) to this file; with --peer, "
                   "also MPI's (transport mpi) and in every record rounds_us, each round's time.")
@click.option("--plot", "plot_path", type=OutputPath(path_type=Path),
              help="Draw the bandwidth matrices as heatmaps into this PNG file.")
@click.option("--timeout", type=FiniteFloat(min=0, min_open=True), help="Seconds one communication may block.")
@click.option("--peer", type=click.Choice(["mpi"]),
              help="Also run the tests through MPI (mpi4py, ranks started by mpiexec: pip install -e '.[mpi]'), "
                   "in rounds alternating with ours, and print ours / MPI per size.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --peer: rounds of each side, alternating (ours, the peer, ours, ...).")
@simulate_hosts_option("Play N hosts on this machine (processes launcher), nproc/N consecutive ranks each: pairs "
                       "inside a host talk through shared memory, pairs across hosts through gloo, as on a cluster.")
def p2p(nproc, launcher, min_bytes, max_bytes, factor, warmup, iters, flag_below, json_path, plot_path, timeout,
        peer, rounds, simulate_hosts):
    """Bandwidth and latency of every pair of ranks, one pair at a time, and the all-to-all aggregate.

    \b
    Examples:
      paratrain bench p2p --nproc 4 --max-bytes 16M --plot p2p.png
      torchrun --nproc-per-node 8 -m paratrain bench p2p --json p2p.json
      paratrain bench p2p --peer mpi --max-bytes 16M
      paratrain bench p2p --nproc 4 --simulate-hosts 2 --max-bytes 4M
    """
    if max_bytes < min_bytes:
        raise click.BadParameter(f"{max_bytes} is smaller than --min-bytes ({min_bytes})", param_hint="'--max-bytes'")
    if peer and in_torchrun():
        raise click.UsageError("--peer runs ranks of its own beside ours: it does not run under torchrun")
    if peer and simulate_hosts:
        raise click.UsageError("--peer mpi runs on one host as it is: it takes no --simulate-hosts")
    simulate_hosts = checked_hosts(simulate_hosts, launcher, [nproc])
    sweep = P2PSweep(tuple(s for s in sweep_sizes(min_bytes, max_bytes, factor) if s > 0), warmup, iters)

    def ours():
        results = run(run_p2p, nproc, launcher=launcher, args=(sweep,), timeout=timeout, simulate_hosts=simulate_hosts)
        if 0 not in results and not in_torchrun():
            raise click.ClickException("benchmark failed: rank 0 returned no measurements")
        return results.get(0)

    if peer:
        mpi_peer.mpiexec_command(nproc)  # the extra's one-line message, before any rank starts
        result, peer_records, library = p2p_rounds(rounds, ours, lambda: mpi_peer.run_p2p_peer(sweep, nproc))
    else:
        result, peer_records = ours(), []
    if result is None:  # under torchrun, a rank other than 0: rank 0's process prints
        return
    launched_by = "torchrun" if in_torchrun() else launcher
    click.echo(f"# paratrain bench p2p: world size {result.world_size}  launcher {launched_by}  transport "
               f"{describe_kind(result.transport)}  device {result.device}  warmup {warmup}  iters {iters}")
    lines = report_lines(result.records, result.world_size, flag_below)
    if peer:
        lines = [f"# note: peer: {library}, {rounds} rounds of each side alternating, every figure the median round",
                 *lines, *p2p_lines(result.records, peer_records, "MPI")]
    for line in lines:
        click.echo(line)
    if json_path:
        for record in result.records:
            record.update(launcher=launched_by, transport=result.transport, world_size=result.world_size)
        for record in peer_records:
            record.update(launcher="mpiexec", transport="mpi", world_size=result.world_size)
        json_path.write_text(json.dumps(result.records + peer_records, indent=1))
        click.echo(f"# wrote {len(result.records) + len(peer_records)} records to {json_path}")
    if plot_path:
        write_heatmap(plot_path, result.records, result.world_size)
        click.echo(f"# plotted to {plot_path}")
