"""Auto-sharding: where a tensor created outside any signal goes when no one said.

With `GT_AUTO_SHARD=1` (or `PARATRAIN_AUTO_SHARD=1`, or `paratrain serve --auto-shard`) and
several workers, a tensor created or uploaded outside any signal's region, and not pinned with
`gt.worker(k)`, is split over every live worker when it is large: at least `min_bytes` (default
4 MiB, `--auto-shard-min-bytes` / `PARATRAIN_AUTO_SHARD_MIN_BYTES`), along its first axis whose
length the number of workers divides, axis 0 (the batch) first. Everything smaller (parameters,
biases, scalars, most of what a program makes besides its data) stays whole on the client's home
worker, exactly as without auto-sharding. The threshold is where splitting paid when measured:
each split operation costs one instruction per worker instead of one, and a weight that meets a
split activation costs a copy per worker and an all-reduce of its gradient: a fixed cost per
step that only a large enough batch repays (where the crossing lies depends on the machine and
its load; `bench frontend` measures it, docs/results.md). Equal parts only (a
length the workers divide) keep the work balanced and let reshapes stay split. Operations then follow the layouts (`sharding.decide`): an operation
runs on the workers of its split input, so a small weight is copied to them and, through
Megatron's f, its gradient is summed over the parts and sent home (data parallelism); a large
weight that was split itself is gathered for the product and its gradient summed and split
again (FSDP's pattern); a reduction over the split axis is a partial sum all-reduced, and
anything without a rule gathers first. Values equal a one-worker run up to the order of float
sums; random tensors that are split draw each part on its own worker (same distribution, other
numbers than one worker would draw).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.frontend.dispatcher.sharding import Placement
from paratrain.frontend.ops import ITEM_SIZES

DEFAULT_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class AutoShard:
    min_bytes: int = DEFAULT_MIN_BYTES  # tensors smaller than this stay whole on one worker

    def placement(self, shape, dtype: str, workers: tuple[int, ...]) -> Placement | None:
        """The split layout for a new tensor, or None: leave it whole where it would go."""
        n = len(workers)
        if n < 2 or math.prod(shape) * ITEM_SIZES[dtype] < self.min_bytes:
            return None
        for axis, length in enumerate(shape):
            if length >= n and length % n == 0:
                return Placement(workers, axis)
        return None
