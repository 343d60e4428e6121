"""The routed experts of a mixture-of-experts layer, and the seam that brings tokens to them.

`GroupedExperts` holds the SwiGLU experts stacked (w1, w3: (e, D, F); w2: (e, F, D)) and runs
them on tokens already sorted by expert, either as one grouped matrix multiply per weight
(`torch.nn.functional.grouped_mm`, each expert's rows delimited by cumulative offsets; on the
CPU the experts in chunks, one per thread, moe_grouped.py) or as a loop over the experts, the
reference. It may hold a contiguous slice of the layer's experts,
`first_expert .. first_expert + local_experts`: that is what expert parallelism gives a rank.

`LocalDispatcher` runs the routed part with every expert here. Expert parallelism replaces it
with a dispatcher of the same method (parallel/expert/apply.py) that sends each token to the
ranks holding its experts, once per rank.

Shape legend:
    S routed (token, expert) pairs, sorted by expert      D d_model      F d_expert
    E experts of the layer        e experts held here (local_experts)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.models.moe_grouped import grouped_swiglu

EXPERT_COMPUTES = ("grouped", "loop")

# Where grouped_mm runs, and in which dtypes: its CPU kernel takes these three; on CUDA it is
# documented for bf16 only; its meta registration (the MFU count) wants bf16 as CUDA does, so a
# meta model takes the loop, whose matrix multiplies the FLOP counter sees.
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}
_GROUPED_ALIGN_BYTES = 16  # each row's stride must be a multiple of 16 bytes (the kernel says so)


class LocalDispatcher:
    """Every expert is on this process: the kept (token, expert) pairs sorted by expert, through
    the experts in one call, weighted by their gates and summed back per token."""

    def routed(self, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor,
               experts: GroupedExperts) -> torch.Tensor:
        N, K = experts_NK.shape
        pairs_S, counts_E = expert_order(experts_NK.reshape(-1), experts.local_experts)
        out_SD = experts(x_ND[pairs_S // K], counts_E)
        weights_S1 = weights_NK.reshape(-1)[pairs_S].unsqueeze(1).to(out_SD.dtype)
        # Each pair written to its own row, then each token's K rows summed: the same order of
        # addition on every device (a scatter-add's is its kernel's); dropped pairs stay zero.
        out_PD = out_SD.new_zeros(N * K, out_SD.shape[1]).index_copy(0, pairs_S, out_SD * weights_S1)
        return out_PD.view(N, K, -1).sum(1)


def expert_order(experts_P: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept pairs (indices into the flattened (N K) choices; a dropped one is expert −1)
    sorted by expert, stably (so in token order within an expert), and the pairs per expert.

    On the meta device (the MFU count, shape checks) a choice has no values: every pair is kept
    and spread evenly over the experts, the FLOPs of a balanced dropless step; the counts are on
    the CPU, where the expert loop can read them."""
    if experts_P.is_meta:
        P, E = experts_P.numel(), n_experts
        return torch.arange(P, device=experts_P.device), torch.tensor([P // E + (i < P % E) for i in range(E)])
    kept_S = (experts_P >= 0).nonzero().squeeze(1)
    experts_S = experts_P[kept_S]
    pairs_S = kept_S[torch.sort(experts_S, stable=True).indices]
    return pairs_S, torch.bincount(experts_S, minlength=n_experts)


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
        if tokens_SD.device.type == "cpu" and not torch.is_autocast_enabled("cpu"):
            return grouped_swiglu(tokens_SD, self.w1, self.w3, self.w2, counts_e.tolist())  # in chunks on threads
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
