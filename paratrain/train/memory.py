"""Parameters and estimated memory per rank of a GPT or Llama on a dp x pp x tp mesh, before it
starts.

Computed from the configuration alone (nothing is allocated), so it works for the seed's
204.7M-parameter GPT on a laptop. Weights and gradients are fp32; optimizer state is one
fp32 copy per parameter for SGD with momentum and two for AdamW. Activations follow
Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models"):
a block stores s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes in 16-bit precision (doubled here for
fp32), or only its input with activation checkpointing, and the head its logits shard; times
the microbatches the schedule keeps in flight on that rank at its peak. A Llama's parameters are
exact (grouped-query k/v, SwiGLU's three matrices, RMSNorm vectors); its activations use the same
GPT-layer formula, an approximation.

With `--zero`, data parallelism divides what it shards by the dp size: ZeRO-1 the optimizer
state, ZeRO-2 the gradients too, ZeRO-3 the parameters too. ZeRO-1 and 2 keep, besides the
whole parameters, this rank's 1/dp of them as the optimizer's own tensor (ZeRO-1 the same of the
gradients besides the whole ones), as ours does.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.models import GPTConfig, LlamaConfig, model_config
from paratrain.parallel.data.strategy import strategy_of
from paratrain.parallel.pipeline.schedules import build_schedule
from paratrain.parallel.pipeline.simulate import simulate
from paratrain.parallel.pipeline.split import balanced_partition

GIB = 1 << 30


@dataclass
class StageMemory:
    stage: int
    layers: str
    params: int  # per rank, after tensor-parallel sharding
    weights: float  # bytes
    grads: float
    optimizer: float
    activations: float
    in_flight: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def _layer_params(config: GPTConfig | LlamaConfig, tp: int) -> list[float]:
    """Per-rank parameters of each pipeline layer: embeddings, blocks, head."""
    d, m, v, t = config.d_model, config.d_mlp, config.vocab_size, tp
    if isinstance(config, LlamaConfig):  # no biases or positions; RMSNorms replicated
        block = _llama_block_matrices(config) / t + 2 * d
        head = d if config.tie_embeddings else d * v / t + d  # a tied head's table is the embedding's
        return [v * d / t] + [block] * config.n_layer + [head]
    embedding = v * d / t + config.block_size * d  # token table sharded by vocab; positions replicated
    sharded = (3 * d * d + 3 * d) + d * d + (d * m + m) + m * d  # qkv, proj.w, up, down.w
    replicated = 2 * d + 4 * d  # row-parallel biases, two layer norms
    block = sharded / t + replicated
    head = d * v / t + 2 * d
    return [embedding] + [block] * config.n_layer + [head]


def _llama_block_matrices(config: LlamaConfig) -> int:
    d, kv = config.d_model, config.n_kv_head * config.head_dim
    return 2 * d * d + 2 * d * kv + 3 * d * config.d_mlp  # wq, wo; wk, wv; w1, w2, w3


def _layer_costs(config: GPTConfig | LlamaConfig) -> list[int]:
    """Matmul parameters: what split.balanced_partition balances (the same cut as training)."""
    d, m, v = config.d_model, config.d_mlp, config.vocab_size
    block = _llama_block_matrices(config) if isinstance(config, LlamaConfig) else 4 * d * d + 2 * d * m
    return [1] + [block] * config.n_layer + [d * v]


def estimate(config, world: int) -> list[StageMemory]:
    par = config.parallel
    gpt = model_config(config.model.name, **config.model.overrides)
    if not isinstance(gpt, (GPTConfig, LlamaConfig)):
        raise ValueError("the memory estimate covers GPT and Llama models")
    pp, tp = par.pp, par.tp
    dp = world // par.replica_ranks
    params = _layer_params(gpt, tp)
    if pp > 1:
        schedule = build_schedule(par.schedule, pp, par.microbatches, par.virtual_stages)
        counts = par.stage_layers or balanced_partition(_layer_costs(gpt), schedule.num_chunks)
        peaks = simulate(schedule).peak_in_flight
        chunks_of = schedule.chunks_of
        microbatch = config.data.global_batch // (dp * par.microbatches)
    else:
        counts, peaks = [len(params)], [1]
        chunks_of = lambda r: [0]  # noqa: E731
        microbatch = config.data.global_batch // (dp * par.grad_accum)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    s, h, a = gpt.block_size, gpt.d_model, gpt.n_head
    if par.checkpoint_activations:
        per_block = 4 * s * microbatch * h  # the block's fp32 input only
    else:
        per_block = 2 * s * microbatch * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    optimizer_copies = 2 if config.optim.name == "adamw" else (1 if config.optim.momentum else 0)
    zero = strategy_of(par).zero
    weight_share = 1 / dp if zero == 3 else (1 + 1 / dp if zero else 1)
    grad_share = 1 / dp if zero >= 2 else (1 + 1 / dp if zero else 1)
    optimizer_share = 1 / dp if zero else 1
    stages = []
    for rank in range(max(pp, 1)):
        layer_ids = [i for c in chunks_of(rank) for i in range(starts[c], starts[c] + counts[c])]
        rank_params = sum(params[i] for i in layer_ids)
        blocks = sum(1 for i in layer_ids if 0 < i <= gpt.n_layer)
        # In-flight pairs count chunks, so per-chunk activation = blocks per chunk on average.
        chunks = len(chunks_of(rank))
        activations = peaks[rank] * per_block * blocks / chunks
        if gpt.n_layer + 1 in layer_ids:  # the head keeps its fp32 logits shard (and their grad)
            activations += peaks[rank] * 2 * 4 * s * microbatch * gpt.vocab_size / tp
        stages.append(StageMemory(
            rank, _describe_layers(layer_ids, gpt.n_layer), int(rank_params), 4 * rank_params * weight_share,
            4 * rank_params * grad_share, 4 * rank_params * optimizer_copies * optimizer_share, activations, peaks[rank],
        ))
    return stages


def _describe_layers(layer_ids: list[int], n_layer: int) -> str:
    names = []
    for i in layer_ids:
        names.append("embed" if i == 0 else "head" if i == n_layer + 1 else f"block{i - 1}")
    return ",".join(names) if len(names) <= 3 else f"{names[0]}..{names[-1]}"


def _size(nbytes: float) -> str:
    for unit, scale in (("G", GIB), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}{unit}"
    return f"{nbytes:.0f}B"


def format_estimate(stages: list[StageMemory], tp: int) -> str:
    lines = [
        f"memory per rank (fp32; the {tp} tensor-parallel ranks of a stage hold the same, to within one vocabulary row):",
        f"  {'stage':>5}  {'layers':<22} {'params':>12} {'weights':>9} {'grads':>9} {'optim':>9} "
        f"{'activ.':>9} {'in flight':>9} {'total':>9}",
    ]
    for st in stages:
        lines.append(
            f"  {st.stage:>5}  {st.layers:<22} {st.params:>12,} {_size(st.weights):>9} {_size(st.grads):>9} "
            f"{_size(st.optimizer):>9} {_size(st.activations):>9} {st.in_flight:>9} {_size(st.total):>9}"
        )
    return "\n".join(lines)
