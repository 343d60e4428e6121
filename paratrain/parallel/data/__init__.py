"""Data parallelism: every rank holds the whole model (or its shard of it) and a shard of each
global batch.

The strategies and their facts are strategy.py's table; `build_data_parallel` resolves the
`--dp-mode` / `--zero` / `--local-sgd` spelling there and builds the one it names.
"""

from __future__ import annotations

import torch

from paratrain.parallel.precision import compute_dtype
from paratrain.parallel.data.base import DataParallel
from paratrain.parallel.data.compression import build_compressor
from paratrain.parallel.data.ddp import BucketedDataParallel
from paratrain.parallel.data.fsdp import FullyShardedDataParallel
from paratrain.parallel.data.local_sgd import LocalSGD
from paratrain.parallel.data.naive import NaiveDataParallel
from paratrain.parallel.data.strategy import DP_MODES, STRATEGIES, Strategy, StrategyError, resolve_strategy
from paratrain.parallel.data.torch_ddp import TorchDataParallel
from paratrain.parallel.data.zero import ZeroOneDataParallel, ZeroTwoDataParallel


def _torch_fsdp(module, group, o):
    from paratrain.parallel.data.torch_fsdp import TorchFullyShardedDataParallel  # imports DTensor: only if used

    return TorchFullyShardedDataParallel(module, group, o["model"], o["plan"], o["reshard_after_forward"],
                                         o["compute_dtype"])


def _torch_ddp(module, group, o, zero=False):
    return TorchDataParallel(module, group, group.transport.torch_process_group(group.timeout), o["bucket_mb"],
                             zero=zero)


# Strategy name -> (module, group, options) -> DataParallel.
_BUILDERS = {
    "naive": lambda m, g, o: NaiveDataParallel(m, g, o["algo"], o["naive_layout"], build_compressor(o["compress"])),
    "ddp": lambda m, g, o: BucketedDataParallel(m, g, o["algo"], o["bucket_mb"], o["first_bucket_mb"],
                                                build_compressor(o["compress"])),
    "torch-ddp": _torch_ddp,
    "zero1": lambda m, g, o: ZeroOneDataParallel(m, g, o["algo"], o["bucket_mb"], o["first_bucket_mb"]),
    "torch-zero1": lambda m, g, o: _torch_ddp(m, g, o, zero=True),
    "zero2": lambda m, g, o: ZeroTwoDataParallel(m, g, o["algo"], o["bucket_mb"], o["first_bucket_mb"]),
    "fsdp": lambda m, g, o: FullyShardedDataParallel(m, g, o["algo"], o["model"], o["plan"], o["roots"],
                                                     o["reshard_after_forward"], o["prefetch"], o["compute_dtype"]),
    "torch-fsdp": _torch_fsdp,
    "local-sgd": lambda m, g, o: LocalSGD(m, g, o["algo"], every=o["local_sgd"]),
}
assert set(_BUILDERS) == set(STRATEGIES), "every strategy is built here"


def build_data_parallel(module, group, *, mode=None, zero=0, local_sgd=0, algo="auto", naive_layout="flat",
                        bucket_mb=25.0, first_bucket_mb=1.0, compress="none", model=None, plan=None, roots=None,
                        reshard_after_forward=True, prefetch=1, precision="fp32") -> DataParallel:
    """The strategy `mode` / `zero` / `local_sgd` name (strategy.resolve_strategy), wrapping `module`.

    FSDP reads its units from `model` (the whole model `module` was cut from; default `module`)
    and `plan` (its block list), and gathers what is outside the blocks when one of `roots` (the
    modules the loop calls: the model, or this rank's pipeline chunks) runs. `precision` bf16 or
    fp16: FSDP gathers parameters and reduce-scatters gradients in that dtype."""
    strategy = resolve_strategy(mode, zero, local_sgd)
    options = {"algo": algo, "naive_layout": naive_layout, "bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb,
               "compress": compress, "local_sgd": local_sgd, "model": model, "plan": plan, "roots": roots,
               "reshard_after_forward": reshard_after_forward, "prefetch": prefetch,
               "compute_dtype": compute_dtype(precision)}
    return _BUILDERS[strategy.name](module, group, options)


__all__ = ["DP_MODES", "DataParallel", "STRATEGIES", "Strategy", "StrategyError", "build_data_parallel",
           "resolve_strategy"]
