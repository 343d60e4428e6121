"""Models: shapes, parameter counts, deterministic init, the named parts that parallelism will
shard, clear errors, and that each one learns its data set in a few dozen steps."""

import pytest
import torch

from paratrain.data import build_dataset
from paratrain.models import (
    MODEL_NAMES,
    GPTConfig,
    build_model,
    count_parameters,
    format_count,
    gpt_parameter_count,
    model_config,
)
from paratrain.models.gpt import GPT


def test_registry_names_every_preset():
    assert MODEL_NAMES == ("mlp", "mlp16", "cnn", "gpt-tiny", "gpt-small", "gpt-seed",
                           "llama-tiny", "llama-small", "tinyllama-1.1b", "moe-tiny", "moe-small", "mixtral-8x7b",
                           "olmoe-1b-7b")


@pytest.mark.parametrize(
    "name, overrides, input_shape, output_shape",
    [
        ("mlp", {}, (5, 64), (5, 10)),
        ("mlp16", {"width": 32, "depth": 4}, (5, 32), (5, 32)),
        ("cnn", {}, (5, 1, 8, 8), (5, 10)),
        ("cnn", {"in_channels": 3, "image_size": 32, "classes": 7}, (2, 3, 32, 32), (2, 7)),
        # Four blocks on 8x8: the fourth has nothing left to pool and keeps its 1x1 size.
        ("cnn", {"channels": [8, 8, 8, 8], "hidden": 16}, (2, 1, 8, 8), (2, 10)),
    ],
)
def test_dense_models_map_inputs_to_expected_shapes(name, overrides, input_shape, output_shape):
    model = build_model(name, **overrides)
    assert model(torch.randn(input_shape)).shape == output_shape


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
def test_gpt_maps_idx_BT_to_logits_BTV(name):
    model = build_model(name)
    vocab, block = model.config.vocab_size, model.config.block_size
    for T in (1, 7, block):
        assert model(torch.randint(vocab, (3, T))).shape == (3, T, vocab)


def test_gpt_rejects_sequences_longer_than_block_size():
    model = build_model("gpt-tiny", block_size=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_model("gpt-tiny").eval()
    idx_BT = torch.randint(256, (2, 16))
    changed_BT = idx_BT.clone()
    changed_BT[:, 10:] = (changed_BT[:, 10:] + 1) % 256
    before, after = model(idx_BT), model(changed_BT)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_gpt_exposes_the_parts_parallelism_will_split():
    model = build_model("gpt-small")
    d, m, v = 128, 512, 512
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["tok_emb.weight"] == (v, d)
    assert shapes["pos_emb.weight"] == (64, d)
    assert len(model.blocks) == 8
    assert shapes["blocks.7.attn.qkv.weight"] == (3 * d, d)
    assert shapes["blocks.7.attn.proj.weight"] == (d, d)
    assert shapes["blocks.7.mlp.up.weight"] == (m, d)
    assert shapes["blocks.7.mlp.down.weight"] == (d, m)
    assert {"blocks.0.ln1.weight", "blocks.0.ln2.weight", "ln_f.weight"} <= shapes.keys()
    assert shapes["head.weight"] == (v, d)
    # Separate weights, so pipeline stages can hold the embedding and the head apart.
    assert model.head.weight.data_ptr() != model.tok_emb.weight.data_ptr()


@pytest.mark.parametrize(
    "config",
    [
        model_config("gpt-tiny"),
        model_config("gpt-small"),
        GPTConfig(n_layer=3, d_model=48, n_head=6, d_mlp=100, vocab_size=97, block_size=10),
    ],
)
def test_gpt_parameter_count_matches_the_built_model(config):
    assert gpt_parameter_count(config) == count_parameters(GPT(config))


def test_gpt_seed_has_205M_parameters_not_512M():
    config = model_config("gpt-seed")
    with torch.device("meta"):  # shapes only: no 800 MB of weights allocated
        model = GPT(config)
    assert gpt_parameter_count(config) == count_parameters(model) == 204_746_752
    assert format_count(gpt_parameter_count(config)) == "204.7M"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mlp", 64 * 256 + 256 + 256 * 10 + 10),
        ("mlp16", 16 * (1024 * 1024 + 1024)),
        (
            "cnn",
            (9 * 1 * 32 + 32) + (9 * 32 * 64 + 64) + (9 * 64 * 128 + 128)  # conv blocks
            + (128 * 512 + 512) + (512 * 10 + 10),  # fc1 (128 features x 1x1 left), fc2
        ),
    ],
)
def test_dense_model_parameter_counts(name, expected):
    with torch.device("meta"):
        assert count_parameters(build_model(name)) == expected


