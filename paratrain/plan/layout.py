"""One way to lay a model over devices, as the planner prices it: the sizes of its axes, the
schedule, recomputation, sharding and the context- and expert-parallel choices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    recompute: str = "none"      # none | selective | full
    sequence_parallel: bool = False
    zero: int = 0                # ZeRO stage 0-3 (3: FSDP), over dp x cp
    cp: int = 1                  # context parallel: each rank holds 1/cp of every sequence
    cp_method: str = "auto"      # ring | allgather | auto (the cheaper, cost_model.context_choice): how K/V reach every cp rank
    ep: int = 1                  # expert parallel, from dp x cp: each rank holds 1/ep of every MoE layer's experts

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: gradients are reduced, and ZeRO shards, over them."""
        return self.dp * self.cp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        text = f"tp{self.tp} pp{self.pp}" + (f" cp{self.cp}" + ("ag" if self.cp_method == "allgather" else "") if self.cp > 1 else "") + f" dp{self.dp}"
        text += (f" ep{self.ep}" if self.ep > 1 else "") + f" mb{self.micro_batch}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        text += f" rc:{self.recompute}" + (" sp" if self.sequence_parallel else "") + (f" zero{self.zero}" if self.zero else "")
        return text
