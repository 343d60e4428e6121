"""The machine's memory-copy bandwidth: the physical ceiling to hold busbw against on one host.

On one host every byte a collective moves is, in the end, a memory copy (the fabric copies
straight between ranks' tensors; gloo through shared memory or loopback sockets), so busbw
near `dst.copy_(src)`'s bandwidth means the algorithm is as good as the machine allows.
Reported as bytes copied per second, the way busbw counts bytes over a link. The planner's
calibration (calibrate.py) measures it too, which is why it lives here, below bench/.
"""

from __future__ import annotations

import time

import torch

# Well past the last-level cache of common CPUs, so the copy goes to memory, not cache.
DEFAULT_BYTES = 256 << 20
DEFAULT_REPEATS = 10


def copy_bandwidth_gbps(device: str | torch.device = "cpu", nbytes: int = DEFAULT_BYTES,
                        repeats: int = DEFAULT_REPEATS) -> float:
    """Best of `repeats` timed copies of `nbytes`, in GB/s (1e9 bytes per second)."""
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch maps the pages; that cost is not bandwidth
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
