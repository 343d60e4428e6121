"""`paratrain bench moe`: the routed experts of a mixture-of-experts layer, forward and backward.

The same experts module (models/moe_experts.py) on the same rows, three ways:
- grouped: one `grouped_mm` per weight over all experts, on the CPU the experts in chunks of
  about equal rows, one per thread (the layer's default, models/moe_grouped.py);
- loop: one matrix multiply per expert and weight (the layer's reference and fallback);
- padded: every expert's rows padded to the busiest expert's count, one batched multiply per
  weight over (E, most rows, D): the capacity-style layout, shown for comparison.

The rows per expert are uneven, as routing makes them: expert shares drawn from a Dirichlet
(`--skew`, its concentration: lower is more uneven), fixed by the seed. Each repeat runs the
methods in turn, so a machine's load reaches all of them alike; the table gives each method's
median and the loop's time over the others'. The machine's load average is printed with it.

With `--ep 1,2,4` it measures expert parallelism in training instead (bench/moe_ep.py): step
time, exposed communication, tokens/s and the bytes each rank dispatches, at each ep.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import click
import torch
import torch.nn.functional as F

from paratrain.bench.moe_ep import ep_sweep, table_lines as ep_table_lines
from paratrain.bench.simulated_hosts import checked_hosts, simulate_hosts_option
from paratrain.cli_types import OutputPath
from paratrain.models.moe_experts import GroupedExperts

METHODS = ("grouped", "loop", "padded")
# Options of one part only: giving one to the other part is refused, not ignored.
MATMUL_ONLY = ("expert_counts", "tokens", "top_k", "d_model", "d_expert", "skew", "methods", "repeats", "warmup")
EP_ONLY = ("model", "nproc", "steps", "rounds", "global_batch", "launcher", "simulate_hosts")


def uneven_counts(n_experts: int, rows: int, skew: float) -> torch.Tensor:
    """Rows per expert, summing to `rows`: each row's expert drawn from Dirichlet(skew) shares
    (torch's global RNG: seed it)."""
    shares_E = torch.distributions.Dirichlet(torch.full((n_experts,), skew)).sample()
    experts_S = torch.multinomial(shares_E, rows, replacement=True)
    return torch.bincount(experts_S, minlength=n_experts)


def padded_experts(experts: GroupedExperts, tokens_SD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
    """The experts through (E, most rows, D) batched multiplies, rows padded with zeros."""
    e, most = counts_e.numel(), int(counts_e.max())
    starts_e = torch.cumsum(counts_e, 0) - counts_e
    expert_S = torch.repeat_interleave(torch.arange(e), counts_e)
    slot_S = torch.arange(tokens_SD.shape[0]) - starts_e[expert_S]
    padded_eCD = tokens_SD.new_zeros(e, most, tokens_SD.shape[1]).index_put((expert_S, slot_S), tokens_SD)
    hidden_eCF = F.silu(torch.bmm(padded_eCD, experts.w1)) * torch.bmm(padded_eCD, experts.w3)
    return torch.bmm(hidden_eCF, experts.w2)[expert_S, slot_S]


def _run(method: str, experts: GroupedExperts, tokens_SD: torch.Tensor, counts_e: torch.Tensor) -> float:
    """Seconds for one forward and backward."""
    compute = {"grouped": experts.compute_grouped, "loop": experts.compute_loop}.get(method)
    experts.zero_grad(set_to_none=True)
    started = time.perf_counter()
    out_SD = compute(tokens_SD, counts_e) if compute else padded_experts(experts, tokens_SD, counts_e)
    out_SD.backward(torch.ones_like(out_SD))
    return time.perf_counter() - started


def time_experts(n_experts: int, args: dict) -> list[dict]:
    """One row per method at this many experts."""
    torch.manual_seed(args["seed"])
    experts = GroupedExperts(args["d_model"], args["d_expert"], n_experts)
    for weight in experts.parameters():
        torch.nn.init.normal_(weight, std=0.02)
    rows = args["tokens"] * args["top_k"]
    counts_e = uneven_counts(n_experts, rows, args["skew"])
    tokens_SD = torch.randn(rows, args["d_model"], requires_grad=True)
    if not experts.grouped_fits(tokens_SD):
        raise click.UsageError(f"grouped_mm does not take d_model {args['d_model']} / d_expert {args['d_expert']} "
                               "in fp32 (each must be a multiple of 4)")
    seconds = {m: [] for m in args["methods"]}
    for repeat in range(args["warmup"] + args["repeats"]):
        for method in args["methods"]:
            took = _run(method, experts, tokens_SD, counts_e)
            if repeat >= args["warmup"]:
                seconds[method].append(took)
    load = (counts_e.max() * n_experts / rows).item()
    return [{"experts": n_experts, "rows": rows, "busiest_over_mean": load, "method": m,
             "median_ms": statistics.median(s) * 1e3, "min_ms": min(s) * 1e3} for m, s in seconds.items()]


def table_lines(rows: list[dict]) -> list[str]:
    lines = [f"# {'experts':>7} {'rows':>7} {'busiest/mean':>12} {'method':>8} {'median ms':>10} {'min ms':>9} "
             f"{'loop / this':>11}"]
    loop = {r["experts"]: r["median_ms"] for r in rows if r["method"] == "loop"}
    for r in rows:
        ratio = f"{loop[r['experts']] / r['median_ms']:.2f}" if r["experts"] in loop else "-"
        lines.append(f"  {r['experts']:>7} {r['rows']:>7} {r['busiest_over_mean']:>12.2f} {r['method']:>8} "
                     f"{r['median_ms']:>10.1f} {r['min_ms']:>9.1f} {ratio:>11}")
    return lines


def _sizes(ctx, param, text: str | None) -> list[int] | None:
    """A comma-separated list of positive integers (a click callback)."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"positive integers, got {text!r}")
    return values


def _refuse_mixed(ctx: click.Context, ep: bool) -> None:
    """An option of the part not running is a mistake worth one line, not a silent no-op."""
    wrong = [name for name in (MATMUL_ONLY if ep else EP_ONLY)
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    if wrong:
        flag = next(p for p in ctx.command.params if p.name == wrong[0]).opts[0]
        raise click.UsageError(f"{flag} is for {'the matmul part (no --ep)' if ep else '--ep'}")


def _write_json(path: str, record: dict, count: int) -> None:
    with open(path, "w") as out:
        json.dump(record, out, indent=1)
    click.echo(f"# wrote {count} rows to {path}")


@click.command("moe")
@click.option("--experts", "expert_counts", type=click.IntRange(min=1), multiple=True, default=(8, 64),
              show_default=True, help="Experts (repeat the option for more than one).")
@click.option("--tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Tokens in the batch; each goes to top-k experts.")
@click.option("--top-k", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--d-model", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--d-expert", type=click.IntRange(min=1), default=512, show_default=True, help="Each expert's hidden width.")
@click.option("--skew", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Dirichlet concentration of the experts' shares of the rows: lower is more uneven.")
@click.option("--methods", type=click.Choice(METHODS), multiple=True, default=METHODS, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=9, show_default=True, help="Timed repeats per method.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed first repeats.")
@click.option("--ep", "eps", callback=_sizes, help="Comma-separated expert-parallel sizes, e.g. 1,2,4: train --model at each "
              "instead of timing the experts' matmuls (each must divide --nproc and the experts).")
@click.option("--model", default="moe-tiny", show_default=True, help="With --ep: the MoE model trained.")
@click.option("--nproc", type=click.IntRange(min=1), default=4, show_default=True,
              help="With --ep: ranks, the same world at every ep (data parallel).")
@click.option("--steps", type=click.IntRange(min=2), default=6, show_default=True,
              help="With --ep: training steps per ep; the first is not timed.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --ep: rounds, each training every ep in turn (load on the machine reaches them alike).")
@click.option("--global-batch", type=click.IntRange(min=1), default=32, show_default=True,
              help="With --ep: sequences per step over all ranks.")
@click.option("--launcher", type=click.Choice(["processes", "threads"]), default="processes", show_default=True,
              help="With --ep: the ranks as gloo processes, or threads of this process.")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: torch's own).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=OutputPath(), help="Write the rows as JSON here.")
@simulate_hosts_option("With --ep: play N hosts on this machine (processes launcher), nproc/N consecutive ranks "
                       "each: the all-to-alls of an ep group that spans hosts cross them through gloo.")
@click.pass_context
def moe(ctx, expert_counts, tokens, top_k, d_model, d_expert, skew, methods, repeats, warmup, eps, model, nproc,
        steps, rounds, global_batch, launcher, threads, seed, json_path, simulate_hosts):
    """Routed experts (forward + backward), fp32 on the CPU: one grouped_mm per weight, a loop
    over the experts, and padded batched multiplies, on the same uneven rows.

    With --ep SIZES: expert parallelism in training instead. --model trains on --nproc ranks at
    each ep; per ep: step time, exposed communication, tokens/s and the ratio to ep 1; the rows
    and bytes each rank dispatches per step, counted, beside the uniform-routing expectation and
    once-per-expert dispatch; and the tokens' imbalance over experts and ep ranks.

    \b
    Examples:
      paratrain bench moe --experts 8 --experts 64
      paratrain bench moe --ep 1,2,4 --nproc 4 --model moe-tiny
      paratrain bench moe --ep 1,2,4 --nproc 4 --simulate-hosts 2
    """
    _refuse_mixed(ctx, eps is not None)
    if threads:
        torch.set_num_threads(threads)
    if eps is not None:
        hosts = checked_hosts(simulate_hosts, launcher, [nproc])
        record = ep_sweep(model, nproc, eps, {"steps": steps, "rounds": rounds, "global_batch": global_batch,
                                              "launcher": launcher, "seed": seed, "simulate_hosts": hosts})
        for line in ep_table_lines(record["rows"]):
            click.echo(line)
        if json_path:
            _write_json(json_path, record, len(record["rows"]))
        return
    args = {"tokens": tokens, "top_k": top_k, "d_model": d_model, "d_expert": d_expert, "skew": skew,
            "methods": list(dict.fromkeys(methods)), "repeats": repeats, "warmup": warmup, "seed": seed,
            "threads": torch.get_num_threads()}
    load_before = os.getloadavg()[0]
    rows = [row for n in expert_counts for row in time_experts(n, args)]
    load_after = os.getloadavg()[0]
    for line in table_lines(rows):
        click.echo(line)
    click.echo(f"# {args['threads']} torch thread(s), {os.cpu_count()} CPU(s); load average {load_before:.2f} "
               f"before, {load_after:.2f} after (the methods run in turn in each repeat, so load changes reach "
               "all of them)")
    if json_path:
        _write_json(json_path, {"rows": rows, "args": args, "load_average": [load_before, load_after]}, len(rows))
