"""docs/results.md, generated: run a set of benchmark sweeps, keep their JSON, render the page.

    python -m paratrain.bench.results_page            # run every sweep (minutes)
    python -m paratrain.bench.results_page --render   # only rewrite the page from the JSON already there
    python -m paratrain.bench.results_page --only cp  # run one sweep again, then rewrite the page

`make results` runs the first. Each sweep is one `paratrain bench ... --json FILE` command; the
page states the date, the machine, every command exactly, and turns each JSON file into a table.
Nothing on the page is written by hand, so a figure on it always has the command that made it
beside it. The sweeps are small on purpose: representative of each benchmark, not exhaustive
(each benchmark's --help says how to run a larger one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from paratrain.bench.moe_ep import markdown_lines
from paratrain.bench.results_sweeps import SWEEPS, Sweep
from paratrain.parallel.context.layout import LAYOUTS, attention_work
from paratrain.plan.membw import copy_bandwidth_gbps
from paratrain.provenance import code_commit, utc_now
from paratrain.environment import child_environment
from paratrain.train.matrix import render as render_matrix

RUN_FILE = "run.json"  # the machine, the date and each command's wall time, written by `run_sweeps`


SWEEP_TIMEOUT_S = 300  # one sweep that hangs must not hold `make results` forever


def command(sweep: Sweep, folder: Path) -> list[str]:
    args = ["paratrain", "bench", sweep.bench, *sweep.args, "--json", str(folder / f"{sweep.name}.json")]
    return args + (["--plot", str(folder / f"{sweep.name}.png")] if sweep.plot else [])


def command_line(sweep: Sweep, folder: Path) -> str:
    """The command as a person would type it (environment first)."""
    return " ".join([f"{key}={value}" for key, value in sweep.env] + [shlex.quote(a) for a in command(sweep, folder)])


def describe_machine() -> dict:
    return {
        "date": utc_now(),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "copy_gbps": copy_bandwidth_gbps("cpu"), "commit": code_commit(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_sweeps(folder: Path, sweeps=SWEEPS, merge: bool = False) -> dict:
    """Run the sweeps (from the repository root: the commands name paths relative to it). With
    `merge` (--only), their entries, dated, replace theirs in the run record already there."""
    folder.mkdir(parents=True, exist_ok=True)
    run = json.loads((folder / RUN_FILE).read_text()) if merge else \
        {"machine": describe_machine(), "load_before": os.getloadavg()[0], "sweeps": []}
    started = time.perf_counter()
    # `auto` reads the algorithm table a user may have tuned; the page shows the built-in defaults.
    with tempfile.TemporaryDirectory(prefix="paratrain-results-") as empty:
        for sweep in sweeps:
            print(f"== {command_line(sweep, folder)}", flush=True)
            env = child_environment(PARATRAIN_ALGO_TABLE=str(Path(empty) / "no-table.json"), **dict(sweep.env))
            argv = [sys.executable, "-m", *command(sweep, folder)]  # "-m paratrain bench ..."
            began, load_before = time.perf_counter(), os.getloadavg()[0]
            try:
                status = subprocess.run(argv, env=env, timeout=SWEEP_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                status = f"timed out after {SWEEP_TIMEOUT_S} s"
            entry = {"name": sweep.name, "command": command_line(sweep, folder),
                     "seconds": time.perf_counter() - began, "status": status}
            entry.update({"date": utc_now(), "commit": code_commit(), "load": [load_before, os.getloadavg()[0]]}
                         if merge else {})
            run["sweeps"] = [e for e in run["sweeps"] if e["name"] != sweep.name] + [entry]
    if not merge:  # the page's total time and load are the full run's
        run.update(seconds=time.perf_counter() - started, load_after=os.getloadavg()[0])
    (folder / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
    return run


# ---- rendering: one function per benchmark, records in, Markdown lines out ----

def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _size(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _algo(record: dict) -> str:
    return "auto" if record["algo"].startswith("auto") else record["algo"]


def _time_and_busbw(record: dict | None) -> str:
    if record is None:
        return "-"
    busbw = record["busbw_gbps"]
    time_us = record["time_us"]
    shown = f"{time_us:.0f}" if time_us >= 100 else f"{time_us:.3g}"  # small calls keep a tenth of a us
    shown += f" ({busbw:.2f})" if busbw is not None else ""
    if record.get("crossed_bytes") is not None:  # a world of several hosts: what crossed between them
        shown += f" [{'~' if record['crossed_modelled'] else ''}{record['crossed_bytes'] / 2**20:.2f}]"
    return shown


def render_collectives(records: list[dict]) -> list[str]:
    """Per op: each algorithm's time at each size, and auto's pick with its speed against native."""
    lines = []
    first = records[0]
    has_auto = any(r["algo"].startswith("auto") for r in records)
    lines.append(f"{first['world_size']} ranks, launcher {first['launcher']}, transport "
                 f"{first.get('transport', '?')}, {first['dtype']}. Time per call in us (slowest rank; "
                 "bus bandwidth in GB/s in brackets)"
                 + ("; *auto ran*: the algorithm `auto` picked; *vs native* = native's time / auto's" if has_auto
                    else "")
                 + ("; in square brackets the MiB one call sent between hosts, all ranks together (~: partly "
                    "modelled, for gloo's own collectives, whose messages we cannot see)"
                    if any(r.get("crossed_bytes") is not None for r in records) else "")
                 + ("; *mpi*: MPICH through mpi4py in the same run (the median of rounds alternating with ours), "
                    "*auto / MPI* = our time / MPI's, below 1 ours is faster." if any(r["algo"] == "mpi" for r in records)
                    else "."))
    for op in dict.fromkeys(r["op"] for r in records):
        rows = [r for r in records if r["op"] == op]
        algos = list(dict.fromkeys(_algo(r) for r in rows))
        table = []
        for nbytes in dict.fromkeys(r["bytes"] for r in rows):
            at = {_algo(r): r for r in rows if r["bytes"] == nbytes}
            cells = [_time_and_busbw(at.get(algo)) for algo in algos]
            if "auto" in at:
                cells.append(at["auto"]["algo"][5:-1])  # "auto(ring)" ran the ring
            if "auto" in at and "native" in at:
                cells.append(f"{at['native']['time_us'] / at['auto']['time_us']:.2f}x")
            if "auto" in at and "mpi" in at:
                cells.append(f"{at['auto']['time_us'] / at['mpi']['time_us']:.2f}x")
            table.append(["-" if op == "barrier" else _size(nbytes), *cells])
        extra = (["auto ran"] if "auto" in algos else []) + (["vs native"] if {"auto", "native"} <= set(algos) else [])
        extra += ["auto / MPI"] if {"auto", "mpi"} <= set(algos) else []
        lines += ["", f"**{op}**", ""] + _table(["size (B)", *algos, *extra], table)
    wrong = sum(r["wrong"] for r in records)
    return lines + ["", f"Wrong elements: {wrong}."]


def render_p2p(records: list[dict]) -> list[str]:
    """Per size: medians over links of a message's round (message and 1-byte ack), one-way and
    two-way bandwidth, and the all-to-all's bandwidth per rank."""
    def median(test: str, nbytes: int, key: str, digits: int) -> str:
        values = sorted(r[key] for r in records if r["test"] == test and r["bytes"] == nbytes)
        return f"{values[len(values) // 2]:.{digits}f}" if values else "-"
    sizes = sorted({r["bytes"] for r in records})
    rows = [[_size(n), median("uni", n, "time_us", 1), median("uni", n, "gbps", 3), median("bi", n, "gbps", 3),
             median("all_to_all", n, "gbps", 3)] for n in sizes]
    first = records[0]
    latency = sorted(r["time_us"] / 2 for r in records if r["test"] == "uni" and r["bytes"] == sizes[0])
    return [f"{first['world_size']} ranks, launcher {first['launcher']}, transport: {first['transport']}. "
            f"Latency (half the round at {sizes[0]} B): {latency[len(latency) // 2]:.1f} us. Medians over links.",
            ""] + _table(["size (B)", "round (us)", "one way (GB/s)", "both ways (GB/s)",
                          "all-to-all (GB/s per rank)"], rows)


