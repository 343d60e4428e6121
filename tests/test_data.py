"""Data sets: batches are a pure function of (seed, step, batch size), sharding them over
any world size gives back the global batch, each data set has the shapes its model needs,
and bad requests fail with a message that says what was wrong."""

import math
import re
import subprocess
import sys

import numpy as np

import pytest
import torch

from paratrain.data import DATASET_NAMES, build_dataset, rank_batch, shard

# Small options so every data set builds in milliseconds.
SMALL = {
    "teacher": {"in_dim": 8, "classes": 3},
    "regression": {"in_dim": 8, "out_dim": 2},
    "tokens": {"vocab_size": 32, "block_size": 16},
    "digits": {},
    "text": {"block_size": 16},  # the shipped Shakespeare
    "token_file": {"block_size": 16, "vocab_size": 300},  # and a path: small_token_file below
    "user": {},  # a FILE.py:FUNCTION spec: small_user_data below
}


@pytest.fixture(autouse=True)
def small_token_file(tmp_path, monkeypatch):
    """The token-file data set reads a file: 4,000 uint16 ids, as numpy writes nanoGPT's train.bin."""
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 300, 4000).astype(np.uint16).tofile(path)
    monkeypatch.setitem(SMALL, "token_file", {**SMALL["token_file"], "path": str(path)})
    return path


@pytest.fixture(autouse=True)
def small_user_data(tmp_path, monkeypatch):
    """--data FILE.py:FUNCTION: 100 (features, label) pairs from a user's file."""
    path = tmp_path / "my_data.py"
    path.write_text("import torch\n\ndef items():\n    x = torch.randn(100, 8, generator=torch.Generator()"
                    ".manual_seed(0))\n    return [(row, int(row.sum() > 0)) for row in x]\n")
    monkeypatch.setitem(SMALL, "user", {"spec": f"{path}:items"})
    return path


def _batches_equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_registry_names_every_data_set():
    assert DATASET_NAMES == ("teacher", "regression", "tokens", "digits", "text", "token_file", "user")


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_same_seed_and_step_give_the_same_batch(name):
    first = build_dataset(name, seed=3, **SMALL[name]).global_batch(5, 12)
    rebuilt = build_dataset(name, seed=3, **SMALL[name]).global_batch(5, 12)
    assert _batches_equal(first, rebuilt)


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_different_steps_and_seeds_give_different_batches(name):
    data = build_dataset(name, seed=3, **SMALL[name])
    other_seed = build_dataset(name, seed=4, **SMALL[name])
    assert not torch.equal(data.global_batch(0, 12)[0], data.global_batch(1, 12)[0])
    assert not torch.equal(data.global_batch(0, 12)[0], other_seed.global_batch(0, 12)[0])


@pytest.mark.parametrize("name", DATASET_NAMES)
def test_batch_does_not_depend_on_what_was_drawn_before(name):
    fresh = build_dataset(name, seed=0, **SMALL[name])
    used = build_dataset(name, seed=0, **SMALL[name])
    for step in range(4):
        used.global_batch(step, 12)
    assert _batches_equal(fresh.global_batch(7, 12), used.global_batch(7, 12))


