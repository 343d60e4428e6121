"""The experts' gradients: reduced over the ranks that hold the same experts.

A data-parallel strategy averages a replicated parameter's gradient over the R = dp x cp ranks
that hold it: the mean over ranks of each rank's loss (every rank's loss the mean over its own
tokens) is the global batch's. An expert is held by one rank of each ep group, and its gradient
there already sums what every rank of that group sent it (the dispatch's backward brings it
home). So the global batch's gradient of an expert is the sum over the edp ranks (those
holding it, one per ep group) divided by R, not by the edp size: that is what `finish` does,
in one all-reduce of all the experts' gradients laid end to end.
"""

from __future__ import annotations

import torch

from paratrain.parallel.grad_norm import expert_parameters


class ExpertGradients:
    def __init__(self, module: torch.nn.Module, edp_group, replicas: int):
        self.params = expert_parameters(module)
        self.edp, self.replicas = edp_group, replicas

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward: each expert's gradient, the global batch's."""
        if not self.params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.edp.size > 1:
            self.edp.all_reduce(flat, "sum")
        flat /= self.replicas
        offset = 0
        for param in self.params:
            end = offset + param.numel()
            param.grad = flat[offset:end].view_as(param).clone()
            offset = end

    def zero_grad(self) -> None:
        """Before the next step's backward: whatever the strategy clears, the experts start
        from no gradient."""
        for param in self.params:
            param.grad = None