def render_ddp(records: list[dict]) -> list[str]:
    first = records[0]
    def ratio(value):
        return f"{value:.2f}x" if value else "-"
    rows = [[r["model"], f"{r['params']:,}", r["mode"], f"{_ms(r['step_ms'])} ± {_ms(r['step_ms_stdev'])}",
             ratio(r.get("ratio_to_torch")), ratio(r.get("ratio_to_ddp")), _ms(r["comm_ms"]),
             _ms(r["exposed_comm_ms"]), f"{r['comm_share']:.0%}"] for r in records]
    return [f"{first['world_size']} ranks ({first['launcher']}), {first['batch_per_rank']} samples per rank, "
            f"{first['steps']} timed steps, median of {first['repeats']} runs. *vs torch* = step time / "
            "PyTorch's (DDP for naive and ddp, DDP + ZeroRedundancyOptimizer for zero1 and zero2, FSDP2's fully_shard for "
            "fsdp); *vs ddp* = step time / our DDP's; below 1 is faster. PyTorch's FSDP2 collectives are not "
            "timed (0).", ""] + _table(
        ["model", "parameters", "mode", "step ms", "vs torch", "vs ddp", "comm ms", "exposed comm ms", "comm share"], rows)


def render_scaling(records: list[dict]) -> list[str]:
    rows = [[r["mode"], str(r["world_size"]), str(r["batch_per_rank"]), str(r["global_batch"]),
             f"{_ms(r['iter_ms'])} ± {_ms(r['iter_ms_stdev'])}", f"{r['samples_per_s']:,.0f}",
             f"{r['speedup']:.2f}", f"{r['efficiency']:.2f}"] for r in records]
    first = records[0]
    return [f"Model {first['model']}, data parallelism {first['dp_mode']} ({first['launcher']}), "
            f"{first['cpu_count']} cores. Weak: batch per rank fixed; strong: global batch fixed.", ""] + _table(
        ["mode", "ranks", "batch per rank", "global batch", "step ms", "samples/s", "speedup", "efficiency"], rows)