@pytest.mark.parametrize("name", DATASET_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
def test_shards_concatenate_to_the_global_batch(name, world_size):
    batch = build_dataset(name, seed=0, **SMALL[name]).global_batch(2, 12)
    shards = [shard(batch, rank, world_size) for rank in range(world_size)]
    for i, whole in enumerate(batch):
        assert torch.equal(torch.cat([s[i] for s in shards]), whole)
    assert all(s[0].shape[0] == 12 // world_size for s in shards)


def test_shard_takes_a_contiguous_slice_of_a_single_tensor():
    assert torch.equal(shard(torch.arange(8), 2, 4), torch.tensor([4, 5]))


@pytest.mark.parametrize(
    "batch, rank, world_size, message",
    [
        (torch.zeros(10), 0, 4, "batch size 10 is not divisible by world_size 4"),
        (torch.zeros(8), 4, 4, r"rank must be in \[0, 4\), got 4"),
        (torch.zeros(8), 0, 0, "world_size must be a positive integer, got 0"),
        ((torch.zeros(8), torch.zeros(6)), 0, 2, r"share their first dimension, got sizes \[6, 8\]"),
    ],
)
def test_shard_rejects_what_it_cannot_split(batch, rank, world_size, message):
    with pytest.raises(ValueError, match=message):
        shard(batch, rank, world_size)


def test_teacher_gives_normal_inputs_and_teacher_labels():
    data = build_dataset("teacher", seed=0, in_dim=16, classes=5)
    assert (data.task, data.input_dim, data.num_classes) == ("classification", 16, 5)
    x_BI, labels_B = data.global_batch(0, 4096)
    assert x_BI.shape == (4096, 16) and labels_B.shape == (4096,) and labels_B.dtype == torch.long
    assert abs(x_BI.mean().item()) < 0.05 and abs(x_BI.std().item() - 1) < 0.05
    assert torch.equal(labels_B, (x_BI @ data.teacher_IC).argmax(dim=1))
    assert set(labels_B.tolist()) == set(range(5))


def test_regression_targets_are_a_fixed_linear_map_plus_small_noise():
    data = build_dataset("regression", seed=0, in_dim=32, out_dim=4, noise_std=0.01)
    assert (data.task, data.input_dim, data.output_dim) == ("regression", 32, 4)
    x_BI, y_BO = data.global_batch(0, 2048)
    assert y_BO.shape == (2048, 4)
    residual = y_BO - x_BI @ data.w_IO
    assert abs(residual.std().item() - 0.01) < 0.002
    assert abs(y_BO.var().item() - 1) < 0.2  # w* is scaled so the targets have unit variance


def test_regression_output_width_defaults_to_input_width_for_mlp16():
    data = build_dataset("regression", seed=0, in_dim=24)
    assert data.global_batch(0, 2)[1].shape == (2, 24)


def test_tokens_targets_are_the_inputs_shifted_by_one_along_the_chain():
    data = build_dataset("tokens", seed=0, vocab_size=32, block_size=16, branching=3)
    assert (data.task, data.vocab_size, data.block_size) == ("language_modeling", 32, 16)
    idx_BT, targets_BT = data.global_batch(0, 8)
    assert idx_BT.shape == targets_BT.shape == (8, 16) and idx_BT.dtype == torch.long
    assert torch.equal(idx_BT[:, 1:], targets_BT[:, :-1])
    allowed_VN = data.successors_VN
    assert (allowed_VN[idx_BT] == targets_BT.unsqueeze(-1)).any(dim=-1).all()
    assert data.chain_entropy_bound == pytest.approx(math.log(3))


def test_tokens_loss_is_cross_entropy_per_token():
    data = build_dataset("tokens", seed=0, vocab_size=32, block_size=16)
    idx_BT, targets_BT = data.global_batch(0, 4)
    uniform_BTV = torch.zeros(4, 16, 32)
    assert data.loss(uniform_BTV, targets_BT).item() == pytest.approx(math.log(32))


def test_digits_are_normalised_8x8_images_with_a_fixed_held_out_split():
    data = build_dataset("digits", seed=0)
    other = build_dataset("digits", seed=1)
    shape_info = (data.task, data.num_classes, data.in_channels, data.image_size)
    assert shape_info == ("classification", 10, 1, 8)
    assert len(data) == 1500
    images_BCSS, labels_B = data.global_batch(0, 64)
    assert images_BCSS.shape == (64, 1, 8, 8) and labels_B.dtype == torch.long
    assert abs(data.train_images.mean().item()) < 1e-4
    assert abs(data.train_images.std().item() - 1) < 1e-4
    held_images, held_labels = data.held_out_set()
    assert held_images.shape == (297, 1, 8, 8)
    # The seed changes the order of the training images, never which images are held out.
    assert _batches_equal((held_images, held_labels), other.held_out_set())


def test_digits_are_scikit_learns_images_read_without_importing_it():
    """The file scikit-learn ships, read as its load_digits reads it, bit for bit; the read itself
    imports neither scikit-learn nor SciPy (seconds of CPU in every rank)."""
    program = ("import sys; from paratrain.data.digits import _load_images; images, labels = _load_images(); "
               "print(sorted(m for m in ('sklearn', 'scipy') if m in sys.modules), tuple(images.shape))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "(1797,", "1,", "8,", "8)"]
    from sklearn.datasets import load_digits

    from paratrain.data.digits import _load_images

    digits = load_digits()
    images_NCSS, labels_N = _load_images()
    assert torch.equal(images_NCSS, torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(labels_N, torch.tensor(digits.target, dtype=torch.long))


def test_digits_steps_walk_a_fixed_order_and_wrap_around():
    data = build_dataset("digits", seed=0)
    epoch_labels = torch.cat([data.global_batch(step, 500)[1] for step in range(3)])
    assert torch.equal(epoch_labels, data.train_labels[data.order_N])
    # Step 1 of 1000 covers positions 1000..1999: the last 500 wrap to the start of the order.
    assert torch.equal(data.global_batch(1, 1000)[0][500:], data.global_batch(0, 500)[0])


def test_unknown_data_set_lists_valid_names():
    valid = "teacher, regression, tokens, digits, text"
    with pytest.raises(ValueError, match=f"unknown data set 'mnist'; valid: {valid}"):
        build_dataset("mnist", seed=0)


def test_unknown_option_names_valid_options():
    message = "data set 'tokens' has no option 'vocab'; valid: vocab_size, block_size, branching"
    with pytest.raises(ValueError, match=message):
        build_dataset("tokens", seed=0, vocab=3)


@pytest.mark.parametrize(
    "name, seed, options, message",
    [
        ("teacher", -1, {}, "seed must be a non-negative integer, got -1"),
        ("teacher", 0, {"classes": 0}, "classes must be a positive integer, got 0"),
        ("regression", 0, {"noise_std": -1.0}, "noise_std must be >= 0"),
        ("digits", 0, {"held_out": 1797}, r"held_out must be in \[0, 1797\)"),
    ],
)
def test_bad_arguments_are_rejected_with_the_reason(name, seed, options, message):
    with pytest.raises(ValueError, match=message):
        build_dataset(name, seed, **options)


@pytest.mark.parametrize(
    "step, batch_size, message", [(-1, 4, "step must be"), (0, 0, "batch_size must be")]
)
def test_bad_batch_requests_are_rejected(step, batch_size, message):
    with pytest.raises(ValueError, match=message):
        build_dataset("teacher", seed=0).global_batch(step, batch_size)


@pytest.mark.parametrize("name, options", [
    ("teacher", {}), ("regression", {"in_dim": 8}), ("tokens", {"block_size": 8}),
])
@pytest.mark.parametrize("batch_size, world", [(256, 4), (96, 2), (64, 1), (12, 3)])
def test_a_rank_draws_exactly_its_rows_of_the_global_batch(name, options, batch_size, world):
    """rank_batch draws only the rank's rows (blocks of ROWS_PER_BLOCK, each its own generator),
    and they are the rows of the global batch: the data cannot depend on the world size."""
    dataset = build_dataset(name, seed=3, **options)
    whole = dataset.global_batch(5, batch_size)
    for rank in range(world):
        mine = rank_batch(dataset, 5, batch_size, rank, world)
        for got, expected in zip(mine, shard(whole, rank, world)):
            assert torch.equal(got, expected)


def test_a_token_file_gives_windows_of_its_ids_and_holds_out_its_last_tenth(small_token_file):
    ids = np.fromfile(small_token_file, dtype=np.uint16).astype(np.int64)
    data = build_dataset("token_file", seed=0, **SMALL["token_file"])
    inputs, targets = data.global_batch(3, 8)
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == torch.int64
    for row_in, row_target in zip(inputs.tolist(), targets.tolist()):
        starts = [i for i in range(3600 - 16) if ids[i:i + 16].tolist() == row_in]  # training ids only
        assert starts and ids[starts[0] + 1:starts[0] + 17].tolist() == row_target
    held_out = data.validation_batches(8, 1)[0][0]
    assert held_out[0].tolist() == ids[3600:3616].tolist()  # the last 10% begins at id 3,600


@pytest.mark.parametrize("write, options, message", [
    (lambda p: np.arange(30, dtype=np.uint16).tofile(p), {}, "is too short: 30 ids give 27 for training"),
    (lambda p: np.full(4000, 300, dtype=np.uint16).tofile(p), {}, "id 300 (token 0) is beyond the model's vocabulary of 300"),
    (lambda p: p.write_bytes(bytes(4001)), {}, "holds 4001 bytes, not a whole number of uint16 ids (2 bytes each)"),
    (lambda p: p.write_bytes(bytes(4002)), {"dtype": "uint32"}, "(is it uint16? then drop ':uint32')"),
])
def test_a_token_file_that_cannot_serve_is_one_line(tmp_path, write, options, message):
    path = tmp_path / "bad.bin"
    write(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_dataset("token_file", seed=0, **{**SMALL["token_file"], "path": str(path), **options})
