"""Pipeline receives are posted ahead: in the first step while a rank computes the action
before, from then on all of a step's at its start, so the peer's send goes out at once (gloo
sends only to a posted receive). Counted, not timed."""

from __future__ import annotations

import pytest

from paratrain import run
from paratrain.parallel.pipeline import pp_comms
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.train.loop import train_rank
from tests.test_parallel_3d import config_for


def _count_receives(monkeypatch):
    counts = {"ahead": 0, "late": 0}
    original = pp_comms.PipelineLink._posted_receive

    def counted(self, tag):
        buffer = original(self, tag)
        counts["ahead" if buffer is not None else "late"] += 1
        return buffer

    monkeypatch.setattr(pp_comms.PipelineLink, "_posted_receive", counted)
    return counts


def _receives(counts, schedule, pp, extra, steps) -> dict:
    before = dict(counts)
    config = config_for(1, pp, 1, schedule, 4, extra)
    config.steps = steps
    run(train_rank, pp, args=(config,))
    return {kind: counts[kind] - before[kind] for kind in counts}


@pytest.mark.parametrize("schedule, pp, extra", [
    ("1f1b", 2, {}), ("gpipe", 4, {}), ("interleaved-1f1b", 2, {"virtual_stages": 2}),
    ("zb-h1", 2, {}), ("zb-v", 2, {"virtual_stages": 2}),
])
def test_after_the_first_step_every_receive_is_posted_before_it_is_needed(monkeypatch, schedule, pp, extra):
    """The first step also learns each message's shape (an activation's header; a gradient has
    the shape of the activation sent); its receives are posted one action ahead, except where
    the shape is not known yet: each chunk's first activation. From the second
    step on, all of a step's receives are posted before its first action, so none is late."""
    counts = _count_receives(monkeypatch)
    one = _receives(counts, schedule, pp, extra, steps=1)
    three = _receives(counts, schedule, pp, extra, steps=3)
    later_steps = {kind: three[kind] - one[kind] for kind in one}
    layout = build_schedule(schedule, pp, 4, extra.get("virtual_stages", 1))
    crossings = sum(layout.owner(c - 1) != layout.owner(c) for c in range(1, layout.num_chunks))
    assert one["late"] == crossings, one  # each chunk's first activation from another rank: its header
    assert later_steps["late"] == 0, (one, three)
    assert later_steps["ahead"] == 2 * one["ahead"] + 2 * one["late"], (one, three)
