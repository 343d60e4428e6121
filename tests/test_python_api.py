"""The library face (paratrain.prepare): a user's own loop trains exactly as `paratrain train`
does, since the command's loop is built on the same object (train/loop.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.train.config import TrainConfig, apply_overrides
from paratrain.train.loop import train_rank

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "python_api" / "train.py"


def load_example():
    spec = importlib.util.spec_from_file_location("paratrain_python_api_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_loop_gives_paratrain_trains_losses(monkeypatch):
    example = load_example()
    monkeypatch.setattr(example, "STEPS", 4)  # of its 10: the suite's time
    ours = paratrain.run(example.train, 8)[0]
    config = apply_overrides(TrainConfig(), {
        "model.name": str(ROOT / "examples/own_model/model.py") + ":build",
        "model.plan": str(ROOT / "examples/own_model/plan.yaml"), "parallel.pp": 2, "parallel.tp": 2,
        "parallel.zero": 1, "parallel.schedule": "1f1b", "parallel.microbatches": 4,
        "data.global_batch": example.GLOBAL_BATCH, "optim.name": "adamw", "optim.lr": example.LR,
        "optim.schedule": "constant", "optim.clip_grad_norm": example.CLIP, "steps": example.STEPS, "log_every": 100})
    theirs = [entry["loss"] for entry in paratrain.run(train_rank, 8, args=(config,))[0]["log"]]
    assert ours == pytest.approx(theirs, rel=1e-6, abs=0)
    assert len(ours) == 4 and ours[-1] < ours[0] - 0.3  # and it trains


def _tiny_loop(group, zero):
    mesh = paratrain.Mesh(group, dp=2)
    with paratrain.seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    job = paratrain.prepare(model, mesh, torch.nn.functional.mse_loss, zero=zero)
    optimizer = job.optimizer(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # a scheduler takes it
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(8, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        rows = slice(4 * mesh.dp.rank, 4 * mesh.dp.rank + 4)
        losses.append(job.forward_backward(x[rows], y[rows]))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    state = job.state_dict()
    job.close()
    mesh.close()
    return losses, state


def _reference_loop():
    with paratrain.seeded(0):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        x = torch.randn(8, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_users_own_optimizer_steps_carry_the_strategy(zero):
    """ZeRO's shards gathered after `optimizer.step()`, ZeRO-1's flat gradients cleared by
    `optimizer.zero_grad()`: the user's calls, the reference's results."""
    reference_losses, reference_state = _reference_loop()
    results = paratrain.run(_tiny_loop, 2, args=(zero,))
    for losses, state in results.values():
        assert losses == pytest.approx(reference_losses, rel=1e-5)
        for name, value in reference_state.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6)


def _unknown_option(group):
    paratrain.prepare(torch.nn.Linear(2, 2), paratrain.Mesh(group), torch.nn.functional.mse_loss, zero_stage=1)


def test_an_unknown_option_names_the_valid_ones():
    with pytest.raises(Exception, match="prepare: unknown option 'zero_stage'; valid: dp_mode"):
        paratrain.run(_unknown_option, 1)
