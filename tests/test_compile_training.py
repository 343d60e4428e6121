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
from paratrain.train.validate import problems_with


def train_and_return_state(group, config):
    return train_rank(group, config, return_state=True)


def test_a_compiled_run_on_two_ranks_trains_like_one_process(monkeypatch):
    """Every graph is compiled in the first compiled step (the third) and none after it: the
    memory sampling's hooks, whose flag flips for the last step, stay outside the compiled layers.
    A backend that counts records the step of each compile, then hands the graph to aot_eager
    (PARATRAIN_COMPILE_BACKEND's, checked below): traced and differentiated as inductor would,
    without a C++ compile per kernel (a minute of CPU where inductor's cache is cold, as on CI)."""
    from torch._dynamo.backends.registry import lookup_backend

    steps, compiled_at, real_compile = threading.local(), [], torch.compile
    real_step = Prepared.forward_backward

    def counted_step(self, *args, **kwargs):
        steps.done = getattr(steps, "done", 0) + 1
        return real_step(self, *args, **kwargs)

    def counting(backend):
        def compile_counted(graph, example_inputs):
            compiled_at.append(steps.done)
            return lookup_backend(backend)(graph, example_inputs)
        return compile_counted

    monkeypatch.setattr(Prepared, "forward_backward", counted_step)
    monkeypatch.setattr(torch, "compile", lambda function, backend: real_compile(function, backend=counting(backend)))
    monkeypatch.setenv("PARATRAIN_COMPILE_BACKEND", "aot_eager")
    config = apply_overrides(TrainConfig(), {"model.name": "gpt-tiny", "steps": 4, "log_every": 100,
                                             "data.global_batch": 8, "parallel.compile": True})
    results = paratrain.run(train_and_return_state, 2, args=(config,))
    assert [entry["compiled"] for entry in results[0]["log"]] == [False, False, True, True]
    report = compare(config, results, reference_run(config))
    assert passes(report, tolerances(config)), report
    summary = results[0]["summary"]
    assert summary["compiled_step_ms"] > 0 and summary["eager_step_ms"] > 0
    assert compiled_at and set(compiled_at) == {3}, compiled_at


def test_a_compile_backend_torch_does_not_have_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("PARATRAIN_COMPILE_BACKEND", "inductr")
    config = apply_overrides(TrainConfig(), {"model.name": "gpt-tiny", "parallel.compile": True})
    problems = problems_with(config, 2)
    assert any(p.startswith("PARATRAIN_COMPILE_BACKEND 'inductr' is not a torch.compile backend; valid: ") and
               "inductor" in p for p in problems), problems


def test_the_summary_compares_eager_and_compiled_steps_after_each_ones_first():
    log = [{"step_ms": ms, "compiled": on} for ms, on in
           [(900, False), (100, False), (5000, True), (50, True), (50, True)]]
    assert compile_summary(log) == {"eager_step_ms": 100, "compiled_step_ms": 50, "first_compiled_step_ms": 5000,
                                    "compile_speedup": 2.0}
    assert compile_summary(log[:3]) == {}  # too few compiled steps to tell
