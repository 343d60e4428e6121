"""Signal sharding against one PyTorch process: every pattern's values and gradients.

Four workers; regions split or replicate over [0, 1] and [2, 3], so both tensor-parallel
patterns and pipeline moves between the pairs are exercised. Tolerance: the same float32 math
summed in another order (all-reduces of partial sums): rtol 1e-5, atol 1e-5.
"""

import contextlib

import numpy as np
import pytest
import torch

import paratrain.frontend as gt
from frontend_helpers import wait_until

SIGNALS = {
    "rep": {"workers": [0, 1]},
    "col": {"shard": {"axis": 1, "workers": [0, 1]}},  # a [in, out] weight split on its output
    "row": {"shard": {"axis": 0, "workers": [0, 1]}},  # split on its input
    "last": {"shard": {"axis": -1, "workers": [0, 1]}},
    "batch": {"shard": {"axis": 0, "workers": [0, 1]}},
    "one": {"workers": [0]},
    "stage1": {"workers": [2, 3]},
    "stage1_split_grads": {"workers": [2, 3], "backward": "rep_rows"},
    "rep_rows": {"shard": {"axis": 0, "workers": [0, 1]}},
}


@pytest.fixture(scope="module")
def server(four_workers):
    return four_workers  # conftest's, shared with test_frontend_workers.py


@pytest.fixture
def client(server):
    session = gt.connect(server.address)
    gt.load_config(SIGNALS)
    yield session
    gt.disconnect()
    gt.get_config().clear()  # the configuration is the program's: it outlives a session


class Torch:
    """The same program on one process: regions and moves do nothing."""

    nn = torch.nn

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def region(name):
        return contextlib.nullcontext()

    @staticmethod
    def move(x, name):
        return x

    @staticmethod
    def linear(x, w, b=None):
        return x @ w + b if b is not None else x @ w


class Frontend:
    nn = gt.nn

    def __getattr__(self, name):
        return getattr(gt, name)

    @staticmethod
    def region(name):
        return gt.signal.context(name)

    @staticmethod
    def move(x, name):
        return gt.signal.tensor(x, name)

    @staticmethod
    def linear(x, w, b=None):
        return gt.nn.functional.linear(x, w, b)


def _mlp(t, x, w1, b1, w2, b2):
    with t.region("last"):
        h = t.linear(x, w1, b1).relu()
    with t.region("row"):
        return t.linear(h, w2, b2)


def _elementwise(t, a, b, c, d):
    return (a * b + c - d).sum(dim=0)


def _reductions(t, a):
    return a.sum(dim=-1) + a.mean() + a.sum(dim=0, keepdim=True).sum(dim=1) * 0.5


def _moves(t, x, w):
    y = t.move(x, "stage1") * 3.0
    with t.region("stage1"):
        return (y @ w).tanh()


def _reshards(t, x):
    rows = t.move(x, "batch") * 2.0
    cols = t.move(rows, "last")
    return t.move(cols.exp(), "rep").sum(dim=1)


def _vocab_parallel(t, idx, table, head, targets):
    with t.region("rep"):
        h = t.nn.functional.embedding(idx, table)
    with t.region("col"):
        logits = h @ head
    return t.nn.functional.cross_entropy(logits, targets)


def _data_parallel(t, x, w, b, targets):
    with t.region("rep"):
        return t.nn.functional.cross_entropy(t.linear(x, w, b).relu(), targets)


