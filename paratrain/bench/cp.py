"""`paratrain bench cp`: context-parallel attention, forward and backward, on cp processes.

For each context size, sequence length, method (ring, all-gather) and layout (zigzag,
contiguous): the step time (median over timed steps, the slowest rank's) and the communication it
could not hide (seconds a rank spent waiting on a transfer or in a collective, the slowest
rank's), beside cp 1 (the same attention on one rank, no communication). And, computed from the
layout, each rank's attention work (query-key pairs scored) so that the balance is visible.

PyTorch's own `context_parallel` (torch.distributed.tensor.experimental) is tried beside it on the
same processes; where it does not run (it needs a flash or efficient attention kernel, which CPU
builds may not offer), the error it gives is quoted.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch

from paratrain.bench.simulated_hosts import checked_hosts, hosts_words, simulate_hosts_option
from paratrain.cli_types import OutputPath
from paratrain.launch import run
from paratrain.parallel.context import LAYOUTS, METHODS, attention_work, context_attention
from paratrain.parallel.context.blocks import WaitClock


def _shape(args: dict, seq: int, cp: int) -> tuple:
    return args["batch"], args["heads"], seq // cp, args["head_dim"]


def _time_one(group, args: dict, seq: int, method: str, layout: str) -> dict:
    """Forward and backward of this rank's attention, `steps` times; its median and waits."""
    torch.manual_seed(group.rank)
    B, H, S, D = _shape(args, seq, group.size)
    q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = (torch.randn(B, args["kv_heads"], S, D, requires_grad=True) for _ in range(2))
    times, waits = [], []
    for step in range(args["warmup"] + args["steps"]):
        clock = WaitClock()
        group.barrier()
        started = time.perf_counter()
        out = context_attention(q, k, v, group, causal=True, layout=layout, method=method, clock=clock)
        out.sum().backward()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - started)
            waits.append(clock.seconds)
    return {"step_ms": statistics.median(times) * 1e3, "exposed_ms": statistics.median(waits) * 1e3}


def _torch_context_parallel(group, args: dict, seq: int) -> str:
    """PyTorch's context_parallel on the same shapes: its step time, or the error it gave."""
    try:
        import torch.nn.functional as F
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (group.size,))
        B, H, _, D = _shape(args, seq, 1)
        buffers = [torch.randn(B, H, seq, D) for _ in range(3)]  # it shards them in place: no grad
        started = time.perf_counter()
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            q, k, v = (b.detach().requires_grad_() for b in buffers)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return f"ran: {(time.perf_counter() - started) * 1e3:.1f} ms (one untimed-warmup step)"
    except Exception as error:  # what a user would meet, quoted
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def bench_rank(group, args: dict) -> dict:
    rows = []
    for seq in args["seqs"]:
        for method in args["methods"] if group.size > 1 else ["ring"]:
            for layout in args["layouts"] if group.size > 1 else ["contiguous"]:
                mine = _time_one(group, args, seq, method, layout)
                worst = {}
                for key, value in mine.items():
                    t = torch.tensor([value])
                    group.all_reduce(t, op="max")
                    worst[key] = t.item()
                rows.append({"cp": group.size, "seq": seq, "method": method, "layout": layout, **worst})
    torch_said = _torch_context_parallel(group, args, args["seqs"][0]) if group.size > 1 and args["torch"] else None
    return {"rows": rows, "torch": torch_said}


def balance_lines(cps: list[int], seq: int) -> list[str]:
    lines = [f"# attention work per rank (query-key pairs scored, causal, one head, sequence {seq})"]
    for cp in cps:
        if cp == 1:
            continue
        for layout in LAYOUTS:
            work = [attention_work(r, cp, seq, layout) for r in range(cp)]
            mean = sum(work) / cp
            lines.append(f"  cp {cp} {layout:<10} " + " ".join(f"{w:>10}" for w in work)
                         + f"   largest / mean {max(work) / mean:.2f}")
    return lines


