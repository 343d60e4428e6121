"""`train --profile DIR`: one trace.json that json.load reads, with every rank's profiled steps
and our collectives as named ranges, on threads (one profiler for the process) and processes
(one per process, joined by rank 0)."""

from __future__ import annotations

import collections
import json

import pytest

import paratrain
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.profile import profiled_steps
from paratrain.train.validate import problems_with


def profile_config(directory, **overrides) -> TrainConfig:
    base = {"model.name": "gpt-tiny", "model.n_layer": 2, "steps": 4, "log_every": 100, "data.global_batch": 8,
            "profile": str(directory)}
    return apply_overrides(TrainConfig(), {**base, **overrides})


def named(events, prefix):
    return collections.Counter((e["name"], e["pid"], e["tid"]) for e in events if e.get("name", "").startswith(prefix))


@pytest.mark.parametrize("launcher, world, overrides", [
    pytest.param("threads", 4, {"parallel.tp": 2}, id="threads-dp2-tp2"),
    pytest.param("processes", 2, {}, id="processes-dp2"),
])
def test_the_trace_holds_every_ranks_steps_and_our_all_reduces(tmp_path, launcher, world, overrides):
    config = profile_config(tmp_path / "profile", **overrides)
    paratrain.run(train_rank, world, launcher=launcher, args=(config,))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["trace.json"]  # the parts joined, removed
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    ranks = {entry["rank"]: (entry["pid"], entry["tid"]) for entry in trace["ranks"]}
    assert sorted(ranks) == list(range(world))
    events = trace["traceEvents"]
    steps = named(events, "step ")
    for rank, (pid, tid) in ranks.items():  # steps 1 and 2 (after the first), on every rank's own thread
        assert steps[("step 1", pid, tid)] == 1 and steps[("step 2", pid, tid)] == 1, (rank, steps)
    assert not any(name in ("step 0", "step 3") for name, _, _ in steps)
    all_reduces = named(events, "paratrain.all_reduce")
    assert {pid for _, pid, _ in all_reduces} == {pid for pid, _ in ranks.values()}
    if launcher == "threads":  # tp's all-reduces run on the rank threads themselves
        assert {tid for _, _, tid in all_reduces} >= {tid for _, tid in ranks.values()}
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    process_names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    for rank, (pid, tid) in ranks.items():
        assert thread_names.get(tid) == f"rank {rank}" or process_names[pid] == f"rank {rank}"


def test_the_profiled_steps_skip_the_first_and_fit_the_run():
    assert profiled_steps(0, 10, 2) == range(1, 3)
    assert profiled_steps(0, 2, 5) == range(1, 2)
    assert profiled_steps(0, 1, 2) == range(0, 1)
    assert profiled_steps(6, 10, 2) == range(7, 9)  # resumed at step 6


def test_profile_steps_below_one_is_one_line(tmp_path):
    assert problems_with(profile_config(tmp_path, profile_steps=0), 2) == ["profile_steps must be an integer >= 1, got 0"]
