"""Auto-sharding (GT_AUTO_SHARD=1) against one worker: a GT-style MLP's forward values, every
parameter's gradient and a few SGD steps are the same on 2 and 4 workers as on 1, and the
instruction log shows that every worker did part of the work.

Each server auto-shards tensors of at least 1 KiB (the default, 4 MiB, would leave these small
tensors whole): the (64, 8) inputs and targets split by rows, the narrow MLP's parameters
(<= 512 bytes) stay whole on worker 0, the wide MLP's weights (1-2 KiB) are split too.
Tolerance: the same float32 math, summed in another order (each worker sums its rows, then an
all-reduce sums the parts): rtol 1e-5, atol 1e-6 on values of order 1.
"""

from typing import NamedTuple

import numpy as np
import pytest
import torch

import paratrain.frontend as gt
from paratrain.frontend.client.autostart import LocalServer
from frontend_helpers import wait_until

MIN_BYTES = 1024
RTOL, ATOL = 1e-5, 1e-6
BATCH, IN, OUT = 64, 8, 4
HIDDEN = {"narrow": 16, "wide": 64}  # wide: W1 is 8x64 floats (2 KiB), W2 64x4 (1 KiB): both split


@pytest.fixture(scope="module", params=[1, 2, 4])
def server(request, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"auto-shard-{request.param}") / "instructions.log"
    srv = LocalServer.start(request.param, extra_args=("--auto-shard", "--auto-shard-min-bytes", str(MIN_BYTES),
                                                       "--instruction-log", str(log)))
    srv.log, srv.workers = log, request.param
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    session = gt.connect(server.address)
    yield session
    gt.disconnect()