def render_pipeline(records: list[dict]) -> list[str]:
    def pct(value):
        return "-" if value is None else f"{value:.1%}"
    rows = [[r["impl"], r["schedule"], _ms(r["step_ms"]),
             f"{r['ratio_to_torch']:.2f}x" if r.get("ratio_to_torch") else "-",
             pct(r.get("bubble_measured")), pct(r.get("bubble_simulated")),
             pct(r.get("bubble_theoretical_costs")), pct(r.get("bubble_theoretical"))] for r in records]
    first = records[0]
    return [f"{first['stages']} stages, {first['microbatches']} microbatches; medians over the timed steps. "
            "Bubble: *measured* over the step's makespan; *simulated* with the run's own stage times and free "
            "communication; *F:B:W* equal stages at the run's mean costs; *theory* equal stages, B = 2F.", ""] + _table(
        ["implementation", "schedule", "step ms", "vs torch", "bubble measured", "simulated", "F:B:W", "theory"], rows)


def render_tp(records: list[dict]) -> list[str]:
    rows = [[str(r["tp"]), _ms(r["ours_ms"]), _ms(r["torch_ms"]), f"{r['ratio']:.2f}x", f"{r['max_loss_diff']:.1e}"]
            for r in records]
    first = records[0]
    return [f"Model {first['model']}, global batch {first['global_batch']}, {first['steps']} steps "
            f"({first['warmup']} untimed), median of {first['rounds']} alternating rounds.", ""] + _table(
        ["tp", "ours ms", "PyTorch ms", "ours / PyTorch", "max loss difference"], rows)


def render_frontend(records: list[dict]) -> list[str]:
    rows = [[f"{r['batch']} x {r['hidden']}", _ms(r["frontend_ms"]), _ms(r["torch_ms"]), f"{r['ratio']:.2f}x"]
            for r in records]
    first = records[0]
    return [f"A two-layer MLP's training step, {first['workers']} worker. One streamed instruction: "
            f"{first['streamed_instruction_us']:.0f} us; one round trip: {first['round_trip_ms']:.2f} ms.", ""] + _table(
        ["batch x hidden", "frontend ms", "PyTorch ms", "ratio"], rows)


