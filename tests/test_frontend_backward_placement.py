"""A signal's `backward:` on other workers: the region's backward runs there (dispatcher/twins.py).

Each program runs on four workers and, as the same math, in one PyTorch process; the losses and
every gradient must agree. Tolerance: float32 sums in another order (parts summed by an
all-reduce), rtol 1e-5 and atol 1e-6 on values of order 1. The worker statistics show where the
twins' work ran: the region's results cut loose on the forward's workers (`twin_copy`), the
backward run from the twins on the backward signal's workers (`twin_bw_recv`).
"""

import numpy as np
import pytest
import torch

import paratrain.frontend as gt

RTOL, ATOL = 1e-5, 1e-6

# GT's pipeline recipe (its docs/dispatcher/signaling.md): forward on one pair, backward on the other.
PIPELINE = {
    "stage_1": {"shard": {"axis": 0, "workers": [0, 1]}, "backward": "stage_1_backward"},
    "stage_1_backward": {"shard": {"axis": 0, "workers": [2, 3]}},
    "stage_2": {"shard": {"axis": 0, "workers": [2, 3]}, "backward": "stage_2_backward"},
    "stage_2_backward": {"shard": {"axis": 0, "workers": [0, 1]}},
    "one": {"workers": [0], "backward": "other"},
    "other": {"workers": [1]},
}


@pytest.fixture
def four(four_workers):
    gt.load_config(PIPELINE)
    session = gt.connect(four_workers.address)
    yield session
    gt.disconnect()
    gt.get_config().clear()


def _ran(op: str) -> dict:
    """{worker rank: how many `op` instructions it has run}."""
    return {s["rank"]: s["operations"]["by_op"].get(op, 0) for s in gt.debug.get_worker_stats().values()}


def _more(before: dict, after: dict) -> set:
    return {rank for rank in after if after[rank] > before.get(rank, 0)}


def test_a_two_stage_mlp_runs_each_stages_backward_on_the_other_pair(four):
    rng = np.random.default_rng(0)
    x_np, w1_np, w2_np = (rng.standard_normal(s).astype(np.float32) for s in [(8, 6), (6, 5), (5, 3)])
    x = gt.from_numpy(x_np, requires_grad=True)
    w1 = gt.from_numpy(w1_np, requires_grad=True)
    w2 = gt.from_numpy(w2_np, requires_grad=True)
    copies, received = _ran("twin_copy"), _ran("twin_bw_recv")
    with gt.signal.context("stage_1"):
        h = (x @ w1).relu()
    with gt.signal.context("stage_2"):
        y = h @ w2
        loss = (y * y).mean()
    loss.backward()
    got = loss.item(), x.grad.numpy(), w1.grad.numpy(), w2.grad.numpy()

    tx, tw1, tw2 = (torch.tensor(a, requires_grad=True) for a in (x_np, w1_np, w2_np))
    t_loss = (((tx @ tw1).relu() @ tw2) ** 2).mean()
    t_loss.backward()
    np.testing.assert_allclose(got[0], t_loss.item(), rtol=RTOL)
    for mine, theirs in zip(got[1:], (tx.grad, tw1.grad, tw2.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=RTOL, atol=ATOL)
    # both stages ran forward on their own pair and backward on the other: every worker did both
    assert _more(copies, _ran("twin_copy")) == {0, 1, 2, 3}
    assert _more(received, _ran("twin_bw_recv")) == {0, 1, 2, 3}


def test_gts_example_forward_on_workers_0_1_and_backward_on_2_3(four):
    # GT's examples/config_from_python.py, example 2, with the values checked
    copies, received = _ran("twin_copy"), _ran("twin_bw_recv")
    with gt.signal.context("stage_1"):
        a = gt.randn(10, 5, requires_grad=True)
        b = a.relu()
        loss = b.sum()
    loss.backward()
    np.testing.assert_array_equal(a.grad.numpy(), (a.numpy() > 0).astype(np.float32))
    assert _more(copies, _ran("twin_copy")) == {0, 1}
    assert _more(received, _ran("twin_bw_recv")) == {2, 3}


def test_one_worker_forward_other_worker_backward_over_several_steps(four):
    """Replicated on single workers, with SGD steps: the parameter lives on worker 0, its
    gradient comes back from worker 1 each step."""
    rng = np.random.default_rng(1)
    w_np, x_np = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    with gt.signal.context("one"):
        w = gt.from_numpy(w_np, requires_grad=True)
    x = gt.from_numpy(x_np)
    optimizer = gt.optim.SGD([w], lr=0.1)
    tw, tx = torch.tensor(w_np, requires_grad=True), torch.tensor(x_np)
    t_optimizer = torch.optim.SGD([tw], lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        t_optimizer.zero_grad()
        with gt.signal.context("one"):
            loss = (x @ w).tanh().pow(2).sum()
        loss.backward()
        optimizer.step()
        t_loss = (tx @ tw).tanh().pow(2).sum()
        t_loss.backward()
        t_optimizer.step()
        np.testing.assert_allclose(loss.item(), t_loss.item(), rtol=RTOL)
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_results_used_outside_the_region_and_inside_it_both_send_their_gradient(four):
    """A region result used both by later region work and after the region: its gradient is
    the sum of both paths (one through the twin's graph, one through the copy's)."""
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((6, 4)).astype(np.float32)
    x = gt.from_numpy(x_np, requires_grad=True)
    with gt.signal.context("stage_1"):
        h = x * 3.0
        inside = (h * h).sum()
    outside = h.exp().sum()
    (inside + outside).backward()
    tx = torch.tensor(x_np, requires_grad=True)
    th = tx * 3.0
    ((th * th).sum() + th.exp().sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_a_backward_named_on_entering_the_region(four):
    """GT's `signal.context(name, backward=...)`: the same as a `backward:` in the configuration."""
    gt.register_config("plain_pair", {"workers": [0, 1]})
    received = _ran("twin_bw_recv")
    with gt.signal.context("plain_pair", backward="stage_1_backward"):
        a = gt.randn(6, 4, requires_grad=True)
        loss = (a * a).sum()
    loss.backward()
    np.testing.assert_allclose(a.grad.numpy(), 2 * a.numpy(), rtol=RTOL)
    assert _more(received, _ran("twin_bw_recv")) == {2, 3}