def table_lines(rows: list[dict]) -> list[str]:
    alone = {r["seq"]: r["step_ms"] for r in rows if r["cp"] == 1}
    lines = [f"# {'cp':>3} {'seq':>6} {'method':>9} {'layout':>10} {'step ms':>9} {'exposed ms':>10} "
             f"{'exposed %':>9} {'vs cp 1':>8}"]
    for r in rows:
        ratio = f"{r['step_ms'] / alone[r['seq']]:.2f}" if r["seq"] in alone else "-"
        lines.append(f"  {r['cp']:>3} {r['seq']:>6} {r['method']:>9} {r['layout']:>10} {r['step_ms']:>9.1f} "
                     f"{r['exposed_ms']:>10.1f} {100 * r['exposed_ms'] / r['step_ms']:>8.0f}% {ratio:>8}")
    return lines


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of integers, got {text!r}", param_hint=name) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"positive integers, got {text!r}", param_hint=name)
    return values


def _names(text: str, valid, name: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [v for v in values if v not in valid]
    if not values or wrong:
        raise click.BadParameter(f"choose from {', '.join(valid)}, got {text!r}", param_hint=name)
    return values


@click.command("cp")
@click.option("--cp", "cps", default="1,2,4", show_default=True, help="Comma-separated context-parallel sizes.")
@click.option("--seq", "seqs", default="1024,2048", show_default=True,
              help="Comma-separated global sequence lengths (each must divide by 2·cp).")
@click.option("--methods", default="ring,allgather", show_default=True, help="ring, allgather, or both.")
@click.option("--layouts", default="zigzag,contiguous", show_default=True, help="zigzag, contiguous, or both.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="Query heads.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=2, show_default=True,
              help="Key/value heads (grouped-query attention; only these travel).")
@click.option("--head-dim", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True, help="Timed steps per row.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed first steps.")
@click.option("--torch/--no-torch", "try_torch", default=True, show_default=True,
              help="Try PyTorch's context_parallel on the same processes.")
@click.option("--launcher", type=click.Choice(["processes", "threads"]), default="processes", show_default=True,
              help="cp gloo processes, or cp threads of this process (the in-process fabric; no PyTorch peer).")
@click.option("--json", "json_path", type=OutputPath(), help="Write the rows as JSON here.")
@simulate_hosts_option("Play N hosts on this machine (processes launcher), cp/N consecutive ranks each (every cp "
                       "above 1 must divide by N; cp 1 runs alone): key/value blocks cross hosts through gloo.")
def cp(cps, seqs, methods, layouts, batch, heads, kv_heads, head_dim, steps, warmup, try_torch, launcher, json_path,
       simulate_hosts):
    """Context-parallel attention (forward + backward): step time and exposed communication for
    each cp, sequence length, method and layout, on cp ranks, and each rank's work."""
    cps, seqs = _ints(cps, "--cp"), _ints(seqs, "--seq")
    bad = [(s, c) for s in seqs for c in cps if s % (2 * c)]
    if bad:
        raise click.BadParameter(f"sequence {bad[0][0]} does not divide by 2·cp = {2 * bad[0][1]}", param_hint="--seq")
    if heads % kv_heads:
        raise click.BadParameter(f"{heads} query heads do not divide into {kv_heads}", param_hint="--kv-heads")
    hosts = checked_hosts(simulate_hosts, launcher, [size for size in cps if size > 1])  # cp 1: no peer to cross to
    args = {"seqs": seqs, "methods": _names(methods, METHODS, "--methods"), "layouts": _names(layouts, LAYOUTS, "--layouts"),
            "batch": batch, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "steps": steps,
            "warmup": warmup, "torch": try_torch and launcher == "processes", "simulate_hosts": hosts}
    rows, torch_said = [], None
    for size in cps:
        spread = hosts if size > 1 else 0
        click.echo(f"# cp {size}: {size} process(es){hosts_words(spread)} ...", err=True)
        result = run(bench_rank, size, launcher=launcher if size > 1 else "threads", args=(args,),
                     simulate_hosts=spread)[0]
        rows += result["rows"]
        torch_said = result["torch"] or torch_said
    for line in table_lines(rows) + balance_lines(cps, seqs[-1]):
        click.echo(line)
    if args["torch"] and torch_said:
        click.echo(f"# PyTorch's context_parallel on the same processes: {torch_said}")
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"rows": rows, "torch_context_parallel": torch_said, "args": args}, out, indent=1)
        click.echo(f"# wrote {len(rows)} rows to {json_path}")
