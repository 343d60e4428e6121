"""Naive data parallelism: backward first, then average every gradient (nothing overlaps).

Two layouts: "flat" copies all gradients into one buffer for a single all-reduce (one
message, the fewest latencies); "per-param" all-reduces each gradient on its own (no copies,
one latency per parameter). Both block the training thread for the whole communication.
"""

from __future__ import annotations

import torch

from paratrain.parallel.data.base import DataParallel, data_parallel_parameters
from paratrain.parallel.data.compression import NoCompression

LAYOUTS = ("flat", "per-param")


class NaiveDataParallel(DataParallel):
    def __init__(self, module, group, algo="auto", layout="flat", compressor=None):
        super().__init__(module, group, algo)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown naive layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        self.layout = layout
        self.compressor = compressor or NoCompression()

    def finish_gradients(self) -> None:
        # Every rank must average the same tensors. A parameter this rank's data did not reach
        # has no gradient here: it counts as zero, as in DDP, so the average is the one over
        # the whole batch.
        params = data_parallel_parameters(self.module)
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grads = [p.grad for p in params]
        if not grads:
            return
        if self.layout == "flat":
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._average(flat, key=0)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        else:
            for key, grad in enumerate(grads):
                self._average(grad.view(-1), key)

    def _average(self, flat: torch.Tensor, key: int) -> None:
        with self.timer.blocking():
            self.compressor.start(self.group, flat, self.algo, key).wait()
