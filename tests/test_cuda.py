"""The CUDA paths: collectives on CUDA tensors (fabric and NCCL) and training on the GPU.

These need a CUDA GPU; one is enough (the fabric's ranks may share it; NCCL gets as many ranks
as there are GPUs, since it refuses two ranks on one). Where torch has no CUDA (the CI
machine) they are skipped: run them on a GPU machine with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch

import paratrain
from paratrain.train.check import compare
from paratrain.train.loop import train_rank
from paratrain.train.reference import reference_run

from test_collectives_gloo import check_everything_on_this_rank
from collective_checks import assert_no_failures
from test_parallel_3d import config_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# GPU and CPU kernels sum in different orders (and TF32 stays off): fp32 differences grow to
# ~1e-6 relative over 5 steps; a wrong gradient moves losses by 1e-3 or more.
GPU_LOSS_RTOL, GPU_PARAM_ATOL = 1e-4, 1e-4


def gpus(world_size: int) -> list[str]:
    """Ranks spread over the GPUs, several to a GPU where there are fewer GPUs than ranks."""
    return [f"cuda:{rank % torch.cuda.device_count()}" for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_on_cuda_tensors_over_the_fabric(world_size):
    results = paratrain.run(check_everything_on_this_rank, world_size, devices=gpus(world_size), timeout=120)
    assert {result["transport"] for result in results.values()} == {"fabric"}
    assert_no_failures({rank: result["failures"] for rank, result in results.items()})


needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL between processes needs two GPUs (one per rank); a world of one would test no collective")


@needs_two_gpus
def test_every_collective_on_nccl():
    world_size = min(torch.cuda.device_count(), 4)
    results = paratrain.run(check_everything_on_this_rank, world_size, launcher="processes", timeout=120)
    assert {result["transport"] for result in results.values()} == {"nccl"}
    assert_no_failures({rank: result["failures"] for rank, result in results.items()})


def _train_on_gpus(group, config):
    result = train_rank(group, config, return_state=True)
    result["state"] = {name: value.cpu() for name, value in result["state"].items()}
    return result


@pytest.mark.parametrize("dp, pp, tp, schedule, microbatches, extra", [
    (2, 1, 1, None, 1, {}),
    (1, 1, 2, None, 1, {}),
    (1, 2, 1, "1f1b", 4, {}),
    (1, 2, 1, "zb-h1", 4, {}),
    (2, 2, 2, "1f1b", 4, {}),
])
def test_training_on_the_gpu_matches_the_cpu_reference(dp, pp, tp, schedule, microbatches, extra):
    config = config_for(dp, pp, tp, schedule, microbatches, extra)
    world = dp * pp * tp
    results = paratrain.run(functools.partial(_train_on_gpus, config=config), world, devices=gpus(world))
    report = compare(config, results, reference_run(config))
    assert not report["missing"]
    assert report["max_loss_diff"] <= GPU_LOSS_RTOL, report["loss_diffs"]
    assert report["max_param_diff"] <= GPU_PARAM_ATOL, (report["worst_param"], report["max_param_diff"])


@needs_two_gpus
def test_train_command_runs_on_nccl_in_bf16():
    command = [sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--steps", "20",
               "--nproc", "2", "--launcher", "processes",
               "--precision", "bf16", "--log-every", "5"]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    losses = [float(line.split("loss")[1].split()[0]) for line in finished.stdout.splitlines() if "loss" in line]
    assert len(losses) >= 2 and losses[-1] < losses[0], finished.stdout
