"""The precisions a run trains in, and dynamic loss scaling for fp16 over every shard of every layout.

fp32 trains in fp32; bf16 and fp16 run forward and loss under autocast in that dtype (the
weights, their gradients and the optimizer stay fp32; FSDP gathers and reduce-scatters in it).


fp16 keeps 10 bits of mantissa and 5 of exponent: gradients below 6e-8 vanish. So the loss is
multiplied by a large scale before backward (every gradient with it), and the gradients the
optimizer reads are divided by it again before the step. When a gradient overflows (inf or
NaN), the step is skipped and the scale halved; after `growth_interval` steps without one it
doubles. These are torch.amp.GradScaler's rules and defaults (2^16, x2 every 2000 steps, /2),
which the single-process reference uses, so both skip the same steps.

GradScaler looks at the gradients its own optimizer holds. Here they are spread over the mesh
(ZeRO and FSDP shards, tensor and pipeline parallel parts): one rank can overflow while another
does not, and every rank must skip the same step, or replicas diverge and collectives go out
of step. So the overflow is all-reduced over the whole world before anyone decides.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch

# precision -> autocast's dtype (None: fp32, no autocast)
COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(COMPUTE_DTYPES)


def compute_dtype(precision: str):
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device: torch.device) -> Callable[[], ContextManager]:
    """A factory of the context forward and loss run in: autocast in bf16 or fp16, nothing for
    fp32. Training, the pipeline, evaluation and the reference all enter this one."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._good_steps = 0
        self.skipped = 0

    @torch.no_grad()
    def unscale(self, dp, world) -> bool:
        """Divide the gradients the optimizer is about to read by the scale; False (and nothing
        divided) when any rank's overflowed: the step must be skipped. A collective over `world`."""
        local = any(not torch.isfinite(grad).all() for _, grad in dp.gradient_pieces())
        overflow = torch.tensor([1.0 if local else 0.0], device=dp.device)
        if world.size > 1:
            world.all_reduce(overflow, "sum")
        if overflow.item() > 0:
            return False
        inverse = 1.0 / self.scale  # a power of two: dividing is exact
        for grad in dp.gradients_to_scale():
            grad.mul_(inverse)
        return True

    def update(self, stepped: bool) -> None:
        if not stepped:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            self.skipped += 1
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

