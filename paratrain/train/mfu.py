"""Model FLOPs utilization: the FLOPs a step's model needs over what the devices could do in it.

    MFU = model FLOPs per step / (step time x ranks x peak FLOP/s per device)

Model FLOPs are counted, not modelled: one forward and backward of the single-device model on a
global batch, on the meta device (shapes only, nothing computed), under PyTorch's
`FlopCounterMode`, which counts matrix multiplies, convolutions and attention (2 FLOPs per
multiply-add). So every model has them, a user's file and the CNN included, and they are the
model's, whatever the layout: recomputation, pipeline bubbles and communication are not in
them, as MFU wants (Chowdhery et al. 2022). For our GPT and Llama they equal the planner's
formula (paratrain/plan/flops.py, the Megatron papers' count, causal attention over the full
s x s as both count it; tests/test_mfu.py).

The peak is per device, in the precision trained in (`--peak-tflops`; `paratrain plan
--hardware NAME` shows a profile's): without it the summary gives the TFLOP/s achieved per rank.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from paratrain.models import MODEL_NAMES
from paratrain.models.meta import on_meta
from paratrain.train.setup import build_seeded_model


# Counting runs the model once on the meta device, a tenth of a second or more at the end of every
# run. Runs in one process (a notebook, a sweep, a test suite) often repeat a configuration, so the
# count of one of our presets on one of our datasets is kept, keyed by everything it depends on:
# the model and its overrides, and the batch's shape. A user's model file or data (whose loss is
# theirs) may change between runs, so theirs are counted each time.
_KEPT_COUNTS: dict[tuple, float] = {}
_KEPT_AT_MOST = 256


def model_flops_per_step(model_name: str, overrides: dict, dataset, global_batch: int) -> float:
    """FLOPs of one optimizer step on `global_batch` samples of `dataset` (forward and backward)."""
    inputs, targets = dataset.global_batch(0, global_batch)
    key = None
    if model_name in MODEL_NAMES and getattr(dataset, "name", "user") != "user":
        key = (model_name, repr(sorted(overrides.items())), type(dataset), tuple(inputs.shape), inputs.dtype,
               tuple(targets.shape), targets.dtype)
        if key in _KEPT_COUNTS:
            return _KEPT_COUNTS[key]
    with on_meta():
        model = build_seeded_model(model_name, overrides, seed=0)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = dataset.loss(model(inputs.to("meta")), targets.to("meta"))
        loss.backward()
    flops = float(counter.get_total_flops())
    if key is not None:
        if len(_KEPT_COUNTS) >= _KEPT_AT_MOST:
            _KEPT_COUNTS.clear()
        _KEPT_COUNTS[key] = flops
    return flops


def utilization(flops_per_step: float, step_ms: float, ranks: int, peak_tflops: float | None) -> dict:
    """What the summary reports: achieved TFLOP/s per rank, and MFU when the peak is known."""
    per_rank = flops_per_step / (step_ms / 1e3) / ranks / 1e12
    result = {"model_flops_per_step": flops_per_step, "tflops_per_rank": per_rank}
    if peak_tflops:
        result.update(mfu=per_rank / peak_tflops, peak_tflops=peak_tflops)
    return result
