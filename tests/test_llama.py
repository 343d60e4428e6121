"""The Llama-family model: shapes, parameter counts (TinyLlama-1.1B's published 1,100,048,384),
causality, grouped-query attention equal to full attention with repeated key/value heads,
rotary positions, tied embeddings, and that it learns the token data set."""

import pytest
import torch

from paratrain.data import build_dataset
from paratrain.models import build_model, count_parameters, llama_parameter_count, model_config
from paratrain.models.llama import rotate


@pytest.mark.parametrize("name", ["llama-tiny", "llama-small"])
def test_llama_maps_idx_BT_to_logits_BTV_and_counts_its_parameters(name):
    model = build_model(name)
    vocab, block = model.config.vocab_size, model.config.block_size
    for T in (1, 7, block):
        assert model(torch.randint(vocab, (2, T))).shape == (2, T, vocab)
    assert count_parameters(model) == llama_parameter_count(model.config)


def test_tinyllama_preset_has_the_published_parameter_count():
    config = model_config("tinyllama-1.1b")
    assert llama_parameter_count(config) == 1_100_048_384
    with torch.device("meta"):
        assert count_parameters(build_model("tinyllama-1.1b")) == 1_100_048_384


def test_llama_is_causal():
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    idx_BT = torch.randint(256, (2, 16))
    changed_BT = idx_BT.clone()
    changed_BT[:, 10:] = (changed_BT[:, 10:] + 1) % 256
    before, after = model(idx_BT), model(changed_BT)
    assert torch.allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_grouped_query_attention_has_smaller_key_value_projections():
    model = build_model("llama-tiny")  # 4 query heads, 2 key/value heads of width 16
    attn = model.layers[0].attn
    assert attn.wq.weight.shape == (64, 64) and attn.wk.weight.shape == (32, 64) and attn.wv.weight.shape == (32, 64)


def test_gqa_equals_full_attention_with_each_kv_head_repeated():
    torch.manual_seed(0)
    gqa = build_model("llama-tiny", n_layer=1)
    full = build_model("llama-tiny", n_layer=1, n_kv_head=4)
    full.load_state_dict({k: v for k, v in gqa.state_dict().items() if ".wk." not in k and ".wv." not in k},
                         strict=False)
    with torch.no_grad():
        for name in ("wk", "wv"):  # kv head g serves query heads 2g and 2g + 1
            w_GKD = getattr(gqa.layers[0].attn, name).weight.view(2, 16, 64)
            getattr(full.layers[0].attn, name).weight.copy_(w_GKD.repeat_interleave(2, dim=0).reshape(64, 64))
    idx_BT = torch.randint(256, (2, 12))
    torch.testing.assert_close(gqa(idx_BT), full(idx_BT), rtol=1e-5, atol=1e-6)


def test_rotary_embedding_keeps_norms_and_depends_only_on_relative_position():
    torch.manual_seed(0)
    q_K, k_K = torch.randn(16), torch.randn(16)
    x_BTNK = torch.stack([q_K, k_K]).expand(8, 2, 16).permute(1, 0, 2).unsqueeze(2)  # (2, 8, 1, 16)
    rotated = rotate(x_BTNK, 10000.0)
    torch.testing.assert_close(rotated.norm(dim=-1), x_BTNK.norm(dim=-1))
    q_T, k_T = rotated[0, :, 0], rotated[1, :, 0]
    assert torch.allclose(q_T[3] @ k_T[1], q_T[6] @ k_T[4], atol=1e-5)  # both 2 apart


def test_tied_embeddings_share_one_table():
    model = build_model("llama-tiny", tie_embeddings=True)
    assert model.output.weight is model.tok_emb.weight
    assert count_parameters(model) == llama_parameter_count(model.config)


def test_llama_config_names_what_does_not_divide():
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by n_kv_head \(3\)"):
        model_config("llama-tiny", n_kv_head=3)


def test_llama_tiny_learns_the_token_data():
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    data = build_dataset("tokens", 0, vocab_size=256, block_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        inputs, targets = data.global_batch(step, 16)
        loss = data.loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_a_llama_samples_text():
    from paratrain.train.sample import generate

    torch.manual_seed(0)
    text = generate(build_model("llama-tiny"), b"To be", 5, seed=1)
    assert text.startswith("To be") and len(text.encode("utf-8", errors="surrogateescape")) >= 5


def test_the_memory_estimate_counts_a_llamas_parameters_per_rank():
    from paratrain.train.config import TrainConfig, apply_overrides
    from paratrain.train.memory import estimate

    config = apply_overrides(TrainConfig(), {"model.name": "llama-small", "parallel.tp": 2, "parallel.pp": 2,
                                             "parallel.microbatches": 4})
    stages = estimate(config, 4)
    shape = model_config("llama-small")
    norms = (2 * shape.n_layer + 1) * shape.d_model  # RMSNorm vectors, replicated over tp
    assert sum(stage.params for stage in stages) == (llama_parameter_count(shape) - norms) // 2 + norms
