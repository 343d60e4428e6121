"""`paratrain bench tp`: our tensor-parallel GPT step beside PyTorch's own (DTensor).

Both start from the same seeded weights and train on the same batches with SGD, on one world of
gloo processes (every rank one tensor-parallel shard, no data parallelism):

- ours: `paratrain train --tp N` (paratrain/parallel/tensor: column/row-parallel layers, the
  vocabulary-parallel embedding and cross-entropy, our collectives);
- PyTorch's: the same GPT parallelized with `torch.distributed.tensor.parallel` in the plan
  torchtitan uses: ColwiseParallel for qkv and the MLP's up projection, RowwiseParallel for the
  output projections, the token embedding sharded by vocabulary (RowwiseParallel), the head
  column-parallel with `loss_parallel` (the logits are never gathered), as ours.

The fused qkv projection's rows are permuted for PyTorch's ColwiseParallel, which cuts a
weight into contiguous row blocks: after the permutation rank r's block is its heads' q, k and
v, which is what our head-aware split gives each rank. Same model, same math.

Losses are compared first (they must agree to float rounding), then the step times: medians
of the timed steps, the two implementations alternating round by round.
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch
import torch.nn.functional as F

from paratrain.bench.ddp import _quiet
from paratrain.bench.simulated_hosts import checked_hosts, hosts_words, simulate_hosts_option
from paratrain.cli_types import OutputPath
from paratrain.launch import run
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.setup import build_seeded_model, dataset_for

LOSS_RTOL = 1e-4  # float sums in another order over a few steps; a real difference is far larger


def bench_config(model: str, tp: int, batch: int, steps: int, n_layer: int | None, hosts: int = 0) -> TrainConfig:
    overrides = {"model.name": model, "parallel.tp": tp, "parallel.nproc": tp, "data.global_batch": batch,
                 "steps": steps, "optim.name": "sgd", "optim.lr": 0.1, "optim.schedule": "constant", "log_every": 10**9,
                 "parallel.launcher": "processes", "parallel.simulate_hosts": hosts}
    if n_layer:
        overrides["model.n_layer"] = n_layer
    return apply_overrides(TrainConfig(), overrides)


def _permute_qkv_for_contiguous_shards(linear: torch.nn.Linear, tp: int) -> None:
    """Reorder the rows [q | k | v] as [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (rank r's heads), so
    a contiguous split into tp blocks gives rank r exactly its heads' q, k and v."""
    d = linear.out_features // 3
    per_rank = d // tp
    order = torch.cat([torch.arange(part * d + r * per_rank, part * d + (r + 1) * per_rank)
                       for r in range(tp) for part in range(3)])
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def torch_tp_model(config: TrainConfig, tp: int):
    """The seeded GPT, parallelized with PyTorch's DTensor tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    mesh = init_device_mesh("cpu", (tp,))
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    }
    for i, block in enumerate(model.blocks):
        _permute_qkv_for_contiguous_shards(block.attn.qkv, tp)
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.up": ColwiseParallel(), f"blocks.{i}.mlp.down": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def torch_tp_rank(config: TrainConfig, tp: int, warmup: int) -> dict:
    """Train `config.steps` steps of PyTorch's version; losses and step times."""
    from torch.distributed.tensor.parallel import loss_parallel

    model = torch_tp_model(config, tp)
    dataset = dataset_for(config.model.name, config.model.overrides, None, config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.optim.lr, momentum=config.optim.momentum)
    losses, times = [], []
    for step in range(config.steps):
        inputs, targets = dataset.global_batch(step, config.data.global_batch)
        started = time.perf_counter()
        with loss_parallel():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return {"losses": losses, "step_ms": statistics.median(times[warmup:]) * 1e3}


def both_on_this_rank(group, config: TrainConfig, rounds: int, warmup: int) -> dict:
    """Alternate ours and PyTorch's, `rounds` times each; rank 0's view of the medians."""
    ours_ms, theirs_ms, ours_losses, theirs_losses = [], [], None, None
    for _ in range(rounds):
        with _quiet(group.rank == 0):  # the benchmark prints its own table
            result = train_rank(group, config)
        ours_losses = [entry["loss"] for entry in result["log"]]
        ours_ms.append(statistics.median(entry["step_ms"] for entry in result["log"][warmup:]))
        theirs = torch_tp_rank(config, group.size, warmup)
        theirs_losses = theirs["losses"]
        theirs_ms.append(theirs["step_ms"])
    return {"ours_ms": statistics.median(ours_ms), "torch_ms": statistics.median(theirs_ms),
            "ours_losses": ours_losses, "torch_losses": theirs_losses}


@click.command("tp")
@click.option("--nprocs", default="2,4", show_default=True, help="Comma-separated tensor-parallel sizes.")
@click.option("--model", default="gpt-tiny", show_default=True, help="A GPT preset.")
@click.option("--n-layer", type=click.IntRange(min=1), help="Override the preset's layers.")
@click.option("--global-batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--steps", type=click.IntRange(min=2), default=12, show_default=True, help="Steps per run.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True, help="Untimed first steps.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Runs of each implementation, alternating; the median is reported.")
@click.option("--json", "json_path", type=OutputPath(),
              help="Also write one record per size: model, tp, global_batch, steps, warmup, rounds, "
                   "ours_ms, torch_ms, ratio, simulate_hosts, max_loss_diff.")
@simulate_hosts_option("Play N hosts on this machine, size/N consecutive ranks each (every size must divide by N): "
                       "the tensor-parallel collectives cross hosts through gloo, as on a cluster.")
def tp(nprocs, model, n_layer, global_batch, steps, warmup, rounds, json_path, simulate_hosts) -> None:
    """Our tensor-parallel GPT beside PyTorch's DTensor tensor parallelism: same weights and
    batches on N gloo processes; same losses first, then step times.

    \b
    Examples:
      paratrain bench tp --nprocs 2,4 --model gpt-tiny
      paratrain bench tp --nprocs 4 --simulate-hosts 2
    """
    try:
        sizes = [int(n) for n in nprocs.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {nprocs!r}", param_hint="--nprocs") from None
    if warmup >= steps:
        raise click.BadParameter(f"--warmup {warmup} leaves no timed step of {steps}", param_hint="--warmup")
    hosts = checked_hosts(simulate_hosts, "processes", sizes)
    click.echo(f"# paratrain bench tp: {model}, global batch {global_batch}, {steps} steps ({warmup} untimed), "
               f"median of {rounds} alternating runs; gloo processes{hosts_words(hosts)}")
    inside = "inside a host, gloo's sockets between hosts" if hosts else "between processes of one host"
    click.echo(f"# ours moves its messages through shared memory {inside}, PyTorch's"
               " through gloo's sockets (PARATRAIN_SHM=0: both through the sockets)")
    click.echo(f"# {'tp':>3}  {'ours_ms':>9}  {'torch_ms':>9}  {'ours/torch':>10}  {'max loss diff':>13}")
    failed = False
    records = []
    for size in sizes:
        config = bench_config(model, size, global_batch, steps, n_layer, hosts)
        result = run(both_on_this_rank, size, launcher=config.parallel.launcher, args=(config, rounds, warmup),
                     simulate_hosts=config.parallel.simulate_hosts)[0]
        diff = max(abs(a - b) / abs(b) for a, b in zip(result["ours_losses"], result["torch_losses"]))
        failed |= diff > LOSS_RTOL
        click.echo(f"  {size:>3}  {result['ours_ms']:>9.2f}  {result['torch_ms']:>9.2f}  "
                   f"{result['ours_ms'] / result['torch_ms']:>10.2f}  {diff:>13.1e}")
        records.append({"model": model, "tp": size, "global_batch": global_batch, "steps": steps,
                        "warmup": warmup, "rounds": rounds, "ours_ms": result["ours_ms"],
                        "torch_ms": result["torch_ms"], "ratio": result["ours_ms"] / result["torch_ms"],
                        "simulate_hosts": hosts, "max_loss_diff": diff})
    click.echo(f"# max loss diff: largest relative difference of the two implementations' losses (must be <= {LOSS_RTOL:g})")
    if json_path:
        with open(json_path, "w") as out:
            json.dump(records, out, indent=1)
        click.echo(f"# wrote {len(records)} records to {json_path}")
    if failed:
        raise click.ClickException("the two implementations' losses differ: not the same model")
