"""Pipeline receives are posted ahead: while a rank computes one action, the receive of the
next action that needs data from another rank is already posted, so the peer's send goes
out at once (gloo sends only to a posted receive). Counted, not timed."""

from __future__ import annotations

import pytest

from paratrain import run
from paratrain.parallel.pipeline import pp_comms
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
def test_after_the_first_step_only_each_ranks_opening_receive_is_posted_late(monkeypatch, schedule, pp, extra):
    """The first step also learns each chunk's activation shape (the header); from then on a
    receive is posted late only where nothing precedes it in the step: on every rank but the
    first, whose first action is a forward on data from the rank before."""
    counts = _count_receives(monkeypatch)
    one = _receives(counts, schedule, pp, extra, steps=1)
    three = _receives(counts, schedule, pp, extra, steps=3)
    later_steps = {kind: three[kind] - one[kind] for kind in one}
    assert later_steps["late"] == 2 * (pp - 1), (one, three)
    assert later_steps["ahead"] > 2 * later_steps["late"], (one, three)
