"""PyTorch's own DistributedDataParallel, the reference our DDP is measured against.

It needs a torch.distributed process group: the process launcher's, or on the threads
launcher a gloo group the fabric builds for its threads. A communication hook (same
all-reduce-then-divide as DDP's default) timestamps each bucket so that its communication
time is measured the same way as ours.
"""

from __future__ import annotations

import inspect
import time

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paratrain.parallel.data.base import DataParallel


class TorchDataParallel(DataParallel):
    """zero=True: the optimizer is PyTorch's ZeroRedundancyOptimizer (ZeRO-1: each rank keeps
    the state of its share of the parameters and broadcasts them after its step), the peer
    our ZeRO-1 is measured against."""

    def __init__(self, module, group, process_group, bucket_mb=25.0, zero=False):
        super().__init__(module, group)
        self.process_group, self.zero = process_group, zero
        self.size = dist.get_world_size(process_group)
        self.ddp = DistributedDataParallel(module, process_group=process_group, bucket_cap_mb=bucket_mb)
        self.ddp.register_comm_hook(process_group, self._timed_all_reduce)
        self.module = self.ddp  # forward goes through DDP so that its reducer sees backward
        self._last_grad = 0.0
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._note_grad)

    def _note_grad(self, param) -> None:
        self._last_grad = time.perf_counter()

    def _timed_all_reduce(self, process_group, bucket):
        started = time.perf_counter()
        buffer = bucket.buffer().div_(self.size)
        future = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()

        def done(fut):
            self.timer.ran(started, time.perf_counter())
            return fut.value()[0]

        return future.then(done)

    def make_optimizer(self, build):
        params = list(self.ddp.module.parameters())
        optimizer = build(params)
        if not self.zero:
            return optimizer
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # The same optimizer, built again by ZeRO on each rank's share: its constructor's
        # arguments from the one `build` made (defaults also holds keys it does not take).
        accepted = inspect.signature(type(optimizer).__init__).parameters
        options = {key: value for key, value in optimizer.defaults.items() if key in accepted}
        return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer),
                                       process_group=self.process_group, **options)

    def no_sync(self):
        return self.ddp.no_sync()

    def finish_gradients(self) -> None:
        # DDP's backward() already waited for its buckets: what followed the last gradient
        # was communication that compute could not hide.
        if self._last_grad:
            self.timer.exposed_s += max(0.0, time.perf_counter() - self._last_grad)
            self._last_grad = 0.0

    def zero_grad(self) -> None:
        for param in self.ddp.module.parameters():
            if param.grad is not None:
                param.grad.zero_()