def render_cp(record: dict) -> list[str]:
    rows, args = record["rows"], record["args"]
    alone = {r["seq"]: r["step_ms"] for r in rows if r["cp"] == 1}
    table = [[str(r["cp"]), str(r["seq"]), r["method"], r["layout"], _ms(r["step_ms"]), _ms(r["exposed_ms"]),
              f"{r['exposed_ms'] / r['step_ms']:.0%}", f"{r['step_ms'] / alone[r['seq']]:.2f}" if r["seq"] in alone else "-"]
             for r in rows]
    cps = sorted({r["cp"] for r in rows if r["cp"] > 1})
    balance = [f"{layout} {max(w) / (sum(w) / len(w)):.2f}" for layout in LAYOUTS
               for w in [[attention_work(rank, cps[-1], args["seqs"][-1], layout) for rank in range(cps[-1])]]] if cps else []
    head = [f"Attention forward and backward, batch {args['batch']}, {args['heads']} query and {args['kv_heads']} "
            f"key/value heads of {args['head_dim']}, causal; median of {args['steps']} steps, the slowest rank's. "
            "Exposed: the time a rank waited on a transfer or a collective."]
    if balance:
        head.append(f"Largest rank's attention work over the mean at cp {cps[-1]}: {', '.join(balance)}.")
    if record.get("torch_context_parallel"):
        head.append(f"PyTorch's context_parallel on the same processes: {record['torch_context_parallel']}")
    return [" ".join(head), ""] + _table(
        ["cp", "sequence", "method", "layout", "step ms", "exposed ms", "exposed", "vs cp 1"], table)


def render_expert_matmuls(record: dict) -> list[str]:
    """bench moe without --ep: the routed experts' forward and backward, grouped against the loop."""
    args = record["args"]
    head = (f"Routed SwiGLU experts, forward and backward in fp32: {args['tokens']} tokens x top-{args['top_k']} rows, "
            f"d_model {args['d_model']}, d_expert {args['d_expert']}, rows per expert uneven (Dirichlet "
            f"concentration {args['skew']}), {args['threads']} torch threads; median of {args['repeats']} repeats, "
            "the methods in turn in each. *grouped*: one `grouped_mm` per weight over every expert, the experts in "
            "chunks of about equal rows, one per thread (the layer's default); *loop*: one matmul per expert and weight; *padded*: every expert padded to the busiest "
            "one's rows, one batched matmul per weight.")
    loop = {r["experts"]: r["median_ms"] for r in record["rows"] if r["method"] == "loop"}
    rows = [[str(r["experts"]), str(r["rows"]), f"{r['busiest_over_mean']:.2f}", r["method"], f"{r['median_ms']:.1f}",
             f"{loop[r['experts']] / r['median_ms']:.2f}" if r["experts"] in loop else "-"] for r in record["rows"]]
    return [head, ""] + _table(["experts", "rows", "busiest / mean", "method", "median ms", "loop / this"], rows)


def render_moe(record: dict) -> list[str]:
    """bench moe writes one of two records: training at each ep (--ep), or the experts' matmuls."""
    return markdown_lines(record) if "eps" in record["args"] else render_expert_matmuls(record)


RENDERERS = {
    "collectives": render_collectives, "p2p": render_p2p, "ddp": render_ddp, "scaling": render_scaling,
    "pipeline": render_pipeline, "tp": render_tp, "frontend": render_frontend, "cp": render_cp,
    "moe": render_moe,
}


