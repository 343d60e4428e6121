"""Data parallelism: every rank holds the whole model and a shard of each global batch.

`build_data_parallel` turns the `--dp-mode` family of options into a strategy:
naive (average after backward), ddp (ours: buckets overlapping backward), torch (PyTorch's
DDP), plus compression, local SGD and ZeRO-1.
"""

from __future__ import annotations

import torch

from paratrain.parallel.data.base import DataParallel
from paratrain.parallel.data.compression import build_compressor
from paratrain.parallel.data.ddp import BucketedDataParallel
from paratrain.parallel.data.fsdp import FullyShardedDataParallel
from paratrain.parallel.data.local_sgd import LocalSGD
from paratrain.parallel.data.naive import NaiveDataParallel
from paratrain.parallel.data.torch_ddp import TorchDataParallel
from paratrain.parallel.data.zero import ZeroOneDataParallel, ZeroTwoDataParallel

DP_MODES = ("naive", "ddp", "torch", "fsdp", "torch-fsdp")


def build_data_parallel(module, group, *, mode="ddp", algo="auto", naive_layout="flat",
                        bucket_mb=25.0, first_bucket_mb=1.0, compress="none", local_sgd=0,
                        zero=0, model=None, reshard_after_forward=True, prefetch=1,
                        precision="fp32") -> DataParallel:
    """`model`: the whole model `module` was cut from (FSDP reads its units from it); `precision`
    bf16: FSDP gathers parameters and reduce-scatters gradients in bf16."""
    compute_dtype = torch.bfloat16 if precision == "bf16" else None
    if mode == "torch-fsdp" or (mode == "torch" and zero == 3):
        from paratrain.parallel.data.torch_fsdp import TorchFullyShardedDataParallel

        return TorchFullyShardedDataParallel(module, group, model, reshard_after_forward, compute_dtype)
    if mode == "fsdp" or zero == 3:
        return FullyShardedDataParallel(module, group, algo, model, reshard_after_forward, prefetch, compute_dtype)
    if zero and mode == "torch":  # PyTorch's own: DDP with ZeroRedundancyOptimizer
        return TorchDataParallel(module, group, group.transport.torch_process_group(group.timeout), bucket_mb, zero=True)
    if zero == 2:
        return ZeroTwoDataParallel(module, group, algo, bucket_mb, first_bucket_mb)
    if zero:
        return ZeroOneDataParallel(module, group, algo, bucket_mb, first_bucket_mb)
    if local_sgd:
        return LocalSGD(module, group, algo, every=local_sgd)
    compressor = build_compressor(compress)
    if mode == "naive":
        return NaiveDataParallel(module, group, algo, naive_layout, compressor)
    if mode == "ddp":
        return BucketedDataParallel(module, group, algo, bucket_mb, first_bucket_mb, compressor)
    if mode == "torch":
        process_group = group.transport.torch_process_group(group.timeout)
        return TorchDataParallel(module, group, process_group, bucket_mb)
    raise ValueError(f"unknown dp mode {mode!r}; valid: {', '.join(DP_MODES)}")


__all__ = ["DP_MODES", "DataParallel", "build_data_parallel"]
