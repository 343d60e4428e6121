"""What the training loop asks of every data-parallel strategy.

The loop calls, per optimizer step: forward/backward through `module` (inside `no_sync()`
for all but the last micro-batch of gradient accumulation), then `finish_gradients()`, then
`step(optimizer)`, then `zero_grad()`. Strategies differ only in when and how gradients (or
parameters) cross ranks.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from paratrain.parallel.data.timing import CommTimer


def data_parallel_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters a data-parallel strategy reduces (and ZeRO shards) over its group:
    all but those another axis owns. Expert parallelism marks its experts `expert_parallel`:
    they differ between the ranks of the data axis, and are reduced over the ranks holding the
    same experts instead (parallel/expert/gradients.py)."""
    return [p for p in module.parameters() if p.requires_grad and not getattr(p, "expert_parallel", False)]


def pieces_of_shard(params, owned, shard_grad: torch.Tensor) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """`params` laid end to end in a flat buffer, of which this rank owns the spans `owned`,
    (start, end, where the span sits in the shard): each parameter's owned part of `shard_grad`."""
    pieces, offset = [], 0
    for param in params:
        end = offset + param.numel()
        for start_owned, end_owned, at in owned:
            low, high = max(offset, start_owned), min(end, end_owned)
            if low < high:
                pieces.append((param, shard_grad[at + low - start_owned : at + high - start_owned]))
        offset = end
    return pieces


class DataParallel:
    def __init__(self, module: torch.nn.Module, group, algo: str = "auto"):
        self.module, self.group, self.algo = module, group, algo
        self.timer = CommTimer()
        self._syncing = True

    @contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communicating."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def make_optimizer(self, build):
        """`build(params)` makes the optimizer; ZeRO gives it only this rank's shard."""
        return build(list(self.module.parameters()))

    def grad_ready(self, param) -> None:
        """`param.grad` was written outside autograd (the pipeline's W pass) and is complete
        for this backward: what autograd's post-accumulate hook would have said."""

    def finish_gradients(self) -> None:
        """After the step's last backward: every rank holds the averaged gradient."""

    # After finish_gradients: whether the gradients the optimizer reads are 1/n shards (ZeRO,
    # FSDP: the global norm sums over replicas) or the same whole on every replica.
    grads_sharded = False

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live: where a scalar reduced over the mesh must be."""
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def gradient_pieces(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, the part of its gradient this rank's optimizer reads), after
        finish_gradients: what the global gradient norm is made of (parallel/grad_norm.py)."""
        return [(p, p.grad) for p in self.module.parameters() if p.grad is not None]

    def gradients_to_scale(self) -> list[torch.Tensor]:
        """The gradient tensors the optimizer reads, to be scaled in place (clipping)."""
        return [grad for _, grad in self.gradient_pieces()]

    def step(self, optimizer) -> None:
        optimizer.step()
        self.after_step()

    def after_step(self) -> None:
        """What follows the optimizer's step (ZeRO gathers the updated shards, local SGD
        averages); a user's own `optimizer.step()` runs it through the library face (train/api.py)."""

    def finish(self) -> None:
        """After the run's last step: what the strategy still owes it (local SGD's replicas
        have drifted apart since the last average)."""

    def zero_grad(self) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.zero_()

    def gathered(self):
        """A context in which the module's parameters are whole (FSDP gathers them: a collective)."""
        return nullcontext()

    def close(self) -> None:
        """Stop what the strategy started besides the group it was given."""
