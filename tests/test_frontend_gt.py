"""GT's API where it is GT's and not PyTorch's: configuration, semantics, the `gt` alias.

Our own programs exercising what GT's examples use (GT's own tests and examples are run by
`compat/gt_tests.py` against a checkout of GT; none is copied here). Values are compared with
PyTorch in float32: rtol 1e-5, atol 1e-6.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import paratrain.frontend as gt
from paratrain.frontend.client.autostart import LocalServer

ALIAS = Path(__file__).resolve().parents[1] / "compat"
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def config():
    """The program's configuration, emptied after each test (it outlives sessions)."""
    yield gt.get_config()
    gt.get_config().clear()


@pytest.fixture
def four(four_workers, config):
    session = gt.connect(four_workers.address)
    yield session
    gt.disconnect()


# ---- semantics ---------------------------------------------------------------------------------------

def test_python_data_is_float32_and_arrays_keep_their_dtype(client):
    assert gt.tensor([1, 2, 3]).dtype == "float32"
    assert gt.tensor([1, 2], dtype="int64").dtype == "int64"
    assert gt.tensor(np.arange(3, dtype=np.int32)).dtype == "int32"


def test_dtypes_equal_numpys(client):
    x = gt.ones(2)
    assert x.dtype == np.float32 and x.dtype == np.dtype("float32") and np.float32 == x.dtype
    assert x.dtype != np.float64 and x.dtype == gt.float32 and x.dtype == "float32"
    assert {x.dtype: 1}["float32"] == 1  # still hashes as its name


def test_numpy_functions_run_on_the_values(client):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = gt.from_numpy(a)
    assert np.mean(x) == pytest.approx(a.mean())
    np.testing.assert_array_equal(np.concatenate([x, x]), np.concatenate([a, a]))
    np.testing.assert_array_equal(np.sum(x, axis=0), a.sum(axis=0))


def test_T_and_transpose_swap_the_last_two_axes(client):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    x = gt.from_numpy(a)
    assert x.T.shape == (2, 4, 3) and x.transpose().shape == (2, 4, 3)
    np.testing.assert_array_equal(x.T.numpy(), a.swapaxes(-1, -2))
    np.testing.assert_array_equal(x.permute(2, 1, 0).numpy(), a.T)  # PyTorch's reversal, by name
    np.testing.assert_array_equal(x.mT.numpy(), a.swapaxes(-1, -2))
    v = gt.tensor([1.0, 2.0])
    assert v.T.shape == (2,) and v.transpose().shape == (2,)
    np.testing.assert_array_equal(x.transpose(0, 2).numpy(), a.swapaxes(0, 2))


def test_tensors_have_distinct_ids(client):
    a, b = gt.ones(1), gt.ones(1)
    assert isinstance(a.id, int) and a.id != b.id


def test_manual_sgd_updates_a_leaf_in_place_as_gt_does(client):
    w0 = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    x0 = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    w, x = gt.from_numpy(w0, requires_grad=True), gt.from_numpy(x0)
    tw = torch.tensor(w0, requires_grad=True)
    for _ in range(3):
        ((x @ w).relu() ** 2).mean().backward()
        w -= 0.1 * w.grad  # GT's documented update, outside no_grad
        w.grad = None
        ((torch.tensor(x0) @ tw).relu() ** 2).mean().backward()
        with torch.no_grad():
            tw -= 0.1 * tw.grad
        tw.grad = None
    assert w.is_leaf and w.requires_grad
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=RTOL, atol=ATOL)


def test_augmented_assignment_gives_a_new_id_and_keeps_autograd(client):
    """GT's `a -= b` makes a new tensor that takes the name `a` (its id changes); a parameter
    (a leaf that requires grad) is updated in place instead and keeps its id."""
    a = gt.tensor([5.0, 10.0])
    alias, before = a, a.id
    a -= gt.tensor([2.0, 3.0])
    assert a.id != before and alias is a
    np.testing.assert_array_equal(a.numpy(), [3.0, 7.0])
    w0 = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    w, tw = gt.from_numpy(w0, requires_grad=True), torch.tensor(w0, requires_grad=True)
    h, th = w * 3.0, tw * 3.0
    h += 1.0
    h *= h  # the new h is (old h)^2: the graph runs through the old values
    th = (th + 1.0) * (th + 1.0)
    h.sum().backward()
    th.sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=RTOL, atol=ATOL)
    parameter_id = w.id
    w -= 0.1 * w.grad
    assert w.id == parameter_id and w.is_leaf and w.requires_grad


