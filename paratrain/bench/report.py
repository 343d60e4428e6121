"""How `paratrain bench collectives` shows its measurements: an nccl-tests table, JSON, a plot."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from paratrain.bench.collective_cases import ROOT, UNEVEN_OP, UNEVEN_RULE, uneven_splits
from paratrain.bench.collectives import REDUCING_OPS, ROOTED_OPS, Measurement

JSON_KEYS = (
    "op", "algo", "launcher", "transport", "world_size", "bytes", "count", "dtype",
    "time_us", "algbw_gbps", "busbw_gbps", "wrong",
)
_FACTOR_TEXT = {
    "all_reduce": "2(n-1)/n", "reduce_scatter": "(n-1)/n", "all_gather": "(n-1)/n",
    "all_to_all": "(n-1)/n", UNEVEN_OP: "(n-1)/n", "broadcast": "1", "reduce": "1",
}


@dataclass(frozen=True)
class RunInfo:
    """What the header states about the run, so a table read later still says where it came from."""

    world_size: int
    launcher: str
    transport: str
    device: str
    torch_version: str
    copy_gbps: float
    sweep: str  # the options that shaped the sweep, one line


def describe_kind(kind: str) -> str:
    """A transport as the headers name it."""
    return "shm (gloo's processes, every message through shared memory)" if kind == "shm" else kind


def header_lines(info: RunInfo) -> list[str]:
    return [
        f"# paratrain bench collectives: {info.sweep}",
        f"# world size {info.world_size}  launcher {info.launcher}  transport {describe_kind(info.transport)}"
        f"  device {info.device}  torch {info.torch_version}",
        f"# memory copy bandwidth {info.copy_gbps:.2f} GB/s (dst.copy_(src), best of a few):"
        " the physical ceiling for busbw on one host",
        "# time: per call on the slowest rank; each rank's figure is the median of interleaved bursts"
        " (the algorithms take turns, so machine noise falls on all alike)",
    ]


def table_lines(measurements: list[Measurement], world_size: int) -> list[str]:
    """One block per op. Rows come in the sweep's order, size then algorithm, so the algorithms
    at one size sit together."""
    lines = []
    by_op: dict[str, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_op[m.op].append(m)
    spans = any(m.crossed_bytes is not None for m in measurements)  # a world of several hosts
    crossed = (f"  {'crossed':>10}", f"  {'(B/call)':>10}") if spans else ("", "")
    for op, rows in by_op.items():
        factor = f"busbw = algbw x {_FACTOR_TEXT[op]}" if op in _FACTOR_TEXT else "time only"
        lines += [
            "#",
            f"# {op}  ({factor}, n = {world_size}; 'vs native' = native's time / this time)",
            f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>4}  {'algo':<12}"
            f"  {'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}  {'vs native':>9}{crossed[0]}",
            f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>4}  {'':<12}"
            f"  {'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}{'':>19}{crossed[1]}",
        ]
        native_time = {m.bytes: m.time_us for m in rows if m.algo == "native"}
        lines += [_row(m, native_time.get(m.bytes), spans) for m in rows]
    return lines


def _row(m: Measurement, native_time_us: float | None, spans: bool = False) -> str:
    redop = "sum" if m.op in REDUCING_OPS else "none"
    root = ROOT if m.op in ROOTED_OPS else -1
    relative = f"{native_time_us / m.time_us:.2f}x" if native_time_us else "-"
    # bytes between hosts; "~" where part of them is modelled (the backend's own collectives)
    crossed = "" if not spans else f"  {('~' if m.crossed_modelled else '') + str(m.crossed_bytes):>10}"
    return (
        f"  {m.bytes:>10}  {m.count:>12}  {m.dtype:>8}  {redop:>6}  {root:>4}  {m.label:<12}"
        f"  {_time(m.time_us):>8}  {_gbps(m.algbw_gbps):>7}  {_gbps(m.busbw_gbps):>7}"
        f"  {m.wrong:>6}  {relative:>9}{crossed}"
    )


def _time(us: float) -> str:
    # nccl-tests' rule: fewer decimals as the number grows, so the column keeps its width.
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _human_bytes(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_lines(measurements: list[Measurement]) -> list[str]:
    """nccl-tests' closing lines, per (op, algorithm): the mean busbw over the sweep's sizes."""
    lines = ["#"]
    busbw: dict[tuple[str, str], list[float]] = defaultdict(list)
    for m in measurements:
        if m.busbw_gbps is not None:
            busbw[(m.op, m.algo)].append(m.busbw_gbps)
    for (op, algo), values in busbw.items():
        lines.append(f"# Avg bus bandwidth    : {sum(values) / len(values):.4f} GB/s  {op} {algo}")
    wrong = sum(m.wrong for m in measurements)
    lines.append(f"# Wrong elements       : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return lines


def auto_lines(measurements: list[Measurement]) -> list[str]:
    """Per op measured with both `auto` and native: where auto ran another algorithm, how it
    did against native; where it kept native, it made the very same call, so the spread of
    those ratios is what this run's noise alone does to two identical calls."""
    lines = []
    by_op: dict[str, dict[str, dict[int, Measurement]]] = defaultdict(lambda: defaultdict(dict))
    for m in measurements:
        if m.algo in ("auto", "native"):
            by_op[m.op][m.algo][m.bytes] = m
    for op, rows in by_op.items():
        pairs = [(auto, rows["native"][size]) for size, auto in rows["auto"].items() if size in rows["native"]]
        if not pairs:
            continue
        picked = [native.time_us / auto.time_us for auto, native in pairs if auto.resolved != "native"]
        kept = [native.time_us / auto.time_us for auto, native in pairs if auto.resolved == "native"]
        text = f"# auto vs native, {op}: ran another algorithm at {len(picked)} of {len(pairs)} sizes"
        if picked:
            faster = sum(ratio >= 1 for ratio in picked)
            text += f", faster than native at {faster} of them ({_span(picked)})"
        if kept:
            text += f"; kept native at {len(kept)}: the same call, so their ratios ({_span(kept)}) are this run's noise"
        lines.append(text)
    return lines


