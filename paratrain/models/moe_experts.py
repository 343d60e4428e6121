"""The routed experts of a mixture-of-experts layer, and the seam that brings tokens to them.

`GroupedExperts` holds the SwiGLU experts stacked (w1, w3: (e, D, F); w2: (e, F, D)) and runs
them on tokens already sorted by expert, either as one grouped matrix multiply per weight
(`torch.nn.functional.grouped_mm`, each expert's rows delimited by cumulative offsets) or as a
loop over the experts, the reference. It may hold a contiguous slice of the layer's experts,
`first_expert .. first_expert + local_experts`: that is what expert parallelism gives a rank.

`LocalDispatcher` is the identity: every expert is here. Expert parallelism replaces it with a
dispatcher of the same two methods that sends each expert's rows to the rank holding it.

Shape legend:
    S routed (token, expert) pairs, sorted by expert      D d_model      F d_expert
    E experts of the layer        e experts held here (local_experts)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EXPERT_COMPUTES = ("grouped", "loop")

# Where grouped_mm runs, and in which dtypes: its CPU kernel takes these three; on CUDA it is
# documented for bf16 only; its meta registration (the MFU count) wants bf16 as CUDA does, so a
# meta model takes the loop, whose matrix multiplies the FLOP counter sees.
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
_GROUPED_ALIGN_BYTES = 16  # each row's stride must be a multiple of 16 bytes (the kernel says so)


@dataclass
class Dispatched:
    """What a dispatcher hands the experts: their rows, and what `combine` needs to send the
    results back where the rows came from."""

    tokens_SD: torch.Tensor  # rows for the experts held here, sorted by expert
    counts_e: torch.Tensor  # rows per expert held here, in expert order (sums to S)
    state: object = None  # the dispatcher's own record of where rows came from (None: local)


class LocalDispatcher:
    """Every expert is on this process: dispatch and combine hand the rows through unchanged."""

    def dispatch(self, tokens_SD: torch.Tensor, counts_E: torch.Tensor) -> Dispatched:
        return Dispatched(tokens_SD, counts_E)

    def combine(self, out_SD: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return out_SD


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """grouped_mm's backward refuses a gradient with odd strides (a broadcast one, from a sum,
    has stride 0): hand it a contiguous copy."""
    if y.requires_grad:
        y.register_hook(lambda grad: grad.contiguous())
    return y


class GroupedExperts(nn.Module):
    """SwiGLU experts, `local_experts` of them starting at `first_expert`; weights stacked so
    that one grouped multiply covers every expert."""

    def __init__(self, d_model: int, d_expert: int, n_experts: int, compute: str = "grouped",
                 first_expert: int = 0, local_experts: int | None = None):
        super().__init__()
        if compute not in EXPERT_COMPUTES:
            raise ValueError(f"expert_compute must be one of {', '.join(EXPERT_COMPUTES)}, got {compute!r}")
        self.n_experts, self.compute = n_experts, compute
        self.first_expert = first_expert
        self.local_experts = n_experts - first_expert if local_experts is None else local_experts
        e = self.local_experts
        self.w1 = nn.Parameter(torch.empty(e, d_model, d_expert))  # gate
        self.w3 = nn.Parameter(torch.empty(e, d_model, d_expert))  # up
        self.w2 = nn.Parameter(torch.empty(e, d_expert, d_model))  # down

    def extra_repr(self) -> str:
        e, D, F = self.w1.shape
        return (f"experts {self.first_expert}..{self.first_expert + e - 1} of {self.n_experts}, "
                f"d_model={D}, d_expert={F}, compute={self.compute}")

    def forward(self, tokens_SD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        """Each expert's rows (consecutive, `counts_e` of them, in expert order) through it."""
        if self.compute == "grouped" and self.grouped_fits(tokens_SD):
            return self.compute_grouped(tokens_SD, counts_e)
        return self.compute_loop(tokens_SD, counts_e)

    def grouped_fits(self, tokens_SD: torch.Tensor) -> bool:
        """Whether grouped_mm takes these rows and weights (else the loop runs: fp64, odd widths)."""
        if tokens_SD.dtype not in _GROUPED_DTYPES.get(tokens_SD.device.type, ()):
            return False
        size = tokens_SD.element_size()
        return all(w.dtype == tokens_SD.dtype and (w.shape[-1] * size) % _GROUPED_ALIGN_BYTES == 0
                   for w in (self.w1, self.w2))

    def compute_grouped(self, tokens_SD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        offsets_e = torch.cumsum(counts_e, 0).to(device=tokens_SD.device, dtype=torch.int32)
        gate_SF = _contiguous_grad(F.grouped_mm(tokens_SD, self.w1, offs=offsets_e))
        up_SF = _contiguous_grad(F.grouped_mm(tokens_SD, self.w3, offs=offsets_e))
        return _contiguous_grad(F.grouped_mm(F.silu(gate_SF) * up_SF, self.w2, offs=offsets_e))

    def compute_loop(self, tokens_SD: torch.Tensor, counts_e: torch.Tensor) -> torch.Tensor:
        # unbind, not w1[i]: indexing's backward would write a whole (e, D, F) gradient per expert
        rows = torch.split(tokens_SD, counts_e.tolist())
        outs = [(F.silu(x @ w1) * (x @ w3)) @ w2
                for x, w1, w3, w2 in zip(rows, self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0))]
        return torch.cat(outs) if outs else tokens_SD.new_zeros(0, self.w2.shape[-1])