def test_results_keep_their_gradients_as_gts_do(client):
    """GT keeps `.grad` on every tensor that requires grad, not only on leaves (PyTorch: with
    `retain_grad()`); compared here with PyTorch's retained gradients."""
    x0 = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    x = gt.from_numpy(x0, requires_grad=True)
    divisor = gt.ones(2, 3, 1, requires_grad=True) * 2.0
    ratio = x / divisor
    loss = ratio.sum()
    assert ratio.grad is None  # nothing before backward
    loss.backward()
    tx = torch.tensor(x0, requires_grad=True)
    tdivisor = torch.ones(2, 3, 1, requires_grad=True) * 2.0
    tratio = tx / tdivisor
    for kept in (tdivisor, tratio):
        kept.retain_grad()
    tloss = tratio.sum()
    tloss.retain_grad()
    tloss.backward()
    for ours, theirs in ((divisor, tdivisor), (ratio, tratio), (loss, tloss), (x, tx)):
        np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_sgd_and_losses_under_gts_names(client):
    logits0 = np.array([[0.5, -1.0], [2.0, 0.1]], dtype=np.float32)
    targets0 = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    loss = gt.nn.cross_entropy_loss(gt.from_numpy(logits0), gt.from_numpy(targets0))
    expected = torch.nn.functional.binary_cross_entropy(torch.sigmoid(torch.tensor(logits0)), torch.tensor(targets0))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    p = gt.ones(3, requires_grad=True)
    (p * 2.0).sum().backward()
    gt.nn.SGD([p], lr=0.5).step()
    np.testing.assert_allclose(p.numpy(), np.zeros(3))


# ---- configuration --------------------------------------------------------------------------------------

def test_python_configuration_classes_and_getters(config):
    gt.register_config("fwd", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[0, 1]),
                                              backward_signal="bwd", compile=True))
    got = gt.get_signal_config("fwd")
    assert got.shard.axis == 0 and got.shard.workers == [0, 1] and got.backward_signal == "bwd" and got.compile
    assert gt.get_config().has_signal("fwd") and not gt.get_config().has_signal("bwd")
    assert gt.get_signal_config("nope") is None
    assert not gt.connected()  # configuring before the first operation starts nothing


def test_registration_is_order_free_and_a_dangling_backward_is_named_at_first_use(four):
    # "into" names its backward signal before that signal exists: accepted (GT's order)
    gt.register_config("into", {"workers": [2, 3], "backward": "grads_split"})
    gt.register_config("source", {"workers": [0, 1]})
    with gt.signal.context("source"):
        x = gt.ones(4, 3, requires_grad=True)
    with pytest.raises(gt.RemoteError, match="backward signal 'grads_split' is not in this client's configuration"):
        gt.signal.tensor(x, "into").sum().item()
    gt.register_config("grads_split", {"shard": {"axis": 0, "workers": [0, 1]}})
    with gt.signal.context("source"):
        x = gt.ones(4, 3, requires_grad=True)
    (gt.signal.tensor(x, "into") * 2.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full((4, 3), 2.0))


def test_every_worker_and_replicated_and_backward_arguments(four):
    gt.load_config({"all_split": {"shard": {"axis": 0, "workers": None}},
                    "all_copies": {"shard": {"workers": None, "replicated": True}},
                    "pair": {"workers": [0, 1]}, "split_pair": {"shard": {"axis": 0, "workers": [0, 1]}},
                    "far": {"workers": [2, 3]}})
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    with gt.signal.context("all_split"):
        split = gt.from_numpy(a) * 1.0
    with gt.signal.context("all_copies"):
        copies = gt.from_numpy(a) + 0.0
    np.testing.assert_array_equal((split + copies).numpy(), 2 * a)
    # backward arguments: enter(name, backward=) and signal.tensor(x, name, backward_name=)
    with gt.signal.context("pair"):
        x = gt.from_numpy(a, requires_grad=True)
    gt.signal.enter("far", backward="split_pair")
    assert gt.get_signal_config("far").backward_signal == "split_pair"
    gt.signal.exit("far")
    (gt.signal.tensor(x, "far", backward_name="split_pair") ** 2).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * a, rtol=RTOL)


