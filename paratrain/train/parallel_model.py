"""Apply tensor and pipeline parallelism to a freshly built model, from outside it.

Order matters, as in torchtitan's parallelize: the full model is built (every rank the same,
from the seed), context parallelism captures its attention and cuts its position buffers,
tensor parallelism shards its layers in place, then the pipeline cuts it into chunks and each
rank keeps only its own. Data parallelism wraps whatever is left.

Every run builds one, whatever its layout: with pp = tp = 1 it is the model itself, whole, with
the data set's loss and no schedule. What differs between layouts is decided here, once: how a
step runs forward and backward (`step_function`), and what it adds to the summary.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from paratrain.models.moe import moe_layers
from paratrain.parallel.context.apply import apply_context_parallel
from paratrain.parallel.expert.apply import apply_expert_parallel
from paratrain.parallel.pipeline.runtime import PipelineRuntime
from paratrain.parallel.precision import autocast
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.simulate import theoretical_bubble
from paratrain.parallel.pipeline.split import balanced_partition, layer_costs, pipeline_layers, split_layers
from paratrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from paratrain.parallel.tensor.parallelize import gather_full_state, parallelize
from paratrain.parallel.tensor.tp_comms import all_gather_along
from paratrain.models import model_config
from paratrain.train.context_method import context_plan
from paratrain.train.setup import build_seeded_model, persistent_buffers, plan_for


@dataclass
class ParallelModel:
    model: nn.Module  # the whole (possibly tensor-sharded) model, as built
    chunks: dict[int, nn.Module]  # pipeline chunks this rank holds, by chunk index
    module: nn.Module  # what data parallelism wraps: this rank's chunks, or the whole model
    loss_fn: object  # (outputs, targets) -> mean loss; vocab-parallel under tensor parallelism
    schedule: object | None  # the pipeline schedule, when pp > 1
    plan: object | None = None  # the parallelism plan applied (None: the model has none)

    def own_parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def step_function(self, mesh, dp, par, device, scaler=None):
        """(inputs, targets) -> (summed loss, bubble or None): one step's forward and backward,
        through the pipeline's schedule, or over `grad_accum` micro-batches of this replica.
        With a loss `scaler` (fp16) backward runs from the loss times its scale; the summed loss
        returned is the loss itself."""
        loss_fn = self.loss_fn
        if scaler is not None:
            def loss_fn(outputs, targets):
                return self.loss_fn(outputs, targets) * scaler.scale

        forward_context = autocast(par.precision, device)
        if self.schedule is not None:
            runtime = PipelineRuntime(self.schedule, mesh.coords.pp, self.chunks, mesh.pp, loss_fn, dp,
                                      par.checkpoint_activations, forward_context, device)
            step = lambda x, y: _pipeline_step(runtime, self.schedule, x, y)  # noqa: E731
        else:
            step = lambda x, y: _accumulation_step(dp, loss_fn, x, y, par, forward_context)  # noqa: E731
        if scaler is None:
            return step

        def unscaled_loss(x, y):
            scale = scaler.scale  # a power of two: the division is exact
            loss_sum, bubble = step(x, y)
            return loss_sum / scale, bubble
        return unscaled_loss

    def global_loss(self, loss_sum: float, mesh) -> float:
        """The step's loss over the whole global batch, on every rank (logging only, untimed)."""
        value = torch.tensor([loss_sum], dtype=torch.float64)
        if self.schedule is not None:
            mesh.pp.all_reduce(value, "sum")  # only the last chunk's owner computed a loss
        mesh.dp_cp.all_reduce(value, "avg")  # every cp rank's loss is the mean over as many tokens
        return value.item()

    def pipeline_summary(self, log: list[dict]) -> dict:
        """The measured and the schedule's bubble (nothing without a pipeline)."""
        if self.schedule is None:
            return {}
        s = self.schedule
        return {"bubble": statistics.fmean(e["bubble"] for e in (log[1:] or log)),
                "theoretical_bubble": theoretical_bubble(s.name, s.stages, s.microbatches, s.virtual_stages)}


def build_parallel_model(config, mesh, dataset) -> ParallelModel:
    """The configuration's model, built from its seed (every rank the same), parallelized."""
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    micro = config.data.global_batch // (mesh.dp.size * config.parallel.microbatches)
    shape = model_config(config.model.name, **config.model.overrides)
    par = config.parallel
    if par.cp > 1 and par.cp_method == "auto":
        par = replace(par, cp_method=context_plan(config, mesh.world.size).method)
    for layer in moe_layers(model):  # each rank's share of the balance loss: its gradient is averaged over dp x cp
        layer.global_sequences = config.data.global_batch // mesh.dp_cp.size
    return parallelize_model(model, plan_for(config.model.plan, model), mesh, par, dataset.loss,
                             getattr(dataset, "vocab_size", getattr(shape, "vocab_size", None)),
                             lambda: dataset.global_batch(0, micro)[0], getattr(shape, "block_size", None))


