"""`--cp-method auto`: the planner's cost model picks the ring or the all-gather for this run.

The choice is made from the run's config alone (model shape, layout, micro-batch) on a hardware
profile: `cpu-2core` on a CPU, the shipped H100 profile under CUDA (give the ring or the
all-gather by name to overrule it). Every rank computes the same choice from the same config, so
no rank has to tell the others, and `train --plan-only` prints it before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_PROFILE = "cpu-2core"  # fitted to this project's CPU machines (plan/hardware/cpu-2core.yaml)
GPU_PROFILE = "h100-80gb-ndr"


@dataclass(frozen=True)
class ContextPlan:
    method: str  # ring | allgather: what the run uses
    lines: list[str]  # what the planner says about it, for --plan-only and the banner


def profile_name() -> str:
    import torch

    return GPU_PROFILE if torch.cuda.is_available() else CPU_PROFILE


def run_layout(config, world: int):
    """The run's layout as the planner sees it (plan.layout.Layout): axes, micro-batch, schedule,
    recomputation, ZeRO stage, cp and ep."""
    from paratrain.plan.layout import Layout

    par = config.parallel
    dp = world // par.replica_ranks
    split = par.microbatches if par.pp > 1 else par.grad_accum
    return Layout(par.tp, par.pp, dp, max(config.data.global_batch // (dp * split), 1), schedule=par.schedule,
                  virtual_stages=par.virtual_stages, recompute="full" if par.checkpoint_activations else "none",
                  sequence_parallel=par.sequence_parallel, zero=par.zero, cp=par.cp, ep=par.ep)


def context_plan(config, world: int) -> ContextPlan:
    """The run's context-parallel method (`auto` resolved) and the planner's lines on it; a model
    the planner cannot price (not a GPT or Llama) keeps the ring under `auto`, and says so."""
    from paratrain.models import GPTConfig, LlamaConfig, model_config
    from paratrain.plan.cost_model import context_choice
    from paratrain.plan.hardware import load_profile
    from paratrain.plan.shapes import GPTShape

    par = config.parallel
    shape_config = model_config(config.model.name, **config.model.overrides)
    if not isinstance(shape_config, (GPTConfig, LlamaConfig)):
        method = "ring" if par.cp_method == "auto" else par.cp_method
        return ContextPlan(method, [f"context parallel: {method} (the planner prices GPT and Llama shapes only; "
                                    "auto keeps the ring)"])
    layout = run_layout(config, world)
    profile = load_profile(profile_name())
    choice = context_choice(GPTShape.from_config(shape_config), layout, profile)
    method = choice.method if par.cp_method == "auto" else par.cp_method
    return ContextPlan(method, choice.describe(par.cp_method, f"profile {profile.name}"))
