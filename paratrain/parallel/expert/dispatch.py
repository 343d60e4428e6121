"""Tokens to the ranks that hold their experts, and back: expert parallelism's dispatch and combine.

Each of the `ep` ranks of the group holds `local_experts` consecutive experts (rank r: experts
r·local .. (r+1)·local − 1). A token whose router chose k experts needs the ranks those experts
live on: it is sent ONCE to each such rank, not once per chosen expert (two chosen experts on
one rank cost one row), with, per choice, the expert's local index there (−1: not this rank's)
and its gate weight. The receiving rank runs the row through each of its chosen local experts
(one grouped call over all of them), sums those outputs weighted by their gates, and sends that
one partial sum back; the sender adds the partial sums of a token's ranks. So the bytes of a
dispatch are rows × d_model, rows = Σ over tokens of the ranks they need, and the combine
returns as many.

    rank i                                       rank j (holds experts j·L .. j·L+L−1)
    x_ND ─ rows needing j ─ all_to_all ────────► rows from i ─ expand per local choice ─ experts
    out_ND ◄── index_add ◄── all_to_all ◄─────── Σ gate·expert(row) per row ◄─────────────┘

Gradients follow the same paths back (`ep_comms.all_to_all_rows`): a row's, the gates' (sent
beside the rows) and the experts' parameters' (local to their rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from paratrain.parallel.expert.ep_comms import all_to_all_rows, exchange_rows


@dataclass(frozen=True)
class DispatchCounts:
    """What one dispatch moved: rows this rank sent to each rank (itself included) and how many
    (token, expert) choices those rows carried."""

    rows_to: tuple[int, ...]
    choices: int

    @property
    def rows(self) -> int:
        return sum(self.rows_to)


def _rows_per_rank(experts_NK: torch.Tensor, ep: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token index, destination rank) of every row to send, ordered by destination then token.
    A choice of expert −1 (dropped over capacity) needs no rank."""
    kept_NK = experts_NK >= 0
    needs_NR = torch.zeros(experts_NK.shape[0], ep, dtype=torch.bool, device=experts_NK.device)
    needs_NR[torch.nonzero(kept_NK, as_tuple=True)[0], (experts_NK[kept_NK] // local_experts)] = True
    rank_S, token_S = torch.nonzero(needs_NR.t(), as_tuple=True)  # row-major over (rank, token)
    return token_S, rank_S


def expert_parallel(x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor, group,
                    local_experts: int, run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                    ) -> tuple[torch.Tensor, DispatchCounts]:
    """Σ_k weights[n, k] · expert_{experts[n, k]}(x[n]) for every token n, the experts spread
    over `group`; `run_experts(rows_MD, counts_L)` computes this rank's experts on rows sorted
    by local expert (counts_L rows each). Returns the output and what was sent."""
    ep, rank = group.size, group.rank
    token_S, rank_S = _rows_per_rank(experts_NK, ep, local_experts)
    send_R = torch.bincount(rank_S, minlength=ep)
    with torch.no_grad():  # counts and expert indices: no gradient, and collectives write in place
        receive_R = exchange_rows(send_R.view(ep, 1), group, [1] * ep, [1] * ep).view(ep)
    sends, receives = send_R.tolist(), receive_R.tolist()
    # Per row, each of the token's k choices as the destination sees it: its local expert, or −1.
    chosen_SK = experts_NK[token_S]
    here_SK = (chosen_SK >= 0) & (chosen_SK // local_experts == rank_S.unsqueeze(1))
    local_SK = torch.where(here_SK, chosen_SK - rank_S.unsqueeze(1) * local_experts, -1)
    gates_SK = weights_NK[token_S] * here_SK  # a choice elsewhere weighs nothing here
    rows_MD = all_to_all_rows(x_ND[token_S], group, receives, sends)
    gates_MK = all_to_all_rows(gates_SK, group, receives, sends)
    with torch.no_grad():
        local_MK = exchange_rows(local_SK, group, receives, sends)
    partial_MD = _run_local(rows_MD, local_MK, gates_MK, local_experts, run_experts)
    back_SD = all_to_all_rows(partial_MD, group, sends, receives)
    out_ND = torch.zeros_like(x_ND).index_add(0, token_S, back_SD.to(x_ND.dtype))
    return out_ND, DispatchCounts(tuple(sends), int((experts_NK >= 0).sum()))


def _run_local(rows_MD, local_MK, gates_MK, local_experts: int, run_experts) -> torch.Tensor:
    """Each received row through each of its chosen local experts, in one call sorted by
    expert, summed per row with the gates."""
    row_C, slot_C = torch.nonzero(local_MK >= 0, as_tuple=True)
    expert_C = local_MK[row_C, slot_C]
    order_C = torch.argsort(expert_C, stable=True)
    row_C, slot_C, expert_C = row_C[order_C], slot_C[order_C], expert_C[order_C]
    counts_L = torch.bincount(expert_C, minlength=local_experts)
    out_CD = run_experts(rows_MD[row_C], counts_L)
    weighted_CD = out_CD * gates_MK[row_C, slot_C].unsqueeze(1).to(out_CD.dtype)
    return torch.zeros(rows_MD.shape[0], out_CD.shape[1], dtype=out_CD.dtype,
                       device=rows_MD.device).index_add(0, row_C, weighted_CD)
