"""`paratrain bench moe --ep 1,2,4`: what expert parallelism costs a training step, and what it sends.

One mixture-of-experts model trains on the same world (`--nproc` data-parallel ranks) at each
expert-parallel size. At ep 1 every rank holds every expert; at ep N each MoE layer's experts
are cut over groups of N ranks and a token travels by all-to-all to the ranks holding the
experts it chose, once per rank, not once per expert (parallel/expert/dispatch.py). Per ep:

- step time: each step's slowest rank, the median over the steps after the first; tokens/s; the
  ratio to ep 1;
- exposed communication: the data-parallel strategy's (train/report.py) plus expert
  parallelism's own collectives (the all-to-alls and the experts' gradient all-reduce), which run
  on the training thread, so all of their time is exposed;
- rows dispatched, counted from each layer's dispatcher's `sent` record: rows to other ranks
  (their bytes cross the wire), all rows (a rank's rows to itself are a local copy), per token,
  beside the expectation for uniform routing (`plan.moe.rows_per_token`) and the k rows per token
  of once-per-expert dispatch. Real routing is not uniform: the counted figure is the measurement;
- the load imbalance from the log entries: max / mean tokens per expert, and per ep rank.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import click

from paratrain.bench.simulated_hosts import hosts_words
from paratrain.data import rank_batch
from paratrain.plan.moe import rows_per_token as uniform_rows_per_token  # the planner's formula, one place
from paratrain.environment import Settings
from paratrain.launch import run
from paratrain.models import model_config
from paratrain.models.moe import moe_layers
from paratrain.models.moe_llama import MoEConfig
from paratrain.parallel.expert.apply import ExpertParallelDispatcher
from paratrain.train.config import TrainConfig
from paratrain.train.loop import start
from paratrain.train.options import validated_config
from paratrain.train.report import tokens_per_sample

UNTIMED_STEPS = 1  # the first step allocates and warms up


class CommClock:
    """Seconds spent in the collectives of groups wrapped by `TimedGroup` since the last `take`."""

    def __init__(self):
        self.seconds = 0.0

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class TimedGroup:
    """A process group whose blocking collectives add their time to a clock; all else is the group's."""

    def __init__(self, group, clock: CommClock):
        self._group, self._clock = group, clock

    def __getattr__(self, name):
        return getattr(self._group, name)

    def _timed(self, collective, *args, **kwargs):
        started = time.perf_counter()
        try:
            return collective(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - started

    def all_to_all(self, *args, **kwargs):
        return self._timed(self._group.all_to_all, *args, **kwargs)

    def all_reduce(self, *args, **kwargs):
        return self._timed(self._group.all_reduce, *args, **kwargs)


@dataclasses.dataclass
class RankStep:
    """One rank's step: its times, and what its MoE layers dispatched (all layers, all forward
    calls). The dispatch fields are None at ep 1, where nothing is dispatched."""

    step: int
    step_ms: float
    exposed_ms: float  # the strategy's exposed communication + ep_comm_ms
    ep_comm_ms: float  # expert parallelism's all-to-alls and expert-gradient all-reduce
    tokens: int  # tokens through the MoE layers, summed over layers
    rows_to: list[int] | None  # rows sent to each rank of the ep group (the dispatcher's splits)
    rows_to_others: int | None
    choices: int | None  # kept (token, expert) pairs the rows carried
    bytes_to_others: int | None  # rows_to_others x d_model x element size
    bytes_all: int | None  # every row's, this rank's own included


class DispatchLedger:
    """Each MoE layer's forward calls (tokens and row bytes, by a forward pre-hook) beside its
    dispatcher's `sent` record, one entry per call in both; `take` sums a step's and empties both."""

    def __init__(self, layers):
        self.layers = layers
        self.calls = {id(layer): [] for layer in layers}
        for layer in layers:
            layer.register_forward_pre_hook(self._seen)

    def _seen(self, layer, args) -> None:
        x_BTD = args[0]
        self.calls[id(layer)].append((x_BTD.shape[0] * x_BTD.shape[1], x_BTD.shape[-1] * x_BTD.element_size()))

    def take(self) -> dict:
        """This step's RankStep dispatch fields, summed over layers and forward calls."""
        tokens, rows_to, others, choices, bytes_to_others, bytes_all = 0, None, 0, 0, 0, 0
        for layer in self.layers:
            calls, dispatcher = self.calls[id(layer)], layer.dispatcher
            tokens += sum(n for n, _ in calls)
            if isinstance(dispatcher, ExpertParallelDispatcher):
                if len(dispatcher.sent) != len(calls):
                    raise RuntimeError(f"{len(calls)} forward calls but {len(dispatcher.sent)} dispatches recorded")
                rows_to = rows_to or [0] * dispatcher.group.size
                for (_, row_bytes), counts in zip(calls, dispatcher.sent):
                    rows_to = [a + b for a, b in zip(rows_to, counts.rows_to)]
                    mine = counts.rows - counts.rows_to[dispatcher.group.rank]
                    others, choices = others + mine, choices + counts.choices
                    bytes_to_others, bytes_all = bytes_to_others + mine * row_bytes, bytes_all + counts.rows * row_bytes
                dispatcher.sent.clear()
            calls.clear()
        if rows_to is None:  # ep 1: nothing dispatched
            return {"tokens": tokens, **dict.fromkeys(("rows_to", "rows_to_others", "choices", "bytes_to_others",
                                                       "bytes_all"))}
        return {"tokens": tokens, "rows_to": rows_to, "rows_to_others": others, "choices": choices,
                "bytes_to_others": bytes_to_others, "bytes_all": bytes_all}


def ep_rank(group, config: TrainConfig) -> dict:
    """Rank function: train `config`, recording each step's times, dispatches and expert load."""
    trainer = start(group, config)
    job = trainer.job
    layers = moe_layers(job.module)
    ledger, clock = DispatchLedger(layers), CommClock()
    for layer in layers:
        if isinstance(layer.dispatcher, ExpertParallelDispatcher):
            layer.dispatcher.group = TimedGroup(layer.dispatcher.group, clock)
    if job.mesh.ep is not None:  # at ep 1 the strategy reduces the experts' gradients, and times it
        job.experts.edp = TimedGroup(job.experts.edp, clock)
    log, steps = [], []
    for step in range(trainer.first_step, config.steps):
        inputs, targets = rank_batch(trainer.dataset, step, config.data.global_batch, job.mesh.dp.rank, job.mesh.dp.size)
        clock.take()
        entry = trainer.step(step, inputs, targets)
        ep_ms = clock.take() * 1e3
        log.append(entry)
        steps.append(RankStep(step=step, step_ms=entry["step_ms"], exposed_ms=entry["exposed_comm_ms"] + ep_ms,
                              ep_comm_ms=ep_ms, **ledger.take()))
    trainer.finish(log, return_state=False)
    loads = [{key: entry[key] for key in ("step", "expert_tokens", "dropped_pairs", "expert_imbalance",
                                          "ep_rank_imbalance")} for entry in log]
    return {"steps": [dataclasses.asdict(s) for s in steps], "loads": loads,
            "tokens_per_sample": tokens_per_sample(trainer.dataset)}


def _median_of_slowest(runs: list[list[list[dict]]], key: str) -> float:
    """Each timed step's largest value over ranks, then the median over the steps of every run."""
    return statistics.median(max(steps[i][key] for steps in per_rank)
                             for per_rank in runs for i in range(UNTIMED_STEPS, len(per_rank[0])))


def dispatch_figures(per_rank: list[list[dict]], experts: int, top_k: int, ep: int) -> dict:
    """Rows per token counted over every rank and step, beside the uniform-routing formula and
    once-per-expert dispatch (k rows per token); bytes per rank and step, the mean over both."""
    formula = uniform_rows_per_token(experts, top_k, ep)
    figures = {"once_per_expert_rows_per_token": top_k, "uniform_rows_per_token": formula,
               "uniform_saving": 1 - formula / top_k if ep > 1 else None}
    records = [s for steps in per_rank for s in steps]
    if records[0]["rows_to"] is None:
        return figures | {"rows_per_token": None, "rows_to_others_per_token": None, "saving": None,
                          "bytes_to_others_per_rank_step": 0, "bytes_per_rank_step": 0}
    tokens = sum(s["tokens"] for s in records)
    rows = sum(sum(s["rows_to"]) for s in records)
    return figures | {
        "rows_per_token": rows / tokens, "rows_to_others_per_token": sum(s["rows_to_others"] for s in records) / tokens,
        "saving": 1 - rows / tokens / top_k,
        "bytes_to_others_per_rank_step": statistics.fmean(s["bytes_to_others"] for s in records),
        "bytes_per_rank_step": statistics.fmean(s["bytes_all"] for s in records)}


def train_once(config: TrainConfig, round_: int) -> dict:
    """One world trained at `config`'s ep: every rank's steps (tagged with round, ep and rank) and
    the loads of the log (summed over the data ranks: rank 0's are every rank's)."""
    results = run(ep_rank, config.parallel.nproc, launcher=config.parallel.launcher, args=(config,),
                  timeout=config.parallel.timeout, simulate_hosts=config.parallel.simulate_hosts)
    tags = {"round": round_, "ep": config.parallel.ep}
    return {"per_rank": [[{**tags, "rank": r, **s} for s in results[r]["steps"]] for r in sorted(results)],
            "loads": [{**tags, **e} for e in results[0]["loads"]], "tokens_per_sample": results[0]["tokens_per_sample"]}


def ep_row(config: TrainConfig, runs: list[dict], experts: int, top_k: int) -> dict:
    """One ep's figures over its runs (rounds): times as medians of every timed step, dispatches
    over every step, imbalance as means over the timed steps."""
    per_rank_runs = [r["per_rank"] for r in runs]
    step_ms = _median_of_slowest(per_rank_runs, "step_ms")
    timed_loads = [e for r in runs for e in r["loads"][UNTIMED_STEPS:]]
    return {"ep": config.parallel.ep, "world": config.parallel.nproc, "step_ms": step_ms,
            "exposed_ms": _median_of_slowest(per_rank_runs, "exposed_ms"),
            "ep_comm_ms": _median_of_slowest(per_rank_runs, "ep_comm_ms"),
            "tokens_per_s": config.data.global_batch * runs[0]["tokens_per_sample"] / (step_ms / 1e3),
            "expert_imbalance": statistics.fmean(e["expert_imbalance"] for e in timed_loads),
            "ep_rank_imbalance": statistics.fmean(e["ep_rank_imbalance"] for e in timed_loads),
            "dropped_pairs": sum(e["dropped_pairs"] for r in runs for e in r["loads"]),
            **dispatch_figures([steps for r in runs for steps in r["per_rank"]], experts, top_k, config.parallel.ep)}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's step time over ep 1's (None without an ep 1 row)."""
    base = next((r["step_ms"] for r in rows if r["ep"] == 1), None)
    return [r | {"vs_ep1": r["step_ms"] / base if base else None} for r in rows]


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_lines(rows: list[dict]) -> list[str]:
    """Two tables: the step's times and the experts' load, then what each rank dispatched."""
    lines = [f"# {'ep':>3} {'step ms':>8} {'exposed ms':>10} {'ep comm ms':>10} {'tokens/s':>9} {'vs ep 1':>7} "
             f"{'expert max/mean':>15} {'ep-rank max/mean':>16}"]
    lines += [f"  {r['ep']:>3} {r['step_ms']:>8.1f} {r['exposed_ms']:>10.1f} {r['ep_comm_ms']:>10.1f} "
              f"{r['tokens_per_s']:>9,.0f} {_or_dash(r['vs_ep1'], '.2f'):>7} {r['expert_imbalance']:>15.2f} "
              f"{r['ep_rank_imbalance']:>16.2f}" for r in rows]
    lines += [f"# {'ep':>3} {'rows/token':>10} {'to others':>9} {'uniform':>7} {'per expert':>10} {'saving':>6} "
              f"{'uniform':>7} {'KiB out':>8} {'KiB all':>8}"]
    lines += [f"  {r['ep']:>3} {_or_dash(r['rows_per_token'], '.3f'):>10} "
              f"{_or_dash(r['rows_to_others_per_token'], '.3f'):>9} {r['uniform_rows_per_token']:>7.3f} "
              f"{r['once_per_expert_rows_per_token']:>10} {_or_dash(r['saving'], '.0%'):>6} "
              f"{_or_dash(r['uniform_saving'], '.0%'):>7} {r['bytes_to_others_per_rank_step'] / 1024:>8.1f} "
              f"{r['bytes_per_rank_step'] / 1024:>8.1f}" for r in rows]
    return lines + [
        "# step ms, exposed ms: each step's slowest rank, median over the steps after the first (every round); exposed: the "
        "strategy's exposed communication + ep comm (all-to-alls and the experts' gradient all-reduce, blocking)",
        "# expert max/mean: tokens per expert, worst layer; ep-rank max/mean: tokens per ep rank; means over "
        "the steps after the first",
        "# rows/token: counted from the dispatchers (to others: rows leaving the rank); uniform: "
        "ep·(1 − C(E−L, k)/C(E, k)), the expectation if routing were uniform (it is not); per expert: k rows, "
        "once-per-expert dispatch; saving: 1 − rows/token / k; at ep 1 nothing is dispatched",
        "# KiB out / all: the forward dispatch per rank and step, all MoE layers: rows to other ranks / all rows "
        "x d_model x element size (the combine returns as many; backward sends both again)"]


def markdown_lines(record: dict) -> list[str]:
    """The results page's section (bench/results_page.py) from the JSON `--json` writes."""
    args = record["args"]
    hosts = hosts_words(args.get("simulate_hosts", 0))  # absent from records written before the option
    head = (f"{args['model']} ({args['experts']} experts, top-{args['top_k']}) on {args['nproc']} ranks "
            f"({args['launcher']}{hosts}), global batch {args['global_batch']}, {args['steps']} steps, "
            f"{args['rounds']} rounds "
            "(the eps in turn in each). *step* and "
            "*exposed*: each step's slowest rank, the median over every round's steps after the first; exposed: the "
            "data-parallel strategy's exposed communication plus expert parallelism's all-to-alls and expert-"
            "gradient all-reduce (blocking). *rows/token*: counted from the dispatchers over every rank and step; "
            "*uniform*: ep·(1 − C(E−L, k)/C(E, k)), what uniform routing would need (real routing is not "
            "uniform); *saving*: against once-per-expert dispatch, k rows per token. *KiB out*: the forward "
            "dispatch per rank and step, rows to other ranks x d_model x element size, all MoE layers. "
            "*max/mean*: tokens per expert (worst layer) and per ep rank.")
    header = ["ep", "step ms", "exposed ms", "ep comm ms", "tokens/s", "vs ep 1", "rows/token", "uniform",
              "saving", "uniform saving", "KiB out", "expert max/mean", "ep-rank max/mean"]
    lines = [head, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in record["rows"]:
        cells = [str(r["ep"]), f"{r['step_ms']:.1f}", f"{r['exposed_ms']:.1f}", f"{r['ep_comm_ms']:.1f}",
                 f"{r['tokens_per_s']:,.0f}", _or_dash(r["vs_ep1"], ".2f"), _or_dash(r["rows_per_token"], ".3f"),
                 f"{r['uniform_rows_per_token']:.3f}", _or_dash(r["saving"], ".0%"), _or_dash(r["uniform_saving"], ".0%"),
                 f"{r['bytes_to_others_per_rank_step'] / 1024:.1f}", f"{r['expert_imbalance']:.2f}",
                 f"{r['ep_rank_imbalance']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def ep_config(model: str, nproc: int, ep: int, options: dict) -> TrainConfig:
    """The training configuration of one ep: synthetic data, no evaluation, checkpoints or log lines."""
    flags = {"model": model, "nproc": nproc, "ep": ep, "steps": options["steps"],
             "global_batch": options["global_batch"], "launcher": options["launcher"], "seed": options["seed"],
             "simulate_hosts": options["simulate_hosts"], "eval_every": 0, "log_every": 10**9}
    config, _ = validated_config(None, flags, Settings.resolve())
    return config


def expert_shape(model: str) -> tuple[int, int]:
    """(experts, top-k) of an MoE model; a model without experts is refused."""
    shape = model_config(model)
    if not isinstance(shape, MoEConfig):
        raise click.UsageError(f"--model {model} has no mixture-of-experts layers (try moe-tiny or moe-small)")
    return shape.n_experts, shape.top_k


def ep_sweep(model: str, nproc: int, eps: list[int], options: dict) -> dict:
    """Train `model` on `nproc` ranks at each ep, the eps in turn in each round (so that a spell of
    load on the machine reaches all of them); the rows, every rank's steps and the loads."""
    experts, top_k = expert_shape(model)
    configs = [ep_config(model, nproc, ep, options) for ep in eps]  # every refusal before any run
    runs = {ep: [] for ep in eps}
    for round_ in range(options["rounds"]):
        for config in configs:
            click.echo(f"# round {round_ + 1}/{options['rounds']}, ep {config.parallel.ep}: {model} on {nproc} "
                       f"ranks ({options['launcher']}{hosts_words(config.parallel.simulate_hosts)}), "
                       f"{options['steps']} steps ...", err=True)
            runs[config.parallel.ep].append(train_once(config, round_))
    rows = [ep_row(config, runs[config.parallel.ep], experts, top_k) for config in configs]
    every = [run_ for ep in eps for run_ in runs[ep]]
    return {"rows": with_ratios(rows), "steps": [s for r in every for steps in r["per_rank"] for s in steps],
            "loads": [e for r in every for e in r["loads"]],
            "args": {"model": model, "nproc": nproc, "eps": eps, "experts": experts, "top_k": top_k, **options}}
