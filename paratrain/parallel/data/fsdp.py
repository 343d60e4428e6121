"""ZeRO-3 / FSDP: parameters, gradients and optimizer state all sharded across data-parallel ranks.

Each rank keeps 1/n of every unit's parameters (see fsdp_units.py). A unit's forward is
preceded by an all-gather of its parameters and followed by freeing them
(`reshard_after_forward`; off, they stay until the unit's backward is done); a hook on the
unit's outputs gathers them again just before its backward needs them; once backward has
written all of the unit's gradients, they are reduce-scattered into its shard and the gathered
parameters freed. The optimizer sees only the shards; after its step there is nothing to
gather: the next forward does it, unit by unit.

Prefetch: when a unit's gather is awaited, the gathers of the next `prefetch` units (in
forward order in forward, in reverse in backward) are started on the communication thread, so
that they arrive while this unit computes. The last block is not freed after forward (when
gradients are being recorded): backward starts with it. The root unit (what runs before and
after the blocks) is gathered when the model, or a pipeline chunk, starts, and stays until its
backward is done, as FSDP2 keeps its root: its head runs after every block and its embedding's
gradient comes last.

All-gathers and reduce-scatters run on two groups of the same ranks, each with its own
communication thread and call numbering, as FSDP2 puts them on two streams: gathers are
issued in the order units run, reduce-scatters in the order their gradients complete, and the
two orders interleave differently on different ranks. Within each group every rank makes the
same calls in the same order: gathers follow the hooks of forward and backward, and
reduce-scatters start strictly in reverse unit order (`ReductionsInOrder`).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial

import torch

from paratrain.parallel.data.base import DataParallel, data_parallel_parameters, pieces_of_shard
from paratrain.parallel.data.buckets import ReductionsInOrder
from paratrain.parallel.data.fsdp_units import ShardedUnit, unit_layout


class FullyShardedDataParallel(DataParallel):
    def __init__(self, module, group, algo="auto", model=None, plan=None, roots=None, reshard_after_forward=True,
                 prefetch=1, compute_dtype=None):
        """`model`: the whole model the units are read from (default `module`), with its `plan`
        (None: its structure; see fsdp_units.unit_layout); only the parameters `module` holds are
        sharded (a pipeline rank's chunks). `roots`: the modules the loop calls (default
        [`module`]), whose forward gathers the root unit. `compute_dtype` (bf16): the gathered
        parameters' and the gradients' precision (see fsdp_units.py)."""
        super().__init__(module, group, algo)
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self.gather_group = group.split([list(range(group.size))])
        held = {id(p) for p in data_parallel_parameters(module)}
        layout = unit_layout(model if model is not None else module, plan)
        self.units: list[ShardedUnit] = []
        # The root first: it is gathered when the model (or a chunk) starts, before any block.
        pieces = [(list(roots or [module]), layout.root_params, True)]
        pieces += [([block], params, False) for block, params in zip(layout.blocks, layout.block_params)]
        for modules, params, is_root in pieces:
            params = [p for p in params if id(p) in held]
            if params:
                unit = ShardedUnit(len(self.units), modules, params, group, algo, compute_dtype, is_root)
                self.units.append(unit)
        covered = {id(p) for unit in self.units for p in unit.params}
        left = [name for name, p in module.named_parameters() if id(p) in held and id(p) not in covered]
        if left:
            raise ValueError(f"fsdp: parameters in no unit: {', '.join(left)}")
        self._unit_of = {id(p): unit for unit in self.units for p in unit.params}
        backward_order = list(reversed(self.units))
        self.reductions = ReductionsInOrder([u.params for u in backward_order],
                                            lambda k: backward_order[k].start_reduce_scatter(self.group))
        for unit in self.units:
            for m in unit.modules:
                m.register_forward_pre_hook(partial(self._before_forward, unit))
                m.register_forward_hook(partial(self._after_forward, unit))
        for param in (p for unit in self.units for p in unit.params):
            param.register_post_accumulate_grad_hook(self._grad_ready)

    # ---- gathering ------------------------------------------------------------------------

    def _gather(self, unit: ShardedUnit, direction: int) -> None:
        """`unit`'s parameters, here; the next units' (in `direction`) on their way."""
        if not unit.is_gathered:
            unit.start_gather(self.gather_group)
        for step in range(1, self.prefetch + 1):
            index = unit.index + direction * step
            if 0 <= index < len(self.units) and not self.units[index].is_gathered:
                self.units[index].start_gather(self.gather_group)
        unit.wait_gathered(self.timer)

    def _before_forward(self, unit, module, args) -> None:
        self._gather(unit, +1)

    def _after_forward(self, unit, module, args, output) -> None:
        grad = torch.is_grad_enabled()
        if grad:
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._before_backward, unit))
        if unit.is_root:  # kept until its backward is done (FSDP2 keeps its root), unless no backward comes
            free = not grad
        else:  # the last block is kept when gradients are recorded: backward starts with it
            free = self.reshard_after_forward and not unit.in_backward and not (
                grad and unit.index == len(self.units) - 1)
        if free:
            unit.free()

    def _before_backward(self, unit, grad) -> None:
        if not unit.in_backward:
            self._gather(unit, -1)
            unit.in_backward = True

    @contextmanager
    def gathered(self):
        """Every unit's parameters whole, in fp32, inside the block (to read or load them); what
        is written into them is kept. A collective."""
        with ExitStack() as stack:
            for unit in self.units:
                unit.wait_gathered(self.timer)
                stack.enter_context(unit.whole(self.gather_group))
            yield
        for unit in self.units:
            unit.free()

    # ---- gradients ------------------------------------------------------------------------

    def _grad_ready(self, param) -> None:
        unit = self._unit_of[id(param)]
        unit.waiting.discard(id(param))
        if self._syncing:
            self.reductions.ready(param)
        if not unit.waiting:  # its backward is done: the gradients are out of the parameters' way
            unit.free()

    def grad_ready(self, param) -> None:
        self._grad_ready(param)

    def finish_gradients(self) -> None:
        self.reductions.finish(self.timer)
        for unit in self.units:  # prefetched for a backward that did not come, or kept from forward
            unit.wait_gathered(self.timer)
            unit.free()

    # ---- the step -------------------------------------------------------------------------

    grads_sharded = True

    def gradient_pieces(self):
        return [piece for unit in self.units
                for piece in pieces_of_shard(unit.params, [(unit.own.start, unit.own.stop, 0)], unit.shard.grad)]

    def gradients_to_scale(self):
        return [unit.shard.grad for unit in self.units]

    def make_optimizer(self, build):
        return build([unit.shard for unit in self.units])

    def zero_grad(self) -> None:
        for unit in self.units:
            for param in unit.params:
                param.grad = None

    def close(self) -> None:
        self.gather_group.close()


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []
