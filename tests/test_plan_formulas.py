"""The planner's FLOPs and memory formulas checked against what torch actually does: matmuls
counted by torch.utils.flop_counter, tensors autograd saves, bytes an AdamW step allocates.
Every check here is exact (integers of FLOPs or bytes), except where a test says otherwise."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from paratrain.launch import run
from paratrain.models import PRESETS, build_model, gpt_parameter_count
from paratrain.models.gpt import Block
from paratrain.parallel.data import build_data_parallel
from paratrain.plan.activations import Software, head_activation_bytes, layer_activation_bytes
from paratrain.plan.flops import flash_backward_flops, narayanan_flops, step_flops
from paratrain.plan.memory import Layout, layer_parameters, memory_per_gpu, state_bytes
from paratrain.plan.shapes import GPTShape, named_shape

PARATRAIN_CPU = Software(precision="fp32", flash_attention=True, dropout=False, sp_keeps_gathered=True,
                         even_layers=False)


def _sdpa_cpu(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


# flop_counter has formulas for the CUDA attention kernels, not for the CPU flash kernel SDPA
# picks here; these reuse its own formulas for the CPU kernel's arguments.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small"])
def test_step_flops_equal_the_matmuls_torch_counts(name):
    torch.manual_seed(0)
    model, config = build_model(name), PRESETS[name]
    batch = 3
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert any("flash_attention_for_cpu" in op for op in counts), counts  # attention was counted
    # torch counts the flash backward's recomputed Q K^T; the paper's model FLOPs do not.
    shape = GPTShape.from_config(config)
    assert counter.get_total_flops() == step_flops(shape, batch) + flash_backward_flops(shape, batch)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_step_flops_equal_narayanan_equation_3_when_mlp_is_4h(recompute):
    shape = named_shape("gpt3-175b")
    assert step_flops(shape, 1536, recompute) == pytest.approx(narayanan_flops(shape, 1536, recompute), rel=1e-12)


def test_selective_recompute_adds_the_attention_core_forward_only():
    shape = GPTShape(layers=4, hidden=256, heads=8, seq=512, vocab=1000)
    extra = step_flops(shape, 2, "selective") - step_flops(shape, 2)
    assert extra == shape.layers * 4 * 2 * shape.seq**2 * shape.hidden


def _saved_bytes(fn, exclude=()):
    """Bytes of the distinct storages autograd saves while `fn` runs, less those in `exclude`."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(n for ptr, n in storages.items() if ptr not in skip)


@pytest.mark.parametrize("batch", [1, 4])
def test_layer_activations_equal_what_autograd_saves_in_a_block(batch):
    config = PRESETS["gpt-small"]
    torch.manual_seed(0)
    block = Block(config)
    x = torch.randn(batch, config.block_size, config.d_model, requires_grad=True)
    saved = _saved_bytes(lambda: block(x), exclude=list(block.parameters()))
    assert saved == layer_activation_bytes(GPTShape.from_config(config), batch, PARATRAIN_CPU)


def test_model_activations_are_the_layers_plus_the_head():
    """The whole GPT with its loss: the layers, the head's terms, and the token and position
    indices the embeddings keep (int64, not modelled: 8 bytes per token)."""
    config = PRESETS["gpt-small"]
    shape, batch = GPTShape.from_config(config), 2
    torch.manual_seed(0)
    model = build_model("gpt-small")
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size))
    saved = _saved_bytes(lambda: F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()),
                         exclude=list(model.parameters()))
    indices = 8 * batch * shape.seq * 2 + 8 * shape.seq  # tok_emb's and the loss's targets, pos_emb's
    predicted = shape.layers * layer_activation_bytes(shape, batch, PARATRAIN_CPU)
    predicted += head_activation_bytes(shape, batch, PARATRAIN_CPU)
    assert saved - indices == pytest.approx(predicted, rel=1e-3)  # the loss keeps a few scalars besides


def test_korthikanti_equations_for_megatrons_layer():
    megatron = Software(precision="bf16", flash_attention=False, dropout=True)
    shape = GPTShape(layers=1, hidden=1024, heads=16, seq=2048, vocab=1000)
    s, b, h, a, t = shape.seq, 2, shape.hidden, shape.heads, 4
    sbh = s * b * h
    norm_stats = 16 * s * b  # fp32 mean and rstd of two norms: below the papers' rounding
    layer = lambda **kw: layer_activation_bytes(shape, b, megatron, **kw)  # noqa: E731
    assert layer() - norm_stats == pytest.approx(sbh * (34 + 5 * a * s / h))  # eq. (1)
    assert layer(tp=t) - norm_stats == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))  # eq. (2)
    assert layer(tp=t, sequence_parallel=True) - norm_stats / t == pytest.approx(
        sbh / t * (34 + 5 * a * s / h))  # eq. (4)
    assert layer(tp=t, sequence_parallel=True, recompute="selective") - norm_stats / t == pytest.approx(
        34 * sbh / t)  # eq. (6)
    assert layer(tp=t, sequence_parallel=True, recompute="full") == 2 * sbh / t


