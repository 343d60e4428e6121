"""ZeRO stages 1 and 2: optimizer state (1), and gradients (2), sharded across data-parallel ranks.

Gradients are reduce-scattered (each rank gets the average of its 1/n part), each rank
updates only its part of the parameters with its own optimizer state (1/n of Adam's moments),
and an all-gather puts the updated parts back together. The reduce-scatter plus all-gather
moves the same bytes as one all-reduce, and optimizer memory drops n-fold.

As in our DDP, parameters are grouped into buckets in the order backward produces their
gradients, and each bucket's reduce-scatter starts on the communication thread as soon as its
last gradient is in, while backward goes on with earlier layers. So every bucket is sharded on
its own: this rank owns part `rank` of each bucket, and its shard (what the optimizer sees) is
those parts end to end. Parameters and gradients are views into two flat buffers laid out
bucket by bucket, so the all-gather lands directly in the model's parameters.

ZeRO-2 shards the gradients too: no rank keeps a whole-model gradient buffer. Autograd
writes each parameter's gradient on its own; once a bucket's are all in, they are copied into
one temporary flat buffer, dropped, and reduce-scattered into this rank's shard of the
gradient. So whole gradients live only from their bucket's first gradient to its
reduce-scatter; what stays is the 1/n shard the optimizer reads.
"""

from __future__ import annotations

import torch

from paratrain.comm.ops import part_bounds
from paratrain.parallel.data.base import DataParallel, data_parallel_parameters, pieces_of_shard
from paratrain.parallel.data.buckets import MIB, ReductionsInOrder, assign_buckets
from paratrain.parallel.data.compression import Pending


class ZeroOneDataParallel(DataParallel):
    stage = 1  # ZeRO-2 (below) keeps no whole gradient buffer

    def __init__(self, module, group, algo="auto", bucket_mb=25.0, first_bucket_mb=1.0):
        super().__init__(module, group, algo)
        trained = data_parallel_parameters(module)
        buckets = assign_buckets(trained, int(bucket_mb * MIB), int(first_bucket_mb * MIB))
        self.params = [param for bucket in buckets for param in bucket]  # in flat-buffer order
        first = self.params[0]
        count = sum(p.numel() for p in self.params)
        self.flat_params = torch.empty(count, dtype=first.dtype, device=first.device)
        self.flat_grads = torch.zeros_like(self.flat_params) if self.stage == 1 else None
        offset = 0
        for param in self.params:
            end = offset + param.numel()
            self.flat_params[offset:end].copy_(param.data.view(-1))
            param.data = self.flat_params[offset:end].view_as(param)
            param.grad = None if self.flat_grads is None else self.flat_grads[offset:end].view_as(param)
            offset = end
        # _ranges[k] = (start, end): bucket k in the flat buffers. _owned[k] = (start, end, at):
        # this rank's part of bucket k in the flat buffers, and where it sits in the shard.
        self._ranges, self._owned, shard_offset = [], [], 0
        offset = 0
        for bucket in buckets:
            end = offset + sum(p.numel() for p in bucket)
            mine = part_bounds(end - offset, group.size)[group.rank]
            self._ranges.append((offset, end))
            self._owned.append((offset + mine[0], offset + mine[1], shard_offset))
            shard_offset += mine[1] - mine[0]
            offset = end
        self._buckets = buckets
        # The shard the optimizer sees: its own tensor, as optimizers keep state per tensor.
        self.shard = torch.nn.Parameter(self.own_part(self.flat_params).clone())
        self.shard.grad = torch.zeros_like(self.shard)
        self.reductions = ReductionsInOrder(buckets, self._start_bucket)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in trained]

    # ---- the layout: whole flat buffer <-> this rank's shard ------------------------------

    def own_part(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's parts of a flat-buffer-shaped tensor, end to end (a shard's layout)."""
        return torch.cat([flat[start:end] for start, end, _ in self._owned])

    def gather_shards(self, shard_like: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard_like` (laid out as the shard) put together in flat-buffer order."""
        whole = torch.empty_like(self.flat_params, dtype=shard_like.dtype)
        for k in range(len(self._ranges)):
            self.group.all_gather(self._flat_part(whole, k), self._shard_part(shard_like, k), self.algo)
        return whole

    def _flat_part(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        start, end = self._ranges[k]
        return flat[start:end]

    def _shard_part(self, shard: torch.Tensor, k: int) -> torch.Tensor:
        start, end, at = self._owned[k]
        return shard[at : at + end - start]

    # ---- the step ------------------------------------------------------------------------

    def make_optimizer(self, build):
        return build([self.shard])

    def _grad_ready(self, param) -> None:
        if self._syncing:
            self.reductions.ready(param)

    def grad_ready(self, param) -> None:
        self._grad_ready(param)

    def _start_bucket(self, k: int) -> Pending:
        handle = self.group.reduce_scatter(
            self._shard_part(self.shard.grad, k), self._flat_part(self.flat_grads, k), "avg", self.algo, async_op=True)
        return Pending([handle])

    def finish_gradients(self) -> None:
        self.reductions.finish(self.timer)

    grads_sharded = True

    def gradient_pieces(self):
        return pieces_of_shard(self.params, self._owned, self.shard.grad)

    def gradients_to_scale(self):
        return [self.shard.grad]

    def after_step(self) -> None:
        with self.timer.blocking():
            handles = [
                self.group.all_gather(self._flat_part(self.flat_params, k), self._shard_part(self.shard.data, k),
                                      self.algo, async_op=True)
                for k in range(len(self._ranges))
            ]
            for handle in handles:
                handle.wait()

    def zero_grad(self) -> None:
        self.flat_grads.zero_()


class ZeroTwoDataParallel(ZeroOneDataParallel):
    stage = 2

    def _start_bucket(self, k: int) -> Pending:
        # The bucket's gradients, end to end (zeros for a parameter that got none), then
        # dropped: from here on only the reduce-scatter holds them.
        params = self._buckets[k]
        flat = torch.cat([torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if p.grad is None
                          else p.grad.reshape(-1) for p in params])
        for param in params:
            param.grad = None
        handle = self.group.reduce_scatter(self._shard_part(self.shard.grad, k), flat, "avg", self.algo, async_op=True)
        return Pending([handle])  # the handle holds `flat` until it has run

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
