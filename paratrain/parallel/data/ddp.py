"""Our DDP: gradients are averaged bucket by bucket while backward is still running.

Each parameter gets a hook that fires once its gradient has been accumulated. When every
parameter of a bucket has fired, the bucket's all-reduce starts on the group's communication
thread, and backward carries on computing earlier layers' gradients meanwhile. Buckets start
strictly in order (0, 1, 2, ...) so all ranks issue the same collectives in the same order.
`finish_gradients` waits for the ones still in flight: only that wait is exposed.
"""

from __future__ import annotations

from paratrain.parallel.data.base import DataParallel, data_parallel_parameters
from paratrain.parallel.data.buckets import MIB, ReductionsInOrder, build_buckets
from paratrain.parallel.data.compression import NoCompression


class BucketedDataParallel(DataParallel):
    def __init__(self, module, group, algo="auto", bucket_mb=25.0, first_bucket_mb=1.0, compressor=None):
        super().__init__(module, group, algo)
        self.compressor = compressor or NoCompression()
        params = data_parallel_parameters(module)
        self.buckets = build_buckets(params, int(bucket_mb * MIB), int(first_bucket_mb * MIB))
        self.reductions = ReductionsInOrder([b.params for b in self.buckets], self._start_bucket)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    def _grad_ready(self, param) -> None:
        if self._syncing:
            self.reductions.ready(param)

    def grad_ready(self, param) -> None:
        self._grad_ready(param)

    def _start_bucket(self, index: int):
        return self.compressor.start(self.group, self.buckets[index].buffer, self.algo, index)

    def finish_gradients(self) -> None:
        self.reductions.finish(self.timer)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