def _attention(t, x, wq, wk, wv, wo):
    B, T, D, H = 2, 5, 8, 4
    with t.region("col"):
        q, k, v = ((x @ w).reshape(B, T, H, D // H).transpose(1, 2) for w in (wq, wk, wv))
        y = t.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, D)
    with t.region("row"):
        return y @ wo


def _fallbacks(t, a):
    return a.softmax(dim=-1).max(dim=1)[0] + a.log_softmax(dim=1)[:, 0]


def _split_gradient_return(t, x, w):
    y = t.move(x, "stage1_split_grads")
    with t.region("stage1"):
        return (y @ w).sigmoid()


# name: (inputs as (shape, dtype, signal that creates it), the program)
CASES = {
    "column_then_row_parallel_mlp": (
        [((4, 6), "float32", "rep"), ((6, 8), "float32", "last"), ((8,), "float32", "last"),
         ((8, 6), "float32", "row"), ((6,), "float32", "rep")], _mlp),
    "elementwise_on_like_split_tensors": (
        [((4, 6), "float32", "last"), ((4, 6), "float32", "last"), ((4, 6), "float32", "rep"),
         ((4, 1), "float32", "rep")], _elementwise),
    "reductions_over_and_beside_the_split_axis": ([((4, 6), "float32", "last")], _reductions),
    "moves_between_worker_pairs": ([((3, 4), "float32", "rep"), ((4, 5), "float32", "stage1")], _moves),
    "reshards_scatter_regather_and_gather": ([((6, 4), "float32", "rep")], _reshards),
    "vocab_parallel_embedding_and_cross_entropy": (
        [((6,), "int64", "rep"), ((11, 4), "float32", "row"), ((4, 11), "float32", "col"),
         ((6,), "int64", "rep")], _vocab_parallel),
    "data_parallel_batch_split": (
        [((6, 4), "float32", "batch"), ((4, 5), "float32", "rep"), ((5,), "float32", "rep"),
         ((6,), "int64", "batch")], _data_parallel),
    "attention_on_split_heads": (
        [((2, 5, 8), "float32", "rep")] + [((8, 8), "float32", "col")] * 3 + [((8, 8), "float32", "row")],
        _attention),
    "operations_without_a_rule_gather_first": ([((4, 6), "float32", "last")], _fallbacks),
    "gradients_travel_back_split_by_a_backward_signal": (
        [((4, 3), "float32", "rep"), ((3, 2), "float32", "stage1")], _split_gradient_return),
}


def _arrays(specs, rng):
    out = []
    for shape, dtype, _ in specs:
        if dtype == "int64":
            out.append(rng.integers(0, 4 if len(shape) == 1 and shape[0] == 6 else 11, size=shape).astype(np.int64))
        else:
            out.append(rng.standard_normal(shape).astype(np.float32))
    return out


@pytest.mark.parametrize("name", CASES)
def test_sharding_pattern_matches_one_process(client, name):
    specs, program = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    arrays = _arrays(specs, rng)
    ours = []
    for array, (_, dtype, signal) in zip(arrays, specs):
        with gt.signal.context(signal):
            ours.append(gt.from_numpy(array, requires_grad=dtype == "float32"))
    theirs = [torch.tensor(a, requires_grad=a.dtype == np.float32) for a in arrays]
    got, expected = program(Frontend(), *ours), program(Torch(), *theirs)
    assert got.shape == tuple(expected.shape)
    np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    weights = rng.standard_normal(tuple(expected.shape)).astype(np.float32)
    (got * gt.from_numpy(weights)).sum().backward()
    (expected * torch.tensor(weights)).sum().backward()
    for mine, reference in zip(ours, theirs):
        if reference.requires_grad:
            np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name}: gradient")


def test_replicated_random_tensors_are_the_same_on_every_worker(client):
    with gt.signal.context("rep"):
        x = gt.randn(6, 4)
    whole = x.numpy()
    parts = gt.signal.tensor(x, "batch")  # each worker keeps its rows of its own copy
    np.testing.assert_array_equal(parts.numpy(), whole)


def test_split_creation_and_optimizer_steps_stay_split(client):
    with gt.signal.context("col"):
        w = gt.zeros(3, 5, requires_grad=True)
    optimizer = gt.optim.SGD([w], lr=0.5)
    with gt.signal.context("rep"):
        x = gt.ones(2, 3)
    (x @ w).sum().backward()
    optimizer.step()
    np.testing.assert_allclose(w.numpy(), np.full((3, 5), -1.0))


def test_the_instruction_log_names_signal_pattern_and_collective(client, server):
    with gt.signal.context("rep"):
        x = gt.ones(2, 4)
    with gt.signal.context("row"):
        w = gt.ones(4, 3)
    h = gt.signal.tensor(x, "last")
    with gt.signal.context("row"):
        (h @ w).sum().item()
    lines = ["[row] row-parallel: partial sums all-reduced", "tp_g all-reduce group [0, 1]",
             "tp_scatter scatter along 1 group [0, 1]"]
    # (a worker's lines are written when it reports its timings)
    wait_until(lambda: all(line in server.log.read_text() for line in lines), 10, f"the log says {lines}")


@pytest.mark.parametrize("config, line", [
    ({"a": {"shard": {"axis": 0, "workers": [0, 7]}}}, "worker(s) [7] do not exist: there are 4 (0..3)"),
    ({"a": {"workers": [0], "compiled": True}}, "a: unknown key 'compiled'"),
    ({"a": {"workers": [0], "compile": "yes"}}, "a: compile must be true or false, got 'yes'"),
    ({"a": {"shard": {"axis": 0, "replicated": 1}}}, "a: shard.replicated must be true or false, got 1"),
    ({"a": {"shard": {"axis": 9, "workers": [0]}}}, "a: shard.axis must be an integer in [-8, 8), got 9"),
    ({"a": {"workers": [0], "backward": 3}}, "a: backward must name another signal, got 3"),
])
def test_bad_configurations_are_refused_with_one_line_each(client, config, line):
    before = gt.get_config().to_dict()
    with pytest.raises(gt.ConfigError) as refused:
        gt.load_config(config)
    assert any(line in problem for problem in refused.value.problems), refused.value.problems
    assert gt.get_config().to_dict() == before  # a refused file changes nothing


def test_an_axis_the_tensor_does_not_have_is_refused_where_it_is_created(client):
    with gt.signal.context("col"), pytest.raises(gt.RemoteError, match="axis 1 is out of range"):
        gt.ones(4).numpy()
