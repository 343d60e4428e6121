"""Train the own-model example (examples/own_model/) with dp 2 x pp 2 x tp 2 from a plain loop.

The loop is yours: the model, the optimizer (torch's AdamW), the data, `optimizer.step()`.
paratrain applies tensor parallelism by the model's plan, cuts the pipeline, shards the
optimizer state (ZeRO-1), runs the 1F1B schedule inside `forward_backward`, and clips by the
norm over every shard.

    python examples/python_api/train.py                          # 8 ranks, threads
    torchrun --nproc-per-node 8 examples/python_api/train.py     # 8 processes
"""

import importlib.util
from pathlib import Path

import torch

import paratrain
from paratrain.data import build_dataset, rank_batch

OWN_MODEL = Path(__file__).resolve().parent.parent / "own_model"


def load_build():
    """The user's model file, which knows nothing of paratrain (loaded by its path: another
    `model` module may already be imported)."""
    spec = importlib.util.spec_from_file_location("own_model", OWN_MODEL / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build

STEPS, GLOBAL_BATCH, LR, CLIP = 10, 16, 3e-3, 1.0


def train(group):
    mesh = paratrain.Mesh(group, dp=2, pp=2, tp=2)
    # Every rank builds the same model, which tensor and pipeline parallelism then cut. seeded()
    # is torch.manual_seed(0) for this block alone, one rank at a time: ranks that are threads
    # share torch's random generator.
    with paratrain.seeded(0):
        model = load_build()()
    # Random token sequences, the data `paratrain train` uses for this model (so the two can be
    # compared); put yours here: each replica takes its rows of the global batch.
    data = build_dataset("tokens", seed=0, vocab_size=model.vocab_size, block_size=model.block_size)
    job = paratrain.prepare(model, mesh, data.loss, plan=OWN_MODEL / "plan.yaml", vocab_size=model.vocab_size,
                            zero=1, schedule="1f1b", microbatches=4)
    optimizer = job.optimizer(lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0))
    losses = []
    for step in range(STEPS):
        inputs, targets = rank_batch(data, step, GLOBAL_BATCH, mesh.dp.rank, mesh.dp.size)
        loss = job.forward_backward(inputs, targets)  # the global batch's loss, on every rank
        norm = job.clip_grad_norm_(CLIP)
        optimizer.step()
        optimizer.zero_grad()
        if group.rank == 0:
            print(f"step {step}  loss {loss:.5f}  grad norm {norm:.3f}", flush=True)
        losses.append(loss)
    job.close()
    mesh.close()
    return losses


if __name__ == "__main__":
    paratrain.run(train, 8)