def parallelize_model(model: nn.Module, plan, mesh, par, loss_fn, vocab_size: int | None = None,
                      sample=None, seq_len: int | None = None) -> ParallelModel:
    """Context parallelism by `plan` (sequences of `seq_len` split over cp), tensor parallelism
    (in place), then this rank's pipeline chunks. `loss_fn` (outputs, targets) -> mean loss;
    under a vocabulary-parallel head it is replaced by the sharded cross-entropy over
    `vocab_size`. `sample()`: a micro-batch of inputs, for a plan that balances the pipeline by
    measured time."""
    pp_size, tp_size = mesh.shape["pp"], mesh.shape["tp"]
    if mesh.shape["cp"] > 1:  # first: it changes no parameter, and the pipeline's stages read its buffers
        if plan is None or seq_len is None:
            raise ValueError("context parallelism needs the model's plan (its context_parallel section) and the "
                             "sequence length")
        # "auto" is resolved from a run's config (train/context_method.py); a model prepared from
        # Python, with no config to price, keeps the ring.
        method = "ring" if par.cp_method == "auto" else par.cp_method
        apply_context_parallel(model, plan, mesh.cp, seq_len, par.cp_layout, method)
    if mesh.ep is not None:  # before the pipeline cuts the model: every layer's experts, this rank's slice
        apply_expert_parallel(model, mesh.ep)
    schedule = counts = None
    if pp_size > 1:
        schedule = build_schedule(par.schedule, pp_size, par.microbatches, par.virtual_stages)
        # Balance on the unsharded layers: every tensor-parallel rank must cut at the same place.
        balance = plan.pipeline.balance if plan is not None else "cost"
        counts = par.stage_layers or balanced_partition(_costs(model, plan, balance, sample, mesh),
                                                        schedule.num_chunks)
    if tp_size > 1:
        # The flag switches sequence parallelism on; left off, the plan's own setting holds.
        parallelize(model, plan, mesh.tp, sequence_parallel=True if par.sequence_parallel else None)
        if any(style.name == "vocab_head" for style in plan.tensor_parallel.values()):
            if vocab_size is None:
                raise ValueError("a vocabulary-parallel head needs the vocabulary size (vocab_size)")
            tp_group = mesh.tp

            def loss_fn(logits_shard, targets):
                return vocab_parallel_cross_entropy(logits_shard, targets, tp_group, vocab_size)

    if pp_size == 1:
        return ParallelModel(model, {0: model}, model, loss_fn, None, plan)
    all_chunks = split_layers(pipeline_layers(model, plan), schedule.num_chunks, counts)
    mine = {c: all_chunks[c] for c in schedule.chunks_of(mesh.coords.pp)}
    return ParallelModel(model, mine, nn.ModuleList(mine.values()), loss_fn, schedule, plan)


def _costs(model, plan, balance: str, sample, mesh) -> list[int]:
    """The layers' costs to balance; measured ones are rank 0's, broadcast, so that every rank
    cuts at the same place."""
    if balance == "measured" and sample is None:
        raise ValueError("the plan balances the pipeline by measured time: give a sample micro-batch")
    costs = layer_costs(pipeline_layers(model, plan), balance, sample() if balance == "measured" else None)
    if balance == "measured":
        shared = torch.tensor(costs, dtype=torch.float64)
        mesh.world.broadcast(shared, root=0)
        costs = [int(c) for c in shared.tolist()]
    return costs


def full_state(parallel: ParallelModel, mesh) -> dict[str, torch.Tensor]:
    """This rank's parameters under the single-device model's names, tensor shards gathered.

    Only the parameters of chunks this rank holds are included; the union over pipeline
    ranks is the whole model.
    """
    mine = {id(p) for p in parallel.module.parameters()}
    owned = {name for name, p in parallel.model.named_parameters() if id(p) in mine}
    if mesh.shape["tp"] > 1:
        state = gather_full_state(parallel.model, mesh.tp)
    else:
        state = {name: _whole(p).detach().clone() for name, p in parallel.model.named_parameters()}
    if mesh.ep is not None:  # each rank's slice of the experts, every rank's in order
        for name, param in parallel.model.named_parameters():
            if getattr(param, "expert_parallel", False):
                state[name] = all_gather_along(state[name], mesh.ep, 0)
    state = {name: value for name, value in state.items() if name in owned}
    return {**state, **persistent_buffers(parallel.model, parallel.module)}


def _whole(param: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: PyTorch's FSDP2 holds DTensors (gathering one is a collective)."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported by whoever made a DTensor
    return param.full_tensor() if dtensor is not None and isinstance(param, dtensor.DTensor) else param


def _accumulation_step(dp, loss_fn, inputs, targets, par, autocast):
    """Forward/backward over `grad_accum` micro-batches, communicating on the last only.
    `autocast()` gives the precision's context: forward and loss inside it, as in the reference."""
    micro_batches, loss_sum = par.grad_accum, 0.0
    for index, (x, y) in enumerate(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches))):
        with nullcontext() if index == micro_batches - 1 else dp.no_sync():
            with autocast():
                loss = loss_fn(dp.module(x), y) / micro_batches
            loss.backward()
        loss_sum += loss.item()
    return loss_sum, None


def _pipeline_step(runtime, schedule, inputs, targets):
    stats = runtime.run(list(inputs.chunk(schedule.microbatches)), list(targets.chunk(schedule.microbatches)))
    return stats["loss_sum"], 1 - stats["busy_s"] / stats["total_s"]

