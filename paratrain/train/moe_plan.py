"""What the planner says about a run's mixture of experts, for `train --plan-only` and the banner.

Total against active parameters, and under expert parallelism the rows a token is dispatched as
(each token once per rank holding any of its experts, plan/moe.py) and the all-to-alls' time per
step, from the planner's prediction of the run's layout on the local hardware profile (the one
train/context_method.py prices `--cp-method auto` on).
"""

from __future__ import annotations


def moe_plan_lines(config, world: int) -> list[str]:
    """The planner's lines on the run's experts; none for a model without experts."""
    from paratrain.models import MoEConfig, model_config
    from paratrain.plan.cost_model import predict
    from paratrain.plan.hardware import load_profile
    from paratrain.plan.moe import describe_dispatch, describe_experts
    from paratrain.plan.shapes import GPTShape
    from paratrain.train.context_method import profile_name, run_layout

    moe_config = model_config(config.model.name, **config.model.overrides)
    if not isinstance(moe_config, MoEConfig):
        return []
    shape = GPTShape.from_config(moe_config)
    lines = [describe_experts(shape)]
    par = config.parallel
    if par.ep == 1:
        return lines
    layout = run_layout(config, world)
    profile = load_profile(profile_name())
    try:
        ep_comm = predict(shape, layout, profile, config.data.global_batch).breakdown["ep_comm"]
    except ValueError as error:  # a layout the planner's schedules or splits refuse
        return lines + [f"expert parallel ep {par.ep}: the planner cannot price this layout ({error})"]
    return lines + [describe_dispatch(shape, layout, ep_comm, f"profile {profile.name}")]