class MLP(gt.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = gt.nn.Linear(IN, hidden)
        self.fc2 = gt.nn.Linear(hidden, OUT)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _reference_run(hidden: int, steps: int) -> dict:
    """The same program in one PyTorch process (GT's weight layout: [in, out])."""
    state, x, y = _data(hidden)
    params = {name: torch.tensor(value, requires_grad=True) for name, value in state.items()}
    x, y = torch.tensor(x), torch.tensor(y)

    def forward():
        h = (x @ params["fc1.weight"] + params["fc1.bias"]).relu()
        return h @ params["fc2.weight"] + params["fc2.bias"]

    out = forward()
    loss = ((out - y) ** 2).mean()
    loss.backward()
    result = {"out": out.detach().numpy(), "loss": loss.item(),
              "grads": {name: p.grad.numpy().copy() for name, p in params.items()}, "losses": []}
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((forward() - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        result["losses"].append(loss.item())
    result["params"] = {name: p.detach().numpy() for name, p in params.items()}
    return result


def _data(hidden: int):
    rng = np.random.default_rng(hidden)
    state = {"fc1.weight": rng.standard_normal((IN, hidden)), "fc1.bias": rng.standard_normal(hidden),
             "fc2.weight": rng.standard_normal((hidden, OUT)) / 4, "fc2.bias": rng.standard_normal(OUT)}
    x, y = rng.standard_normal((BATCH, IN)), rng.standard_normal((BATCH, OUT))
    return {k: v.astype(np.float32) for k, v in state.items()}, x.astype(np.float32), y.astype(np.float32)


def _frontend_run(hidden: int, steps: int) -> dict:
    state, x, y = _data(hidden)
    model = MLP(hidden)
    model.load_state_dict(state)
    x, y = gt.from_numpy(x), gt.from_numpy(y)
    out = model(x)
    loss = ((out - y) ** 2).mean()
    loss.backward()
    result = {"out": out.data.numpy(), "loss": loss.item(),
              "grads": {name: p.grad.numpy() for name, p in model.named_parameters()}, "losses": []}
    optimizer = gt.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        result["losses"].append(loss.item())
    result["params"] = model.state_dict()
    return result


@pytest.mark.parametrize("width", HIDDEN)
def test_mlp_forward_gradients_and_sgd_steps_match_one_process(client, width):
    got, expected = _frontend_run(HIDDEN[width], steps=3), _reference_run(HIDDEN[width], steps=3)
    np.testing.assert_allclose(got["out"], expected["out"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=RTOL)
    for name, grad in expected["grads"].items():
        np.testing.assert_allclose(got["grads"][name], grad, rtol=RTOL, atol=ATOL, err_msg=f"gradient of {name}")
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=RTOL)
    for name, value in expected["params"].items():
        np.testing.assert_allclose(got["params"][name], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} after SGD")


class Ran(NamedTuple):
    command: str  # the operation, then what the dispatcher noted (signal, pattern)
    worker: int
    out: str  # the first result's dtype and whole shape, e.g. "float32[64,32]"


def _logged(log, op: str) -> list[Ran]:
    """The OP lines of `op` (written as workers report their timings), in GT's columns:
    elapsed | #seq | OP | WORKER w | command | size | details (op= ... out=hN:dtype[shape])."""
    found = []
    for line in log.read_text().splitlines():
        fields = [field.strip() for field in line.split(" | ")]
        if line.startswith("#") or len(fields) != 7 or fields[2] != "OP" or fields[4].split(" ")[0] != op:
            continue
        out = next((item.split(":", 1)[1].split(",h")[0] for item in fields[6].split() if item.startswith("out=")), "")
        found.append(Ran(fields[4], int(fields[3].split()[-1]), out))
    return found


@pytest.mark.parametrize("width", HIDDEN)
def test_the_log_shows_every_worker_computing_and_small_parameters_whole(client, server, width):
    before = len(_logged(server.log, "linear"))
    _frontend_run(HIDDEN[width], steps=1)
    # two layers, forward twice (before and in the step), on every worker
    linear = wait_until(lambda: _logged(server.log, "linear")[before:] if len(_logged(server.log, "linear")) >= before + 4
                        * server.workers else None, 30, "the linear layers' log lines")
    assert {ran.worker for ran in linear} == set(range(server.workers))
    if server.workers == 1:
        assert not any("auto-shard" in ran.command for ran in _logged(server.log, "upload"))
        return
    assert all("split rows: weight replicated" in ran.command for ran in linear)
    # The log names tensors by their whole shape; each split upload is logged once per worker.
    split = [ran.out for ran in _logged(server.log, "upload") if "auto-shard -> split 0" in ran.command]
    assert split.count(f"float32[{BATCH},{IN}]") % server.workers == 0 < split.count(f"float32[{BATCH},{IN}]")
    assert f"float32[{BATCH},{OUT}]" in split
    weights = {f"float32[{IN},{HIDDEN[width]}]", f"float32[{HIDDEN[width]},{OUT}]"}
    assert weights <= set(split) if width == "wide" else not weights & set(split)
    entered = [line for line in _logged(server.log, "tp_f")]
    assert {ran.worker for ran in entered} == set(range(server.workers))


def test_gt_programs_run_unchanged_on_split_tensors(client):
    rng = np.random.default_rng(7)
    array = rng.standard_normal((BATCH, IN)).astype(np.float32)
    x = gt.from_numpy(array)
    checks = {
        "data.numpy()": (x.data.numpy(), array),
        "view": (x.reshape(BATCH // 2, 2 * IN).numpy(), array.reshape(BATCH // 2, 2 * IN)),
        "flatten": (x.flatten().numpy(), array.reshape(-1)),
        "transpose": (x.transpose(0, 1).numpy(), array.T),
        "row": (x[3].numpy(), array[3]),
        "rows": (x[10:30].numpy(), array[10:30]),
        "column": (x[:, 2].numpy(), array[:, 2]),
        "columns": (x[..., 1:3].numpy(), array[..., 1:3]),
        "sum": (x.sum().item(), array.sum(dtype=np.float64)),
        "mean": (x.mean().item(), array.mean(dtype=np.float64)),
        "max": (x.max().item(), array.max()),
        "sum over rows": (x.sum(dim=0).numpy(), array.sum(axis=0)),
        "mean over columns": (x.mean(dim=1, keepdim=True).numpy(), array.mean(axis=1, keepdims=True)),
        "softmax": (x.softmax(dim=-1).numpy(), torch.tensor(array).softmax(dim=-1).numpy()),
        "where": (gt.where(x > 0, x, x * 0.5).numpy(), np.where(array > 0, array, array * 0.5)),
        "tolist": (np.array(x[:2].tolist()), array[:2]),
    }
    for name, (got, expected) in checks.items():
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=1e-5, err_msg=name)
    x += 1.0
    np.testing.assert_allclose(x.numpy(), array + 1.0, rtol=RTOL, atol=ATOL)
    assert gt.randn(BATCH, IN).numpy().shape == (BATCH, IN)
    dropped = gt.nn.functional.dropout(x, 0.5, True).numpy()
    kept = dropped != 0
    assert kept.any() and not kept.all()
    np.testing.assert_allclose(dropped[kept], 2 * (array + 1.0)[kept], rtol=RTOL)


def test_gt_start_honours_the_programs_environment(monkeypatch, tmp_path):
    log = tmp_path / "instructions.log"
    monkeypatch.setenv("GT_AUTO_SHARD", "1")
    monkeypatch.setenv("PARATRAIN_AUTO_SHARD_MIN_BYTES", str(MIN_BYTES))
    monkeypatch.setenv("PARATRAIN_INSTRUCTION_LOG", str(log))
    gt.start(2)
    try:
        array = np.arange(BATCH * IN, dtype=np.float32).reshape(BATCH, IN)
        np.testing.assert_array_equal((gt.from_numpy(array) * 2.0).numpy(), array * 2.0)
        multiplied = wait_until(lambda: {ran.worker for ran in _logged(log, "mul")} == {0, 1}, 30,
                                "mul on both workers")
    finally:
        gt.disconnect()
    assert multiplied
    assert any("auto-shard -> split 0 over [0,1]" in ran.command for ran in _logged(log, "upload"))


@pytest.mark.parametrize("shape, dtype, workers, split", [
    ((64, 8), "float32", (0, 1, 2, 3), 0),  # the batch axis first
    ((6, 64), "float32", (0, 1, 2, 3), 1),  # 6 rows do not divide by 4: the next axis that does
    ((6, 7, 11), "float32", (0, 1, 2, 3), None),  # no axis divides: stays whole
    ((2, 256), "float32", (0, 1, 2, 3), 1),  # fewer rows than workers
    ((16, 8), "float32", (0, 1), None),  # 512 bytes: under the threshold
    ((16, 8), "float64", (0, 1), 0),  # the same shape in 1 KiB
    ((1024,), "float32", (0,), None),  # one worker: nothing to split over
    ((), "float32", (0, 1), None),
])
def test_auto_placement_splits_large_tensors_batch_axis_first(shape, dtype, workers, split):
    from paratrain.frontend.dispatcher.auto_shard import AutoShard

    placement = AutoShard(MIN_BYTES).placement(shape, dtype, workers)
    assert (placement.split if placement is not None else None) == split
    if placement is not None:
        assert placement.workers == workers
