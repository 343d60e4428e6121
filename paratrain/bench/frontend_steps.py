"""The training steps `bench frontend` times (frontend.py, frontend_compile.py): a two-layer MLP's
step through the frontend and the same step in plain PyTorch, and the clock that times them."""

from __future__ import annotations

import contextlib
import time

import torch

ROUND_SECONDS = 0.4  # steps per round are chosen so that a round of PyTorch takes about this


def frontend_step(gt, batch, hidden, region=None, name: str = ""):
    """The step; with `region` (gt.signal.context), its forward pass in the region `name`."""
    x, y = gt.randn(batch, hidden), gt.randint(0, 10, (batch,))
    first, second = gt.nn.Linear(hidden, hidden), gt.nn.Linear(hidden, 10)
    optimizer = gt.optim.SGD(first.parameters() + second.parameters(), lr=0.01)

    def step():
        with region(name) if region is not None else contextlib.nullcontext():
            loss = gt.cross_entropy(second(first(x).relu()), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def torch_step(batch, hidden, compiled: bool = False, backend: str = "inductor"):
    """The step in plain PyTorch; with `compiled`, its forward pass torch.compile'd by `backend`,
    as the frontend's compiled region is (what compiling gains without the frontend)."""
    x, y = torch.randn(batch, hidden), torch.randint(0, 10, (batch,))
    model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def forward():
        return torch.nn.functional.cross_entropy(model(x), y)

    if compiled:
        forward = torch.compile(forward, fullgraph=True, dynamic=False, backend=backend)

    def step():
        loss = forward()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def seconds_per_step(step, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps
