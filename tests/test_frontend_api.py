"""The frontend's API against plain PyTorch, on one worker: every operation's values and
gradients, a GT-style training loop, optimizers, and errors raised where they belong.

Tolerance: the worker runs the same PyTorch kernels on the same float32 inputs as the reference,
so results agree to float32 rounding (rtol 1e-5, atol 1e-6; most are bit-identical).
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paratrain.frontend as gt

RTOL, ATOL = 1e-5, 1e-6


def _close(actual, expected, what=""):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64),
                               rtol=RTOL, atol=ATOL, err_msg=what)


# name: (input shapes, or (shape, dtype); the same function applied to torch and to gt)
F = "float32"
CASES = {
    "add_broadcast": ([(4, 5), (1, 5)], lambda t, a, b: a + b),
    "sub_scalar_left": ([(4, 5)], lambda t, a: 2.5 - a),
    "mul": ([(4, 5), (4, 5)], lambda t, a, b: a * b),
    "div": ([(4, 5), (4, 5)], lambda t, a, b: a / (b.abs() + 1)),
    "rdiv_scalar": ([(4, 5)], lambda t, a: 3.0 / (a.abs() + 1)),
    "pow": ([(4, 5)], lambda t, a: a ** 2 + (a.abs() + 1) ** 0.5),
    "matmul": ([(4, 3), (3, 6)], lambda t, a, b: a @ b),
    "matmul_batched": ([(2, 4, 3), (3, 6)], lambda t, a, b: a.matmul(b)),
    "neg_abs": ([(4, 5)], lambda t, a: -a + abs(a)),
    "relu_sigmoid_tanh": ([(4, 5)], lambda t, a: a.relu() + a.sigmoid() * a.tanh()),
    "exp_log_sqrt": ([(4, 5)], lambda t, a: (a.exp() + 1).log() + (a * a + 1).sqrt()),
    "gelu": ([(4, 5)], lambda t, a: t.nn.functional.gelu(a)),
    "softmax": ([(4, 5)], lambda t, a: a.softmax(-1) * a),
    "log_softmax": ([(4, 5)], lambda t, a: t.nn.functional.log_softmax(a, dim=0)),
    "sum_mean": ([(4, 5)], lambda t, a: a.sum(dim=1, keepdim=True) + a.mean(dim=0)),
    "sum_all": ([(4, 5)], lambda t, a: a.sum() * a.mean()),
    "max_all": ([(4, 5)], lambda t, a: a.max()),
    "max_dim": ([(4, 5)], lambda t, a: a.max(dim=1)),
    "min_dim_keepdim": ([(4, 5)], lambda t, a: a.min(dim=0, keepdim=True)),
    "argmax": ([(4, 5)], lambda t, a: a.argmax(dim=1)),
    "var_std": ([(4, 5)], lambda t, a: a.var(dim=1) + a.std()),
    "transpose_T": ([(4, 5)], lambda t, a: a.transpose(0, 1) @ a + a.T @ a),
    "reshape": ([(4, 6)], lambda t, a: a.reshape(2, -1, 3).sum(dim=1)),
    "view_flatten": ([(2, 3, 4)], lambda t, a: a.view(6, 4) + a.flatten(0, 1)),
    "unsqueeze_squeeze": ([(4, 1, 5)], lambda t, a: a.squeeze(1).unsqueeze(0) * 2),
    "permute_contiguous": ([(2, 3, 4)], lambda t, a: a.permute(2, 0, 1).contiguous()),
    "expand": ([(4, 1)], lambda t, a: a.expand(4, 3) * 1.5),
    "getitem": ([(6, 5)], lambda t, a: a[1:5:2, None, ..., 2] + a[-1, 1:3].sum()),
    "getitem_tensor_index": ([(6, 5), ((3,), "int64")], lambda t, a, i: a[i] * 2),
    "setitem": ([(4, 5), (4,)], lambda t, a, b: _setitem(a, b)),
    "cat_stack": ([(2, 3), (2, 3)], lambda t, a, b: t.cat([a, b], dim=1).sum(0).reshape(2, 3) + t.stack([a, b], 0).sum(0)),
    "chunk_split": ([(4, 6)], lambda t, a: a.chunk(3, dim=1)[1] * a.split(2, dim=1)[2]),
    "where_clamp": ([(4, 5), (4, 5)], lambda t, a, b: t.where(a > 0, a, b).clamp(-0.5, 0.5)),
    "masked_fill_tril": ([(5, 5)], lambda t, a: a.masked_fill(t.ones(5, 5).tril() == 0, -1.0).triu(-1)),
    "comparisons": ([(4, 5), (4, 5)], lambda t, a, b: (a < b).float() + (a >= 0.1).float() + (a != b).float()),
    "maximum_minimum": ([(4, 5), (4, 5)], lambda t, a, b: t.maximum(a, b) - t.minimum(a, b)),
    "cross_entropy": ([(8, 10), ((8,), "int64")], lambda t, a, y: t.nn.functional.cross_entropy(a, y)),
    "mse_loss": ([(4, 5), (4, 5)], lambda t, a, b: t.nn.functional.mse_loss(a, b)),
    "layer_norm": ([(4, 6), (6,), (6,)], lambda t, x, w, b: t.nn.functional.layer_norm(x, (6,), w, b, 1e-5)),
    "embedding": ([((7,), "int64"), (10, 4)], lambda t, i, w: t.nn.functional.embedding(i, w)),
    "sdpa_causal": ([(2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 4)],
                    lambda t, q, k, v: t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "detach_clone": ([(4, 5)], lambda t, a: a.detach() * a.clone()),
    "to_half_and_back": ([(4, 5)], lambda t, a: a.half().float() + a.double().float()),
    "inplace_on_result": ([(4, 5), (4, 5)], lambda t, a, b: _inplace_chain(a * 1.0, b)),
}


def _setitem(a, b):
    c = a * 1.0
    c[:, 2] = b
    c[0] = 7.0
    return c


def _inplace_chain(c, b):
    c += b
    c -= 0.5
    c *= b
    c.add_(1.0)
    return c


def _inputs(specs, rng):
    arrays = []
    for spec in specs:
        shape, dtype = spec if isinstance(spec[0], tuple) else (spec, F)
        if dtype == "int64":
            arrays.append(rng.integers(0, 3 if shape == (3,) else 6, size=shape).astype(np.int64))
        else:
            arrays.append(rng.standard_normal(shape).astype(np.float32))
    return arrays


@pytest.mark.parametrize("name", CASES)
def test_operation_matches_pytorch_in_values_and_gradients(client, name):
    specs, fn = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    arrays = _inputs(specs, rng)
    ours = [gt.from_numpy(a, requires_grad=a.dtype == np.float32) for a in arrays]
    theirs = [torch.tensor(a, requires_grad=a.dtype == np.float32) for a in arrays]
    got, expected = fn(gt, *ours), fn(torch, *theirs)
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected):
        assert g.shape == tuple(e.shape) and g.dtype == str(e.dtype).removeprefix("torch.")
        _close(g.numpy(), e.detach().numpy(), f"{name}: values")
    first, reference = got[0], expected[0]
    if reference.requires_grad:
        weights = rng.standard_normal(tuple(reference.shape)).astype(np.float32)
        (first * gt.from_numpy(weights)).sum().backward()
        (reference * torch.tensor(weights)).sum().backward()
        for g, t in zip(ours, theirs):
            if t.grad is None:
                assert g.grad is None
            else:
                _close(g.grad.numpy(), t.grad.numpy(), f"{name}: gradient")


def test_gt_spellings_match_numpy(client):
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    x = gt.from_numpy(a)
    _close(x.sum(axis=0, keepdims=True).numpy(), a.sum(axis=0, keepdims=True))
    _close(x.mean(axis=1).numpy(), a.mean(axis=1))
    _close(x.max(axis=1).numpy(), a.max(axis=1))
    _close(x.transpose().numpy(), a.T)
    _close(x.data.numpy(), a)
    assert x.shape == (3, 4) and x.dtype == gt.float32
    assert "tensor(" in str(x) and f"{gt.tensor([2.5]).item():.1f}" == "2.5"


def test_creation_functions_and_seeded_randomness_match_pytorch(client):
    gt.manual_seed(7)
    torch.manual_seed(7)
    _close(gt.randn(3, 4).numpy(), torch.randn(3, 4).numpy())
    _close(gt.rand(5).numpy(), torch.rand(5).numpy())
    _close(gt.zeros(2, 3).numpy(), np.zeros((2, 3)))
    _close(gt.ones((2, 2)).numpy(), np.ones((2, 2)))
    _close(gt.full((2,), 3.5).numpy(), [3.5, 3.5])
    _close(gt.arange(5).numpy(), np.arange(5))
    # GT's rule: Python data is float32 unless a dtype is named; arrays keep theirs
    assert gt.tensor([1, 2]).dtype == "float32" and gt.tensor([1, 2], dtype="int64").dtype == "int64"
    assert gt.tensor(np.array([[True]])).dtype == "bool" and gt.tensor(np.arange(3)).dtype == "int64"
    ints = gt.randint(0, 4, (100,)).numpy()
    assert ints.min() >= 0 and ints.max() < 4


def test_bfloat16_and_float16_compute_like_pytorch(client):
    a = np.random.default_rng(2).standard_normal((8, 8)).astype(np.float32)
    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        got = (gt.from_numpy(a).to(dtype) @ gt.from_numpy(a).to(dtype))
        expected = torch.tensor(a).to(torch_dtype) @ torch.tensor(a).to(torch_dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.numpy(), expected.float().numpy())


def test_assigning_a_gradient_is_what_the_optimizer_uses(client):
    w = gt.zeros(3, requires_grad=True)
    w.grad = gt.ones(3) * 2.0
    gt.optim.SGD([w], lr=0.5).step()
    np.testing.assert_allclose(w.numpy(), [-1.0, -1.0, -1.0])
    np.testing.assert_allclose(w.grad.numpy(), [2.0, 2.0, 2.0])
    w.grad = None
    assert w.grad is None
    with pytest.raises(RuntimeError, match="shape \\[3\\]"):
        w.grad = gt.ones(4)


def test_no_grad_results_do_not_require_grad(client):
    w = gt.randn(3, requires_grad=True)
    with gt.no_grad():
        y = w * 2
    assert not y.requires_grad and (w * 2).requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    # GT's rule (not PyTorch's): an in-place update of a leaf that requires grad is a plain
    # update of its values, outside autograd (GT's manual SGD: p -= lr * p.grad)
    before = w.numpy()
    w -= 1.0
    assert w.requires_grad and w.is_leaf
    np.testing.assert_allclose(w.numpy(), before - 1.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    drop=st.lists(st.booleans(), min_size=3, max_size=3),
    op=st.sampled_from(["add", "sub", "mul", "maximum"]),
)
def test_broadcasting_elementwise_ops_agree_with_pytorch(client, shape, drop, op):
    """Property: any pair of broadcastable shapes gives PyTorch's shape and values."""
    other = [1 if d else s for s, d in zip(shape, drop)]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(other).astype(np.float32)
    fns = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
           "maximum": lambda x, y: (gt if isinstance(x, gt.Tensor) else torch).maximum(x, y)}
    got = fns[op](gt.from_numpy(a), gt.from_numpy(b))
    expected = fns[op](torch.tensor(a), torch.tensor(b))
    assert got.shape == tuple(expected.shape)
    _close(got.numpy(), expected.numpy())


