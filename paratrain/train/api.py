"""The library face: our data, tensor and pipeline parallelism inside a user's own training loop.

    def train(group):                          # paratrain.run(train, 8), or one rank under torchrun
        mesh = paratrain.Mesh(group, dp=2, pp=2, tp=2)
        with paratrain.seeded(0):              # every rank builds the same model (threads: one at a time)
            model = build()
        job = paratrain.prepare(model, mesh, loss_fn, plan="plan.yaml", vocab_size=256,
                                zero=1, schedule="1f1b", microbatches=4)
        optimizer = job.optimizer(lambda params: torch.optim.AdamW(params, lr=3e-3))
        for step in range(steps):
            x, y = my_batch(step, mesh.dp.rank, mesh.dp.size)      # this replica's rows
            loss = job.forward_backward(x, y)  # the global batch's loss, on every rank
            job.clip_grad_norm_(1.0)           # optional: the norm over every shard
            optimizer.step()
            optimizer.zero_grad()

With `compile=True` each layer runs through torch.compile (train/compiled.py).

`prepare` applies what `paratrain train` applies, in the same order and through the same code
(train/loop.py calls it too): tensor parallelism by the plan, this rank's pipeline chunks, and
the data-parallel strategy (ddp, zero 1/2/3, ...: `dp_mode` / `zero`, as the flags). Its keyword
options are ParallelConfig's fields (train/config.py), the flags' names with underscores.

The optimizer is the user's, built on what this rank's strategy gives it (ZeRO: its shard) and
still a torch Optimizer, so learning-rate schedulers take it. Its `step` and `zero_grad` carry
what the strategy adds: ZeRO gathers the updated shards after the step, ZeRO-1 clears its flat
gradient buffer, local SGD averages every K steps, and an fp16 step whose gradients overflowed
does not step at all.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

import torch
from torch import nn

from paratrain.parallel.context.layout import shard
from paratrain.models.moe import moe_layers, update_router_bias
from paratrain.parallel.data import build_data_parallel
from paratrain.parallel.expert.gradients import ExpertGradients
from paratrain.parallel.grad_norm import clip_grad_norm_
from paratrain.parallel.plan import load_plan
from paratrain.parallel.precision import LossScaler
from paratrain.environment import Settings
from paratrain.train.compiled import CompiledLayers
from paratrain.train.config import ParallelConfig
from paratrain.train.parallel_model import ParallelModel, full_state, parallelize_model
from paratrain.train.recompute import recompute_in_backward
from paratrain.train.setup import plan_for

# ParallelConfig's fields that describe the world or the launch, not what prepare applies.
_NOT_OPTIONS = {"nproc", "launcher", "simulate_hosts", "dp", "pp", "tp", "cp", "ep", "timeout", "debug"}
OPTIONS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in _NOT_OPTIONS)


class Prepared:
    """One rank's share of a parallel model, and the calls of one training step."""

    def __init__(self, parallel: ParallelModel, mesh, par: ParallelConfig, device: torch.device):
        self.parallel, self.mesh, self.par, self.device = parallel, mesh, par, device
        parallel.model.to(device)
        if par.checkpoint_activations:  # every layout, pp = 1 included (the pipeline's chunks share the layers)
            recompute_in_backward(parallel.model, parallel.plan)
        # After recompute: the compiled forward is the checkpointed one. None without --compile.
        self.compiled = CompiledLayers(parallel.model, parallel.plan, Settings.resolve().compile_backend) \
            if par.compile else None
        self.dp = build_data_parallel(
            parallel.module, mesh.dp_cp, mode=par.dp_mode, zero=par.zero, local_sgd=par.local_sgd, algo=par.algo,
            naive_layout=par.naive_layout, bucket_mb=par.bucket_mb, first_bucket_mb=par.first_bucket_mb,
            compress=par.compress, model=parallel.model, plan=parallel.plan, roots=list(parallel.chunks.values()),
            reshard_after_forward=par.reshard_after_forward, prefetch=par.prefetch, precision=par.precision,
        )
        # Expert parallelism: the experts are outside the strategy, reduced over the ranks holding them.
        self.experts = ExpertGradients(parallel.module, mesh.edp, mesh.dp_cp.size)
        # The whole model's MoE layers (the log's rows) and which of them this rank runs: found once.
        self.moe_layers = moe_layers(parallel.model)
        self._moe_here = {id(layer) for layer in moe_layers(parallel.module)}
        self.scaler = LossScaler(par.loss_scale) if par.precision == "fp16" else None
        self._step = parallel.step_function(mesh, self.dp, par, device, self.scaler)
        self.finite = True  # fp16: the last step's gradients did not overflow (else its step is skipped)
        self.bubble = None  # the pipeline's measured bubble in the last step

    @property
    def model(self) -> nn.Module:
        """The whole model as built (tensor-sharded in place); this rank runs only `module`."""
        return self.parallel.model

    @property
    def module(self) -> nn.Module:
        """What this rank runs and trains: its pipeline chunks, or the whole model."""
        return self.parallel.module

    def optimizer(self, build: Callable) -> torch.optim.Optimizer:
        """`build(params)` makes the optimizer from the parameters this rank's strategy updates."""
        experts = self.experts.params

        def with_experts(params):  # a strategy that shards builds on its shards: the experts join them
            params = list(params)
            given = {id(p) for p in params}
            return build(params + [p for p in experts if id(p) not in given])

        optimizer = self.dp.make_optimizer(with_experts)
        step = optimizer.step

        def strategy_step(_optimizer, *args, **kwargs):
            if self.finite:
                result = step(*args, **kwargs)
                self.dp.after_step()
                if self._moe_here:
                    update_router_bias(self.parallel.module, self._sum_over_data_ranks)
            else:
                result = None
            if self.scaler is not None:
                self.scaler.update(stepped=self.finite)
            return result

        def strategy_zero_grad(_optimizer, *args, **kwargs):
            self.dp.zero_grad()  # the gradients the strategy keeps (ZeRO-1: its flat buffer), not the shard's
            self.experts.zero_grad()

        # Bound to the optimizer, as its own methods are: learning-rate schedulers wrap `step`
        # through its __func__.
        optimizer.step = types.MethodType(strategy_step, optimizer)
        optimizer.zero_grad = types.MethodType(strategy_zero_grad, optimizer)
        return optimizer

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, global_loss: bool = True) -> float:
        """Forward and backward of this replica's rows (through the pipeline's schedule, or over
        `grad_accum` micro-batches), the gradients finished across data parallelism; returns the
        loss over the whole global batch, the same on every rank (a collective). With
        `global_loss=False`, this rank's part of it, for `global_loss()` later (the training loop
        leaves that all-reduce out of the step's time)."""
        inputs, targets = self.context_share(inputs), self.context_share(targets)
        loss_sum, self.bubble = self._step(inputs.to(self.device), targets.to(self.device))
        self.dp.finish_gradients()
        self.experts.finish()
        self.finite = self.scaler.unscale(self.dp, self.mesh.world) if self.scaler is not None else True
        return self.global_loss(loss_sum) if global_loss else loss_sum

    def context_share(self, batch: torch.Tensor) -> torch.Tensor:
        """This context-parallel rank's part of every sequence of `batch` (B, T, ...), as the
        model's position buffers were cut; the batch itself when cp = 1."""
        cp = self.mesh.cp
        return batch if cp.size == 1 else shard(batch, 1, cp.rank, cp.size, self.par.cp_layout)

    def _sum_over_data_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """A router's token counts summed over every rank that saw other tokens (dp x cp)."""
        if self.mesh.dp_cp.size > 1:
            self.mesh.dp_cp.all_reduce(counts, "sum")
        return counts

    def expert_load(self) -> dict | None:
        """The last step's tokens per expert of every MoE layer (summed over dp x cp, and over
        pp, each stage adding its own layers), the dropped (token, expert) pairs, and the
        imbalance: the largest over layers of max / mean tokens per expert, and per ep rank.
        None without MoE layers. A collective under pp."""
        layers = self.moe_layers
        if not layers:
            return None
        experts = layers[0].n_experts
        table = torch.zeros(len(layers), experts + 1, dtype=torch.float64)
        for row, layer in zip(table, layers):
            if layer.step_load is not None and id(layer) in self._moe_here:
                row[:experts], row[experts] = layer.step_load[0].to(torch.float64), layer.step_load[1]
        if self.mesh.pp.size > 1:
            self.mesh.pp.all_reduce(table, "sum")
        tokens = table[:, :experts]
        ep = self.mesh.ep.size if self.mesh.ep is not None else 1
        per_rank = tokens.view(len(layers), ep, experts // ep).sum(-1)
        imbalance = lambda t: float((t.max(1).values / t.mean(1).clamp(min=1e-12)).max())  # noqa: E731
        return {"expert_tokens": tokens.long().tolist(), "dropped_pairs": int(table[:, experts].sum()),
                "expert_imbalance": imbalance(tokens), "ep_rank_imbalance": imbalance(per_rank)}

    def global_loss(self, loss_sum: float) -> float:
        """The global batch's loss from every rank's part (a collective)."""
        return self.parallel.global_loss(loss_sum, self.mesh)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so their global norm, over every shard, is at most `max_norm`;
        the norm before, as torch.nn.utils.clip_grad_norm_ returns it (inf after an fp16 overflow)."""
        if not self.finite:
            return float("inf")
        return clip_grad_norm_(self.dp, self.mesh, max_norm)

    def communication(self) -> tuple[float, float]:
        """(all, exposed) communication milliseconds since the last call: the step's, read once
        it has ended."""
        return self.dp.timer.take()

    def evaluate(self, evaluator) -> dict[str, float]:
        """The validation loss (train/evaluate.py), the same on every rank (a collective)."""
        result = evaluator.run()
        self.dp.timer.take()  # what evaluating communicated (FSDP's gathers): not the next step's
        return result

    def finish(self) -> None:
        """After the last step: what the strategy owes the run's end (local SGD: one model)."""
        self.dp.finish()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under the single-device model's names, whole (tensor shards
        and FSDP's gathered); every rank calls it (collectives). The union over pipeline ranks is
        the whole model."""
        with self.dp.gathered():
            return full_state(self.parallel, self.mesh)

    def close(self) -> None:
        self.dp.close()


def prepare(model: nn.Module, mesh, loss_fn: Callable, *, plan=None, vocab_size: int | None = None,
            sample: Callable | None = None, device: torch.device | None = None, seq_len: int | None = None,
            **options) -> Prepared:
    """Apply tensor parallelism (by `plan`: a YAML path, a dict or a Plan), the pipeline and
    data parallelism to `model` on `mesh`. `loss_fn(outputs, targets)` is the mean loss of a
    batch; `vocab_size` is needed by a plan whose head is vocabulary-parallel; `seq_len`, the
    sequence length, by a mesh with cp > 1 (give each step the replica's whole sequences: each
    cp rank takes its part). `options`:
    ParallelConfig's fields (dp_mode, zero, schedule, microbatches, virtual_stages, grad_accum,
    precision, sequence_parallel, checkpoint_activations, algo, ...)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"prepare: unknown option {', '.join(map(repr, unknown))}; valid: {', '.join(OPTIONS)}")
    par = ParallelConfig(**{**options, "pp": mesh.shape["pp"], "tp": mesh.shape["tp"], "dp": mesh.shape["dp"],
                            "cp": mesh.shape["cp"]})
    plan = load_plan(plan) if plan is not None else plan_for(None, model)  # else the model's own (GPT, Llama)
    if plan is None and (par.tp > 1 or par.pp > 1):
        raise ValueError(f"prepare: tensor or pipeline parallelism (tp {par.tp}, pp {par.pp}) needs a plan")
    parallel = parallelize_model(model, plan, mesh, par, loss_fn, vocab_size, sample, seq_len)
    prepared = Prepared(parallel, mesh, par, device or mesh.world.transport.device)
    # No rank trains before every rank holds its weights: ranks that are threads share torch's
    # random generator, which activation checkpointing rewinds around each recompute.
    mesh.world.barrier()
    return prepared