def render(folder: Path, page: Path, sweeps=SWEEPS) -> str:
    """The whole page, from the run record and the sweeps' JSON in `folder`."""
    run = json.loads((folder / RUN_FILE).read_text())
    machine = run["machine"]
    link = os.path.relpath(folder, page.parent)
    lines = [
        "# Results", "",
        "<!-- Generated by `make results` (python -m paratrain.bench.results_page); do not edit by hand. -->", "",
        f"Measured {machine['date']}, code at commit {machine['commit'] or 'unknown'}.", "",
        f"- machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}"
        + (f", GPU {machine['cuda']}" if machine.get("cuda") else ", no GPU"),
        f"- software: Python {machine['python']}, torch {machine['torch']}",
        f"- memory copy bandwidth: {machine['copy_gbps']:.1f} GB/s (`dst.copy_(src)` of 256 MiB, best of 10): "
        "the ceiling for any transport on one host",
        f"- load average (1 min) before and after: {run['load_before']:.2f} and {run['load_after']:.2f}; "
        f"all sweeps together took {run['seconds']:.0f} s",
        "",
        "Each figure is one run of the command above its table. On a small shared machine two runs of the same "
        "command can differ by 1.5x at sizes under a few MiB: read ratios near 1 as \"the same\". Every command "
        "ran with `PARATRAIN_ALGO_TABLE` naming no file, so `auto` used its built-in choices, not a tuned table. "
        "Run `make results` to measure your own machine; [benchmarks.md](benchmarks.md) explains each benchmark.",
    ]
    ran = {entry["name"]: entry for entry in run["sweeps"]}
    for sweep in sweeps:
        entry = ran.get(sweep.name)
        lines += ["", f"## {sweep.title}", ""]
        if entry is None:
            lines.append("Not run.")
            continue
        lines += ["```", entry["command"], "```", ""]
        if "date" in entry:  # run on its own (--only), after the others
            lines += [f"Measured on its own {entry['date']}, code at commit {entry['commit'] or 'unknown'}; load "
                      f"average {entry['load'][0]:.2f} before, {entry['load'][1]:.2f} after.", ""]
        data = folder / f"{sweep.name}.json"
        if entry["status"] != 0:
            lines.append(f"Failed (exit status: {entry['status']}); see the command's output.")
            continue
        if not data.exists():
            lines.append(f"It wrote no {data.name}.")
            continue
        records = json.loads(data.read_text())
        lines += RENDERERS[sweep.bench](records)
        lines += ["", f"{entry['seconds']:.0f} s; records: [{sweep.name}.json]({link}/{sweep.name}.json)"]
        if sweep.plot and (folder / f"{sweep.name}.png").exists():
            lines += ["", f"![bus bandwidth against size]({link}/{sweep.name}.png)"]
    return "\n".join(lines + _matrix_section(folder, link)) + "\n"


MATRIX_FILE = "matrix.json"  # written by `make matrix` (paratrain matrix), which takes longer than the sweeps


def _matrix_section(folder: Path, link: str) -> list[str]:
    """The parity matrix, from its own run's JSON (not one of the sweeps above)."""
    path = folder / MATRIX_FILE
    lines = ["", "## The parity matrix: every model, data-parallel strategy and layout against one process", ""]
    if not path.exists():
        return lines + ["Not run: `make matrix` runs it."]
    run = json.loads(path.read_text())
    return lines + [f"Measured {run['date']}, code at commit {run['commit'] or 'unknown'}.", "", "```",
                    run["command"], "```", ""] + render_matrix(run["cells"]) + [
        "", f"{run['seconds']:.0f} s; records: [{MATRIX_FILE}]({link}/{MATRIX_FILE})"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("docs/results"), help="where the JSON goes")
    parser.add_argument("--page", type=Path, default=Path("docs/results.md"), help="the page to write")
    parser.add_argument("--render", action="store_true", help="only render the page from the JSON there")
    parser.add_argument("--only", action="append", choices=[s.name for s in SWEEPS], help="run only this sweep")
    options = parser.parse_args(argv)
    failed = []
    if not options.render:
        only = [s for s in SWEEPS if s.name in options.only] if options.only else SWEEPS
        run = run_sweeps(options.folder, only, merge=bool(options.only))
        failed = [e["name"] for e in run["sweeps"] if e["status"] != 0 and e["name"] in {s.name for s in only}]
    options.page.write_text(render(options.folder, options.page))
    print(f"wrote {options.page}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