def test_format_count_is_short_and_readable():
    assert [format_count(n) for n in (999, 19_210, 16_793_600, 2_500_000_000)] == [
        "999", "19.2K", "16.8M", "2.5B"
    ]


@pytest.mark.parametrize(
    "name, overrides", [("mlp", {}), ("mlp16", {"width": 32}), ("cnn", {}), ("gpt-small", {})]
)
def test_same_seed_gives_same_initial_weights(name, overrides):
    def weights(seed):
        torch.manual_seed(seed)
        return build_model(name, **overrides).state_dict()

    first, again, other = weights(0), weights(0), weights(1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_unknown_model_name_lists_valid_names():
    valid = "mlp, mlp16, cnn, gpt-tiny, gpt-small, gpt-seed"
    with pytest.raises(ValueError, match=f"unknown model 'gpt'; valid: {valid}"):
        build_model("gpt")


def test_unknown_override_names_valid_fields():
    message = "model 'mlp' has no option 'width'; valid: in_dim, hidden, classes"
    with pytest.raises(ValueError, match=message):
        build_model("mlp", width=3)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("gpt-tiny", {"d_model": 30}, r"d_model \(30\) must be divisible by n_head \(4\)"),
        ("gpt-tiny", {"n_layer": 0}, "n_layer must be a positive integer, got 0"),
        ("gpt-tiny", {"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
        ("mlp16", {"depth": -1}, "depth must be a positive integer"),
        ("cnn", {"channels": ()}, "channels must be a non-empty sequence"),
        ("cnn", {"channels": (32, 0)}, "channels must all be positive integers"),
    ],
)
def test_invalid_config_is_rejected_with_the_reason(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(name, **overrides)


@pytest.fixture
def one_thread():
    """These models are too small for an op to be worth splitting across threads; on a busy
    2-core machine the thread hand-offs alone made training several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loss_on(model, dataset, batch):
    with torch.no_grad():
        return dataset.loss(model(batch[0]), batch[1]).item()


def _train(model_name, model_overrides, dataset, optimizer, batch_size, eval_batch, steps=50):
    """Plain single-process training; returns the loss on a fixed batch before and after."""
    torch.manual_seed(0)
    model = build_model(model_name, **model_overrides)
    opt = optimizer(model.parameters())
    before = _loss_on(model, dataset, eval_batch)
    for step in range(steps):
        inputs, targets = dataset.global_batch(step, batch_size)
        loss = dataset.loss(model(inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, _loss_on(model, dataset, eval_batch)


def test_mlp_learns_the_teacher_task(one_thread):
    data = build_dataset("teacher", seed=0)
    before, after = _train(
        "mlp", {}, data, lambda p: torch.optim.SGD(p, lr=0.5), 256, data.global_batch(10_000, 1024)
    )
    assert after < 0.4 * before  # ~2.3 (chance) -> ~0.6


def test_mlp16_learns_regression(one_thread):
    # A plain 16-deep ReLU stack as narrow as its input loses part of the signal at every
    # ReLU, so it learns this slowly: the point of mlp16 is its gradient volume, not its fit.
    data = build_dataset("regression", seed=0, in_dim=64)
    before, after = _train(
        "mlp16", {"width": 64}, data, lambda p: torch.optim.AdamW(p, lr=1e-2), 256,
        data.global_batch(10_000, 1024),
    )
    assert after < 0.97 * before  # ~0.99 -> ~0.95


def test_cnn_learns_digits(one_thread):
    data = build_dataset("digits", seed=0)
    before, after = _train(
        "cnn", {}, data, lambda p: torch.optim.AdamW(p, lr=1e-3), 64, data.held_out_set()
    )
    assert after < 0.3 * before  # ~2.3 (chance) on held-out images -> well under 0.7


def test_gpt_tiny_learns_the_token_chain(one_thread):
    data = build_dataset("tokens", seed=0)
    before, after = _train(
        "gpt-tiny", {}, data, lambda p: torch.optim.AdamW(p, lr=1e-2), 8, data.global_batch(10_000, 32)
    )
    assert before > 5.0  # about log(256) = 5.55: nothing known yet
    assert after < 3.0  # on its way down to at most log(4) = 1.39