# ---- training -----------------------------------------------------------------------------------

class GtMLP(gt.nn.Module):
    """GT's example MLP, written against GT's API only."""

    def __init__(self):
        super().__init__()
        self.fc1 = gt.nn.Linear(4, 8)
        self.fc2 = gt.nn.Linear(8, 1)

    def forward(self, x):
        return gt.nn.sigmoid(self.fc2(gt.nn.relu(self.fc1(x))))


def _torch_mlp(state):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1), torch.nn.Sigmoid())
    with torch.no_grad():
        for layer, name in ((model[0], "fc1"), (model[2], "fc2")):
            layer.weight.copy_(torch.tensor(state[f"{name}.weight"]).T)  # GT's Linear is [in, out]
            layer.bias.copy_(torch.tensor(state[f"{name}.bias"]))
    return model


def _data():
    rng = np.random.default_rng(42)
    x = rng.standard_normal((100, 4)).astype(np.float32)
    return x, (x.sum(axis=1) > 0).astype(np.float32).reshape(-1, 1)


def test_gt_style_training_loop_gives_pytorchs_losses(client):
    x, y = _data()
    model = GtMLP()
    reference = _torch_mlp(model.state_dict())
    xs, ys = gt.from_numpy(x), gt.from_numpy(y)
    ours, theirs = [], []
    for _ in range(20):
        loss = ((model(xs) - ys) ** 2).mean()
        loss.backward()
        with gt.no_grad():
            for param in model.parameters():
                param -= 0.5 * param.grad
                param.grad.zero_()
        ours.append(loss.item())
        ref = ((reference(torch.tensor(x)) - torch.tensor(y)) ** 2).mean()
        ref.backward()
        with torch.no_grad():
            for param in reference.parameters():
                param -= 0.5 * param.grad
                param.grad.zero_()
        theirs.append(ref.item())
    _close(ours, theirs, "losses")
    assert ours[-1] < ours[0]


@pytest.mark.parametrize("kind", ["sgd_momentum", "adamw"])
def test_optimizers_step_on_the_worker_like_torch_optim(client, kind):
    x, y = _data()
    model = GtMLP()
    reference = _torch_mlp(model.state_dict())
    if kind == "adamw":
        ours, theirs = gt.optim.AdamW(model.parameters(), lr=0.01), torch.optim.AdamW(reference.parameters(), lr=0.01)
    else:
        ours, theirs = (gt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    for step in range(5):
        if step == 3:
            ours.lr, theirs.param_groups[0]["lr"] = 0.05, 0.05
        loss = gt.nn.functional.mse_loss(model(gt.from_numpy(x)), gt.from_numpy(y))
        loss.backward()
        ours.step()
        ours.zero_grad()
        ref = torch.nn.functional.mse_loss(reference(torch.tensor(x)), torch.tensor(y))
        ref.backward()
        theirs.step()
        theirs.zero_grad()
        _close(loss.item(), ref.item(), f"step {step}")
    assert all(p.grad is None for p in model.parameters())
