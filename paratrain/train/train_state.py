"""A rank's training state in layout-free form, and back.

A checkpoint must load into another layout (dp 2 x tp 2 saved, dp 4 or tp 1 resumed), so what
is written is the single-device model's state under its own names, whole:

    model/<name>            a parameter, tensor-parallel shards gathered into one tensor
    optim/<name>/<key>      its optimizer state (momentum_buffer; AdamW's step, exp_avg,
                            exp_avg_sq), in the parameter's full shape; ZeRO-1's flat shards
                            are gathered over data parallelism and cut back into parameters,
                            and so are FSDP's per-unit shards (of parameters too)

Each tensor has one owner that writes it: data-parallel rank 0 and tensor-parallel rank 0 of
the pipeline stage that holds the parameter. Loading is the reverse: every rank reads the
whole tensors of the parameters it holds and keeps its own shard. The gathers are
collectives, so every rank calls `owned_state` at the same point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.parallel.data.fsdp import FullyShardedDataParallel
from paratrain.parallel.data.zero import ZeroOneDataParallel
from paratrain.parallel.tensor.layers import shard
from paratrain.parallel.tensor.tp_comms import all_gather_along


@dataclass
class TrainState:
    """What one rank trains, seen from the checkpoint."""

    model: nn.Module  # the single-device model's structure: its names are the checkpoint's
    local: nn.Module  # the parameters this rank trains (its pipeline chunks)
    dp: object  # the DataParallel strategy (ZeRO-1 keeps the optimizer state in flat shards)
    optimizer: torch.optim.Optimizer
    tp_group: object | None  # None without tensor parallelism
    owner: bool  # data-parallel rank 0 and tensor-parallel rank 0: writes what it holds
    ep_group: object | None = None  # None without expert parallelism: the ranks splitting the experts

    def buffers(self):
        """(name, buffer) for each persistent buffer of the modules this rank runs (a router's
        balancing bias): state a checkpoint keeps beside the parameters, the same on every rank."""
        mine = {id(m) for m in self.local.modules()}
        for module_name, module in self.model.named_modules():
            if id(module) in mine:
                for name, buffer in module.named_buffers(recurse=False):
                    if name not in module._non_persistent_buffers_set:
                        yield (f"{module_name}.{name}" if module_name else name), buffer

    def parameters(self):
        """(name, module's shard layout or None, parameter) for each parameter this rank trains,
        in the single-device model's order (the same on every rank of a stage)."""
        mine = {id(p) for p in self.local.parameters()}
        for module_name, module in self.model.named_modules():
            layout = getattr(module, "shard_layout", {})
            for name, param in module.named_parameters(recurse=False):
                if id(param) in mine:
                    full_name = f"{module_name}.{name}" if module_name else name
                    yield full_name, layout.get(name) if self.tp_group is not None else None, param


@torch.no_grad()
def owned_state(state: TrainState) -> dict[str, torch.Tensor]:
    """The tensors this rank writes (empty on non-owners). A collective over tp and dp."""
    per_param = _optimizer_state_by_param(state)
    out = {}
    with state.dp.gathered():  # FSDP's parameters, whole for the while
        _write_owned(state, per_param, out)
    return out


def _write_owned(state: TrainState, per_param: dict, out: dict) -> None:
    for name, layout, param in state.parameters():
        tensors = {"model": param.detach(), **{f"optim/{key}": v for key, v in per_param.get(id(param), {}).items()}}
        for label, value in tensors.items():
            if layout is not None and value.dim() > 0:
                dim, parts, length = layout
                value = all_gather_along(value, state.tp_group, dim, parts, length)
            if _expert_split(state, param) and value.dim() > 0:  # this rank's experts: every rank's, in order
                value = all_gather_along(value, state.ep_group, 0)
            if state.owner:
                key = f"model/{name}" if label == "model" else f"optim/{name}/{label.removeprefix('optim/')}"
                out[key] = value.detach().clone()
    if state.owner:
        out.update({f"model/{name}": buffer.detach().clone() for name, buffer in state.buffers()})


def _expert_split(state: TrainState, param) -> bool:
    return state.ep_group is not None and getattr(param, "expert_parallel", False)


def _optimizer_state_by_param(state: TrainState) -> dict[int, dict[str, torch.Tensor]]:
    """id(parameter) -> its optimizer state, in the parameter's (tensor-parallel local) shape.
    The experts' is theirs whatever the strategy: it leaves them to expert parallelism."""
    experts = {id(p): dict(s) for p, s in state.optimizer.state.items() if getattr(p, "expert_parallel", False)}
    return {**_strategy_state_by_param(state), **experts}


def _strategy_state_by_param(state: TrainState) -> dict[int, dict[str, torch.Tensor]]:
    if isinstance(state.dp, FullyShardedDataParallel):
        return _fsdp_state_by_param(state)
    if not isinstance(state.dp, ZeroOneDataParallel):
        return {id(p): dict(s) for p, s in state.optimizer.state.items()}
    zero = state.dp
    shard_state = state.optimizer.state.get(zero.shard, {})
    flat = {key: value if value.dim() == 0 else zero.gather_shards(value.contiguous())
            for key, value in shard_state.items()}
    result, offset = {}, 0
    for param in zero.params:
        end = offset + param.numel()
        result[id(param)] = {key: v if v.dim() == 0 else v[offset:end].view_as(param) for key, v in flat.items()}
        offset = end
    return result


def _fsdp_state_by_param(state: TrainState) -> dict[int, dict[str, torch.Tensor]]:
    """Each unit's shard state gathered into the unit's flat layout, then cut into parameters."""
    result = {}
    for unit in state.dp.units:
        flat = {}
        for key, value in state.optimizer.state.get(unit.shard, {}).items():
            if value.dim() == 0:
                flat[key] = value
            else:
                flat[key] = torch.empty(unit.full.numel(), dtype=value.dtype, device=value.device)
                state.dp.group.all_gather(flat[key], value.contiguous())
        offset = 0
        for param in unit.params:
            end = offset + param.numel()
            result[id(param)] = {key: v if v.dim() == 0 else v[offset:end].view_as(param) for key, v in flat.items()}
            offset = end
    return result


@torch.no_grad()
def load_state(state: TrainState, read) -> None:
    """Put whole tensors back as this rank's shards. `read(keys)` returns {key: tensor} for
    the keys the checkpoint has; optimizer keys are found by their prefix."""
    params = list(state.parameters())
    buffers = list(state.buffers())
    wanted = [f"model/{name}" for name, _, _ in params] + [f"model/{name}" for name, _ in buffers]
    tensors = read(wanted, prefixes=[f"optim/{name}/" for name, _, _ in params])
    missing = [key for key in wanted if key not in tensors]
    if missing:
        raise ValueError(f"checkpoint has no {missing[0]!r} ({len(missing)} parameter(s) missing): another model?")
    local_optim = {}
    with state.dp.gathered():  # FSDP: written whole, kept as shards when the block ends
        for name, buffer in buffers:
            buffer.copy_(tensors[f"model/{name}"])
        for name, layout, param in params:
            value = _local_shard(tensors[f"model/{name}"], layout, state, param)
            if value.shape != param.shape:
                raise ValueError(f"checkpoint's {name} has shape {tuple(value.shape)} here, "
                                 f"the model {tuple(param.shape)}")
            param.copy_(value)
            prefix = f"optim/{name}/"
            local_optim[id(param)] = {
                key.removeprefix(prefix): _local_shard(value, layout, state, param).to(param.device)
                for key, value in tensors.items() if key.startswith(prefix)
            }
    _restore_optimizer(state, local_optim)


def _local_shard(value: torch.Tensor, layout, state: TrainState, param) -> torch.Tensor:
    if value.shape == param.shape:  # already this rank's part (a reader that reads only that: hf_slices.py)
        return value
    if value.dim() > 0 and _expert_split(state, param):  # this rank's experts, before any tp cut
        value = shard(value, 0, state.ep_group.rank, state.ep_group.size)
    if layout is None or value.dim() == 0:
        return value
    dim, parts, _ = layout
    return shard(value, dim, state.tp_group.rank, state.tp_group.size, parts)


def _restore_optimizer(state: TrainState, by_param: dict[int, dict[str, torch.Tensor]]) -> None:
    optimizer = state.optimizer
    for group in optimizer.param_groups:  # the experts: whatever the strategy, each its own state
        for param in group["params"]:
            if getattr(param, "expert_parallel", False) and by_param.get(id(param)):
                optimizer.state[param] = by_param[id(param)]
    if isinstance(state.dp, FullyShardedDataParallel):
        for unit in state.dp.units:
            keys = set().union(*(set(by_param.get(id(p), {})) for p in unit.params))
            restored = {}
            for key in keys:
                values = [by_param[id(p)][key] for p in unit.params]
                restored[key] = values[0].clone() if values[0].dim() == 0 else \
                    torch.cat([v.reshape(-1) for v in values])[unit.own].clone()
            if restored:
                optimizer.state[unit.shard] = restored
        return
    if not isinstance(state.dp, ZeroOneDataParallel):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if by_param.get(id(param)):
                    optimizer.state[param] = by_param[id(param)]
        return
    zero = state.dp
    zero.shard.data.copy_(zero.own_part(zero.flat_params))  # the optimizer's copy of the loaded weights
    keys = set().union(*(set(s) for s in by_param.values())) if by_param else set()
    restored = {}
    for key in keys:
        values = [by_param[id(p)][key] for p in zero.params]
        if values[0].dim() == 0:
            restored[key] = values[0].clone()
        else:
            restored[key] = zero.own_part(torch.cat([v.reshape(-1) for v in values]))
    if restored:
        optimizer.state[zero.shard] = restored