def _state_bytes_allocated(parameters, optimizer) -> int:
    """Distinct storages of the parameters, their gradients and the optimizer's state."""
    tensors = [p for p in parameters] + [p.grad for p in parameters if p.grad is not None]
    tensors += [value for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_state_memory_equals_what_an_adamw_step_allocates():
    torch.manual_seed(0)
    model, config = build_model("gpt-tiny"), PRESETS["gpt-tiny"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    params = list(model.parameters())
    shape = GPTShape.from_config(config)
    count = sum(p for p, _ in layer_parameters(shape, 1))
    tensors = sum(n for _, n in layer_parameters(shape, 1))
    assert (count, tensors) == (gpt_parameter_count(config), len(params))
    assert _state_bytes_allocated(params, optimizer) == sum(state_bytes(count, tensors, 1, 0, "fp32"))


def _zero_one_rank(group):
    torch.manual_seed(0)
    model, config = build_model("gpt-tiny"), PRESETS["gpt-tiny"]
    dp = build_data_parallel(model, group, mode="ddp", zero=1)
    optimizer = dp.make_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    dp.finish_gradients()
    dp.step(optimizer)
    return _state_bytes_allocated(list(model.parameters()) + [dp.shard], optimizer)


def test_zero_one_state_memory_equals_what_each_rank_allocates():
    allocated = run(_zero_one_rank, 3, launcher="threads")
    config = PRESETS["gpt-tiny"]
    count = gpt_parameter_count(config)
    predicted = sum(state_bytes(count, 17, 3, 1, "fp32"))  # the largest shard: ceil(count / 3)
    assert max(allocated.values()) == predicted
    assert min(allocated.values()) < predicted or count % 3 == 0


def test_memory_per_gpu_shards_parameters_over_tp_and_pp():
    shape = named_shape("gpt-small")
    software = Software(precision="fp32")
    whole = memory_per_gpu(shape, Layout(), 8, software)
    split = memory_per_gpu(shape, Layout(tp=2, pp=2, micro_batch=1, schedule="1f1b"), 8, software)
    assert whole.params == shape.parameters()
    assert shape.parameters() / 4 < split.params < shape.parameters() / 2  # replicated norms, biases


@pytest.mark.parametrize("name", ["llama-tiny", "llama-small"])
def test_llama_step_flops_equal_the_matmuls_torch_counts(name):
    """SwiGLU's three matrices and grouped-query attention's smaller k/v, as torch counts them."""
    torch.manual_seed(0)
    model, config = build_model(name), PRESETS[name]
    batch = 2
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    shape = GPTShape.from_config(config)
    assert shape.kv_heads < shape.heads and shape.gated
    assert counter.get_total_flops() == step_flops(shape, batch) + flash_backward_flops(shape, batch)


@pytest.mark.parametrize("name", ["llama-tiny", "llama-small", "tinyllama-1.1b"])
def test_llama_shape_counts_the_models_parameters(name):
    from paratrain.models import llama_parameter_count

    shape = named_shape(name)
    assert shape.parameters() == llama_parameter_count(PRESETS[name])
    tp = 2
    per_rank = sum(params for params, _ in layer_parameters(shape, tp))
    # Everything but the replicated RMSNorm vectors is split over tp.
    norms = (2 * shape.layers + 1) * shape.hidden
    assert per_rank == pytest.approx((shape.parameters() - norms) / tp + norms)


def _sharded_rank(group, zero):
    torch.manual_seed(0)
    model, config = build_model("gpt-tiny"), PRESETS["gpt-tiny"]
    dp = build_data_parallel(model, group, mode="ddp", zero=zero)
    optimizer = dp.make_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-3))
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    F.cross_entropy(dp.module(tokens).flatten(0, 1), tokens.flatten()).backward()
    dp.finish_gradients()
    dp.step(optimizer)
    dp.zero_grad()
    shards = [dp.shard] if zero < 3 else [unit.shard for unit in dp.units]
    held = [p for p in model.parameters() if p.untyped_storage().nbytes()]  # FSDP's are freed at rest
    dp.close()
    return _state_bytes_allocated(held + shards, optimizer)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_two_and_three_state_memory_equals_what_each_rank_holds(zero):
    """At rest, after a step: ZeRO-2 without the whole gradients, ZeRO-3 (FSDP) only shards.
    FSDP's shards are per unit, so their sizes round per unit and its step counters count units,
    not parameter tensors: within 0.1%."""
    held = run(_sharded_rank, 3, launcher="threads", args=(zero,))
    count = gpt_parameter_count(PRESETS["gpt-tiny"])
    predicted = sum(state_bytes(count, 17, 3, zero, "fp32"))
    assert max(held.values()) == pytest.approx(predicted, rel=1e-3)
