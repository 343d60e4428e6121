"""--compile: the layers through torch.compile after two eager steps; the run still trains the
single-process model (fp32 tolerances), and the summary gives eager and compiled step times."""

from __future__ import annotations

import threading

import torch

import paratrain
from paratrain.train.api import Prepared
from paratrain.train.check import compare, passes, tolerances
from paratrain.train.compiled import compile_summary
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank
from paratrain.train.reference import reference_run


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


def test_a_compiled_run_on_two_ranks_trains_like_one_process(monkeypatch):
    """Every graph is compiled in the first compiled step (the third) and none after it: the
    memory sampling's hooks, whose flag flips for the last step, stay outside the compiled layers.
    A backend that counts, then hands the graph to inductor, records the step of each compile."""
    from torch._inductor.compile_fx import compile_fx

    steps, compiled_at, real_compile = threading.local(), [], torch.compile
    real_step = Prepared.forward_backward

    def counted_step(self, *args, **kwargs):
        steps.done = getattr(steps, "done", 0) + 1
        return real_step(self, *args, **kwargs)

    def counting_inductor(graph, example_inputs):
        compiled_at.append(steps.done)
        return compile_fx(graph, example_inputs)

    monkeypatch.setattr(Prepared, "forward_backward", counted_step)
    monkeypatch.setattr(torch, "compile", lambda function, **options: real_compile(function, backend=counting_inductor, **options))
    config = apply_overrides(TrainConfig(), {"model.name": "gpt-tiny", "steps": 4, "log_every": 100,
                                             "data.global_batch": 8, "parallel.compile": True})
    results = paratrain.run(train_and_return_state, 2, args=(config,))
    assert [entry["compiled"] for entry in results[0]["log"]] == [False, False, True, True]
    report = compare(config, results, reference_run(config))
    assert passes(report, tolerances(config)), report
    summary = results[0]["summary"]
    assert summary["compiled_step_ms"] > 0 and summary["eager_step_ms"] > 0
    assert compiled_at and set(compiled_at) == {3}, compiled_at


def test_the_summary_compares_eager_and_compiled_steps_after_each_ones_first():
    log = [{"step_ms": ms, "compiled": on} for ms, on in
           [(900, False), (100, False), (5000, True), (50, True), (50, True)]]
    assert compile_summary(log) == {"eager_step_ms": 100, "compiled_step_ms": 50, "first_compiled_step_ms": 5000,
                                    "compile_speedup": 2.0}
    assert compile_summary(log[:3]) == {}  # too few compiled steps to tell
