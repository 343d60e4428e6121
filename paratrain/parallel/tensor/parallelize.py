"""Tensor parallelism applied to any model from outside it, and undone for reading: `parallelize`
shards a model in place by a plan, `gather_full_state` gathers its parameters whole again.

Each styled module is replaced by its sharded layer (layers.py), built from the module's own
weights, so every rank must start from the same unsharded model (build it from one seed).

    colwise     -> ColumnParallelLinear    (output features; `parts` fused blocks split alike)
    rowwise     -> RowParallelLinear       (input features; all-reduce, or reduce-scatter under SP)
    vocab_embed -> VocabParallelEmbedding  (vocabulary ranges; all-reduce or reduce-scatter)
    vocab_head  -> ColumnParallelLinear    (vocabulary ranges of the logits, never gathered)
    replicate   -> unchanged; an Embedding becomes a SequenceShardedEmbedding under SP

The head counts of the modules whose heads are split are divided by tp. Weights the model ties
(one Parameter in two modules, as tied embeddings) stay tied when both get the same split.

Sequence parallelism (activations between the gathered regions sharded along the sequence):
the inputs of the plan's gather_inputs modules are all-gathered at their boundary, and the
replicated parameters outside those regions (norms), with the row-parallel biases, see only
this rank's tokens, so a hook all-reduces their gradients over tp as backward produces them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from paratrain.parallel.plan import Plan, PlanError, head_count_modules, load_plan, matching_modules, \
    styled_modules, tp_problems_of
from paratrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceShardedEmbedding,
    VocabParallelEmbedding,
)
from paratrain.parallel.tensor.tp_comms import all_gather_along, all_reduce_copy, gather_sequence


def parallelize(model: nn.Module, plan, tp_group, sequence_parallel: bool | None = None) -> nn.Module:
    """Shard `model` over `tp_group` as `plan` (a Plan, dict or YAML path) says; returns the model.

    sequence_parallel: None takes the plan's own setting. A plan that does not fit raises
    PlanError, its first problem (check_plan-style validation lists them all beforehand).
    """
    plan = load_plan(plan)
    tp = tp_group.size
    sp = (plan.sequence_parallel if sequence_parallel is None else sequence_parallel) and tp > 1
    problems = tp_problems_of(model, plan, tp, sp)
    if problems:
        raise PlanError(problems[0])
    styled = styled_modules(model, plan)
    heads = head_count_modules(model, plan, styled)
    tied = _tied_parameters(model, styled)
    for name, (module, style) in styled.items():
        sharded = _sharded(module, style, tp_group, sp)
        if sharded is not module:
            _set_submodule(model, name, sharded)
    for module, attrs in heads.values():
        for attr in attrs:
            setattr(module, attr, getattr(module, attr) // tp)
    _retie(model, tied, plan)
    if sp:
        _apply_sequence_parallel(model, plan, tp_group)
    return model


def _sharded(module: nn.Module, style, group, sp: bool) -> nn.Module:
    if style.name == "colwise":
        return ColumnParallelLinear(module, group, fused_parts=style.parts, sequence_parallel=sp)
    if style.name == "vocab_head":
        return ColumnParallelLinear(module, group, sequence_parallel=sp)
    if style.name == "rowwise":
        return RowParallelLinear(module, group, sequence_parallel=sp)
    if style.name == "vocab_embed":
        return VocabParallelEmbedding(module, group, sequence_parallel=sp)
    if sp and isinstance(module, nn.Embedding):  # replicate
        return SequenceShardedEmbedding(module, group)
    return module


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, module)


def _tied_parameters(model: nn.Module, styled: dict) -> list[list[tuple[str, str]]]:
    """Groups of (module path, parameter name) holding one Parameter, where a styled module is
    among them (replacing it would untie them)."""
    places: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            if (module_name, name) not in places.get(id(param), []):
                places.setdefault(id(param), []).append((module_name, name))
    return [group for group in places.values() if len(group) > 1 and any(m in styled for m, _ in group)]


def _retie(model: nn.Module, tied: list, plan: Plan) -> None:
    """Make the places of each tied group hold one Parameter again (the first place's)."""
    for group in tied:
        (first_module, first_name), *rest = group
        keep = getattr(model.get_submodule(first_module), first_name)
        keep_layout = _layout_of(model.get_submodule(first_module), first_name)
        for module_name, name in rest:
            module = model.get_submodule(module_name)
            if getattr(module, name).shape != keep.shape or _layout_of(module, name) != keep_layout:
                raise PlanError(f"{plan.source}: {first_module}.{first_name} and {module_name}.{name} are one "
                                "tied parameter, but the plan splits them differently")
            setattr(module, name, keep)


def _layout_of(module: nn.Module, name: str):
    """(dim, fused parts) a sharded layer splits its parameter `name` along; None: not split."""
    layout = getattr(module, "shard_layout", {}).get(name)
    return None if layout is None else layout[:2]


def _apply_sequence_parallel(model: nn.Module, plan: Plan, group) -> None:
    regions = []
    for pattern in plan.gather_inputs:
        for name, module in matching_modules(model, pattern):
            module.register_forward_pre_hook(partial(_gather_sequence_input, group=group))
            regions.append(name)
    for param in _sequence_sharded_parameters(model, regions):
        param.register_hook(partial(all_reduce_copy, group=group))


def _gather_sequence_input(module, args, group):
    x_BTD_shard, *rest = args
    return (gather_sequence(x_BTD_shard, group), *rest)


def _sequence_sharded_parameters(model: nn.Module, regions: list[str]) -> list[nn.Parameter]:
    """Replicated parameters that see only this rank's tokens: those of modules outside every
    gathered region, except the sharded layers (whose gradients are their own) and the
    sequence-sharded tables (whose backward gathers); and the row-parallel biases."""
    def inside(name):
        return any(name == r or name.startswith(f"{r}.") for r in regions)

    params, seen = [], set()
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear):
            own = [module.bias] if module.bias is not None else []
        elif hasattr(module, "shard_layout") or isinstance(module, SequenceShardedEmbedding) or inside(name):
            own = []
        else:
            own = list(module.parameters(recurse=False))
        for param in own:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def sequence_sharded_parameters(model: nn.Module, plan) -> list[nn.Parameter]:
    """The parameters whose gradients sequence parallelism all-reduces over tp, for `plan`."""
    plan = load_plan(plan)
    regions = [name for pattern in plan.gather_inputs for name, _ in matching_modules(model, pattern)]
    return _sequence_sharded_parameters(model, regions)


__all__ = ["PlanError", "parallelize", "sequence_sharded_parameters"]


@torch.no_grad()
def gather_full_state(model: nn.Module, tp_group, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded parameters (with grads=True: their gradients) under the single-device
    model's names, as copies. Parameters without a gradient are left out of the grads.

    A collective: every rank of `tp_group` must call it, and every rank gets the whole state.
    """
    state = {}
    for module_name, module in model.named_modules():
        layout = getattr(module, "shard_layout", {})
        for name, param in module.named_parameters(recurse=False):
            value = param.grad if grads else param.detach()
            if value is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            if name in layout:
                dim, parts, length = layout[name]
                value = all_gather_along(value, tp_group, dim, parts, length)
            state[full_name] = value.clone()
    return state