@pytest.fixture(scope="module")
def auto_started_gt_program(tmp_path_factory):
    """One program, run once for the two tests below (a new interpreter and an auto-started
    server cost seconds each): GT's import paths through the `gt` alias, then a signal of its
    GT_CONFIG file, on the server it auto-started at its first operation."""
    folder = tmp_path_factory.mktemp("gt-program")
    (folder / "four.yaml").write_text("last_pair:\n  shard:\n    axis: 0\n    workers: [2, 3]\n")
    script = folder / "program.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import gt
        from gt.client import nn
        from gt.client.tensor import from_numpy, randn
        from gt.config import ShardConfig, SignalConfig, get_config
        from gt.nn import SGD, Linear, Module
        from gt.client.nn import mse_loss

        class Net(Module):
            def __init__(self):
                super().__init__()
                self.layer = Linear(3, 1)
            def forward(self, x):
                return self.layer(x)

        net = Net()
        optimizer = SGD(net.parameters(), lr=0.1)
        x, y = randn(8, 3), from_numpy(np.ones((8, 1), dtype="float32"))
        first = mse_loss(net(x), y).item()
        for _ in range(20):
            optimizer.zero_grad()
            loss = mse_loss(net(x), y)
            loss.backward()
            optimizer.step()
        print("fell", loss.item() < first, isinstance(get_config(), gt.config.Config), nn.Linear is Linear)

        import paratrain.frontend as frontend
        with frontend.signal.context("last_pair"):
            x = frontend.ones(4, 2)
        print("workers", frontend.session().n_workers, "sum", x.sum().item())
    """))
    env = {**{k: v for k, v in os.environ.items() if k != "PARATRAIN_SERVER"},
           "PYTHONPATH": str(ALIAS), "GT_CONFIG": str(folder / "four.yaml")}
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=folder)


def test_an_auto_started_program_gets_the_workers_its_configuration_names(auto_started_gt_program):
    done = auto_started_gt_program
    assert done.returncode == 0, done.stderr
    assert "workers 4 sum 8.0" in done.stdout


def test_the_gt_alias_resolves_gts_import_paths(auto_started_gt_program):
    done = auto_started_gt_program
    assert done.returncode == 0, done.stderr
    assert "fell True True True" in done.stdout


def test_a_group_of_every_worker_after_a_group_of_two_does_not_hang(four):
    # Found writing the tests above (and present since before the rebuild): a gradient split on
    # [0, 1] made a group of those two; a later group of all four then hung in torch's gloo,
    # because only members made groups. Now every worker takes part in making each group.
    gt.load_config({"source": {"workers": [0, 1]}, "into": {"workers": [2, 3], "backward": "split01"},
                    "split01": {"shard": {"axis": 0, "workers": [0, 1]}},
                    "all_split": {"shard": {"axis": 0, "workers": [0, 1, 2, 3]}},
                    "all_copies": {"workers": [0, 1, 2, 3]}})
    with gt.signal.context("source"):
        x = gt.ones(4, 3, requires_grad=True)
    (gt.signal.tensor(x, "into") * 2.0).sum().backward()
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    with gt.signal.context("all_split"):
        split = gt.from_numpy(a) * 1.0
    with gt.signal.context("all_copies"):
        copies = gt.from_numpy(a) + 0.0
    np.testing.assert_array_equal((split + copies).numpy(), 2 * a)
    np.testing.assert_allclose(x.grad.numpy(), np.full((4, 3), 2.0))


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_a_numpy_backend_worker_makes_products_as_numpy_does(monkeypatch, backend):
    """GT's tests compare products with NumPy's at a relative tolerance, served by a worker with
    GT's NumPy backend: on ours too its products are NumPy's, to the bit; PyTorch's CPU products
    (the cpu backend) differ in the last bits. A product that needs a gradient is PyTorch's."""
    monkeypatch.setenv("GT_BACKEND", backend)  # the server's workers read it, as a program's would
    server = LocalServer.start(1)
    try:
        session = gt.Session(server.address)
        rng = np.random.default_rng(0)
        a = rng.standard_normal((8, 64), dtype=np.float32)
        b = rng.standard_normal((64, 8), dtype=np.float32)
        x, w = session.upload(a), session.upload(b)
        assert np.array_equal((x @ w).numpy(), a @ b) == (backend == "numpy")
        w = session.upload(b, requires_grad=True)
        (x @ w).sum().backward()
        np.testing.assert_allclose(w.grad.numpy(), np.repeat(a.sum(0)[:, None], 8, 1), rtol=1e-5, atol=1e-5)
        session.close()
    finally:
        server.stop()