HIER_FROM_BYTES = 1 << 20  # where the summary compares hier with the flat algorithms
_OURS_FLAT = ("ring", "hd", "tree", "direct")


def hosts_lines(measurements: list[Measurement]) -> list[str]:
    """In a world of several hosts, per op measured with hier, from HIER_FROM_BYTES up: hier's
    time over gloo's own (native) and over the fastest of our flat algorithms at each size, and
    the bytes it sent between hosts over theirs."""
    lines = []
    by_op: dict[str, dict[int, dict[str, Measurement]]] = defaultdict(lambda: defaultdict(dict))
    for m in measurements:
        if m.bytes >= HIER_FROM_BYTES and m.crossed_bytes is not None:
            by_op[m.op][m.bytes][m.algo] = m
    for op, sizes in by_op.items():
        over_native, over_ours, bytes_native, bytes_ours = [], [], [], []
        for rows in sizes.values():
            hier = rows.get("hier")
            if hier is None:
                continue
            ours = min((rows[a] for a in _OURS_FLAT if a in rows), key=lambda m: m.time_us, default=None)
            for flat, times, volumes in ((rows.get("native"), over_native, bytes_native), (ours, over_ours, bytes_ours)):
                if flat is not None:
                    times.append(hier.time_us / flat.time_us)
                    if flat.crossed_bytes:
                        volumes.append(hier.crossed_bytes / flat.crossed_bytes)
        if over_native or over_ours:
            text = f"# hier, {op} from {_human_bytes(HIER_FROM_BYTES)}:"
            for name, times, volumes in (("gloo's own", over_native, bytes_native),
                                         ("our fastest flat", over_ours, bytes_ours)):
                if times:
                    text += f" time / {name} {_span(times)}"
                    text += f", bytes between hosts / its {_span(volumes)};" if volumes else ";"
            lines.append(text.rstrip(";"))
    return lines


def _span(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}x to {max(ratios):.2f}x"


def json_records(measurements: list[Measurement], launcher: str, world_size: int, transport: str) -> list[dict]:
    records = []
    for m in measurements:
        values = {
            "op": m.op, "algo": m.label, "launcher": launcher, "transport": transport, "world_size": world_size,
            "bytes": m.bytes, "count": m.count, "dtype": m.dtype, "time_us": m.time_us,
            "algbw_gbps": m.algbw_gbps, "busbw_gbps": m.busbw_gbps, "wrong": m.wrong,
        }
        record = {key: values[key] for key in JSON_KEYS}
        if m.op == UNEVEN_OP:  # the parts, as the rule made them for this size
            record.update(splits=uneven_splits(m.count, world_size), split_rule=UNEVEN_RULE)
        if m.rounds_us:  # with --peer
            record["rounds_us"] = list(m.rounds_us)
        if m.crossed_bytes is not None:  # a world of several hosts
            record.update(crossed_bytes=m.crossed_bytes, crossed_modelled=m.crossed_modelled)
        records.append(record)
    return records


def write_json(path: Path, measurements: list[Measurement], launcher: str, world_size: int, transport: str,
               peer: list[Measurement] = ()) -> None:
    """Our records, then the peer's (MPI's: launcher mpiexec, transport and algo "mpi")."""
    records = json_records(measurements, launcher, world_size, transport)
    records += json_records(list(peer), "mpiexec", world_size, "mpi")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n")


def write_plot(path: Path, measurements: list[Measurement], info: RunInfo) -> bool:
    """busbw against size, one subplot per op, one line per algorithm; False if nothing to plot
    (a barrier has no bandwidth)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    by_op: dict[str, dict[str, list[Measurement]]] = defaultdict(lambda: defaultdict(list))
    for m in measurements:
        if m.busbw_gbps is not None and m.bytes > 0:  # log x has no place for 0 bytes
            by_op[m.op][m.algo].append(m)
    if not by_op:
        return False
    fig, axes = plt.subplots(1, len(by_op), figsize=(5 * len(by_op), 4), squeeze=False)
    for ax, (op, by_algo) in zip(axes[0], by_op.items()):
        for algo, rows in by_algo.items():
            ax.plot([m.bytes for m in rows], [m.busbw_gbps for m in rows], marker="o", label=algo)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda nbytes, _: _human_bytes(int(nbytes)))
        ax.set_title(op)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    # The copy ceiling goes in the title, not on the axes: drawn there it would flatten the
    # algorithms' lines, which are what the plot is for.
    fig.suptitle(
        f"{info.transport} x{info.world_size} ({info.launcher}), {measurements[0].dtype};"
        f" memory copy {info.copy_gbps:.1f} GB/s"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return True
