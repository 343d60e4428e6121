"""Activation memory of a GPT layer: the tensors autograd keeps from forward to backward.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Section 4) count them tensor by tensor for Megatron's layer in 16-bit precision (eager attention,
dropout after attention, after the projection and after the MLP):

    attention  11*s*b*h + 5*a*s^2*b   (QKV input 2sbh; Q, K 4sbh; softmax 2as^2b; its dropout
                                       mask as^2b and output 2as^2b; V 2sbh; projection input
                                       2sbh; dropout mask sbh)
    MLP        19*s*b*h               (input 2sbh; GELU input 8sbh; GELU output 8sbh; mask sbh)
    two norms   4*s*b*h

    no parallelism:                    s*b*h * (34 + 5*a*s/h)                     eq. (1)
    tensor parallel t:                 s*b*h * (10 + 24/t + 5*a*s/(h*t))          eq. (2)
    tensor + sequence parallel:        s*b*h/t * (34 + 5*a*s/h)                   eq. (4)
    selective recomputation (+ SP):    34*s*b*h/t  (the a*s^2 terms are recomputed)  eq. (6)
    full recomputation (+ SP):         2*s*b*h/t   (only the layer's input)      Section 4.2

`stored_tensors` lists the same tensors with each one's size, so the equations above are sums of
it, and so are the variants they do not print: fused (flash) attention keeps Q, K, V, its
output and a logsumexp instead of the a*s^2 terms; no dropout drops the masks; fp32 doubles
every 16-bit tensor. The tests check the list against what autograd saves in paratrain's block.

An MoE layer (moe=True) keeps, in place of the MLP's two tensors, the router's fp32 scores, each
(token, expert) pair's input row and output row, and the two hidden tensors of its top_k and
shared experts; an MoE model's MLPs are not split by tensor parallelism (models/plans.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.shapes import GPTShape


@dataclass(frozen=True)
class Software:
    """What the training code does that changes memory and time (not a property of the chips)."""

    precision: str = "bf16"          # bf16: mixed precision (ZeRO paper's accounting); fp32: everything fp32
    flash_attention: bool = True     # fused attention: no s x s scores are kept
    dropout: bool = False            # dropout masks are kept (Megatron's GPT-3 runs: on)
    sp_keeps_gathered: bool = False  # sequence parallel keeps the all-gathered norm outputs for
                                     # backward (paratrain) rather than gathering them again (Megatron)
    even_layers: bool = True         # l/(p*v) blocks per chunk (Megatron); False: cut by matmul cost
                                     # with the embedding and head as layers (paratrain's split)
    p2p_scatter_gather: bool = True  # each tp rank sends 1/t of an activation between stages and
                                     # the next stage all-gathers it (Narayanan et al. 2021, Section
                                     # 4.1); False: every tp rank sends all of it (paratrain)

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Stored:
    name: str
    nbytes: float
    split_by_tp: bool  # divided over the tensor-parallel ranks without sequence parallelism
    core: bool = False  # part of the attention core: gone under selective recomputation


def _mlp_tensors(shape: GPTShape, micro_batch: int, software: Software, moe: bool) -> list[Stored]:
    s, b, e = shape.seq, micro_batch, software.activation_bytes
    split = not shape.experts  # an MoE model's MLPs stay whole on every tp rank
    if not moe:
        return [Stored("GELU input", e * s * b * shape.mlp, split),
                Stored("GELU output (down input)", e * s * b * shape.mlp, split)]
    pairs, width = s * b * shape.top_k, (shape.top_k + shape.shared_experts) * shape.expert_mlp
    return [Stored("router scores (fp32)", 4 * s * b * shape.experts, False),
            Stored("expert input rows (one per token and chosen expert)", e * pairs * shape.hidden, False),
            Stored("expert output rows (gate-weighted)", e * pairs * shape.hidden, False),
            Stored("experts' SwiGLU input", e * s * b * width, False),
            Stored("experts' SwiGLU output (down input)", e * s * b * width, False)]


def stored_tensors(shape: GPTShape, micro_batch: int, software: Software, moe: bool = False) -> list[Stored]:
    """Every tensor one layer (an MoE layer: moe) keeps for backward, whole (before any parallel split)."""
    s, b, a = shape.seq, micro_batch, shape.heads
    e, sbh = software.activation_bytes, shape.seq * micro_batch * shape.hidden
    tensors = [
        Stored("norm1 input", e * sbh, False),
        Stored("norm1 output (QKV input)", e * sbh, False),
        Stored("norm2 input", e * sbh, False),
        Stored("norm2 output (MLP input)", e * sbh, False),
        Stored("norm statistics (fp32 mean, rstd)", 2 * 2 * 4 * s * b, False),
        Stored("Q, K, V", 3 * e * sbh, True),
        *_mlp_tensors(shape, micro_batch, software, moe),
    ]
    if software.flash_attention:
        tensors += [
            Stored("attention output (projection input)", e * sbh, True),
            Stored("logsumexp (fp32)", 4 * a * s * b, True),
        ]
    else:
        tensors += [
            Stored("projection input", e * sbh, True),
            Stored("softmax output", e * a * s * s * b, True, core=True),
        ]
        if software.dropout:
            tensors += [
                Stored("attention dropout mask", a * s * s * b, True, core=True),
                Stored("attention dropout output", e * a * s * s * b, True, core=True),
            ]
    if software.dropout:
        tensors += [Stored("projection dropout mask", sbh, False), Stored("MLP dropout mask", sbh, False)]
    return tensors


def layer_activation_bytes(shape: GPTShape, micro_batch: int, software: Software, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none", moe: bool = False) -> float:
    """Bytes one layer (an MoE layer: moe) keeps per microbatch on one tensor-parallel rank."""
    e, sbh = software.activation_bytes, shape.seq * micro_batch * shape.hidden
    if recompute == "full":
        return e * sbh / (tp if sequence_parallel else 1)
    total = 0.0
    for tensor in stored_tensors(shape, micro_batch, software, moe):
        if recompute == "selective" and tensor.core:
            continue
        gathered = software.sp_keeps_gathered and tensor.name.startswith(("norm1 output", "norm2 output"))
        total += tensor.nbytes / (tp if tensor.split_by_tp or (sequence_parallel and not gathered) else 1)
    return total


def head_activation_bytes(shape: GPTShape, micro_batch: int, software: Software, tp: int = 1,
                          sequence_parallel: bool = False) -> float:
    """What the last stage keeps beyond its layers: the final norm's input and output, and the
    fp32 log-probabilities the cross-entropy keeps over its share of the vocabulary (Korthikanti
    et al.'s 4*s*b*V/t term)."""
    s, b, h = shape.seq, micro_batch, shape.hidden
    e = software.activation_bytes
    norm_input = e * s * b * h / (tp if sequence_parallel else 1) + 2 * 4 * s * b
    norm_output = e * s * b * h / (tp if sequence_parallel and not software.sp_keeps_gathered else 1)
    return norm_input + norm_output + 4 * s * b * shape.vocab / tp


def weight_grad_bytes(shape: GPTShape, micro_batch: int, software: Software, tp: int = 1) -> tuple[float, float]:
    """(one layer, the head): what a split backward (zb-h1, zb-v) keeps from B until W: every
    linear layer's input X and output gradient dY, as dW = dY^T X needs them (Qi et al. 2024,
    "Zero Bubble Pipeline Parallelism"; paratrain's parallel/pipeline/weight_grad.py). Row-parallel
    outputs are whole partial sums; column-parallel inputs are replicated."""
    h, m, v = shape.hidden, shape.mlp, shape.vocab
    tokens, e = shape.seq * micro_batch, software.activation_bytes
    inputs = 2 * h + (h + m) / tp         # QKV and MLP-up inputs replicated; projection, down inputs split
    output_grads = (3 * h + m) / tp + 2 * h  # QKV, up outputs split; projection, down outputs whole
    head = e * h + 4 * v / tp  # the head's input, and the fp32 gradient of its logits
    return e * tokens * (inputs + output_grads), tokens * head
