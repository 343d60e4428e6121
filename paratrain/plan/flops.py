"""Floating-point operations of one GPT training step, counted as the Megatron papers count them.

Only matrix multiplies count (2 FLOPs per multiply-add); layer norms, GELU, softmax and the
optimizer are left out, being a rounding error next to them at any useful size.

Per layer and microbatch of b sequences (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", Section 5.1), the forward pass multiplies

    QKV projection   2*b*s*h*3h          attention scores   2*b*s*s*h   (Q K^T)
    output proj.     2*b*s*h*h           attention over V   2*b*s*s*h
    MLP up, down     2 * 2*b*s*h*m

which with m = 4h is 24*b*s*h^2 + 4*b*s^2*h. The logit layer adds 2*b*s*h*V. A backward pass
costs twice its forward (the gradients of both the input and the weight), so a step without
recomputation costs three forwards; recomputing every layer (full recompute) costs four
forwards of the layers. With m = 4h over a batch of B sequences this is eq. (3) of the paper:

    F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))     no recomputation ("model FLOPs")
    F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))     full recomputation

Selective recomputation (Korthikanti et al. 2022, Section 4.2) re-runs only the attention core
(scores, softmax, weighted sum of V): 4*b*s^2*h more per layer, by the same counting. Fused
(flash) attention keeps no scores, so its backward multiplies Q K^T once more: 2*b*s^2*h per
layer that the hardware does but the model FLOPs (and MFU) leave out.

A mixture of experts counts active FLOPs, as the MoE literature's MFU does: an MoE layer's MLP
multiplies each token by the router (h x E), its top_k routed experts and the shared experts,
2 FLOPs per weight element used, so a forward is about 2 x active parameters per token plus
attention; the experts a token skips cost nothing.
"""

from __future__ import annotations

from paratrain.plan.shapes import GPTShape

RECOMPUTE = ("none", "selective", "full")


def layer_matmul_flops(shape: GPTShape, batch: int, moe: bool = False) -> float:
    """Forward FLOPs of one layer's weight matmuls (QKV, projection, MLP) for `batch`
    sequences: 2 per weight element and token. A Llama's are its smaller k/v and SwiGLU's three
    matrices; grouped-query attention does not change the attention core (each query head still
    attends); an MoE layer's MLP is the weights one token uses (router, top_k and shared experts)."""
    return attention_matmul_flops(shape, batch) + mlp_matmul_flops(shape, batch, moe)


def attention_matmul_flops(shape: GPTShape, batch: int) -> float:
    """Forward FLOPs of one layer's Q, K, V and output projections."""
    return 2 * batch * shape.seq * shape.attention_weights()


def mlp_matmul_flops(shape: GPTShape, batch: int, moe: bool = False) -> float:
    """Forward FLOPs of one layer's MLP, or of an MoE layer's: the weights a token uses."""
    return 2 * batch * shape.seq * shape.mlp_weights(moe)


def layer_attention_flops(shape: GPTShape, batch: int) -> float:
    """Forward FLOPs of one layer's attention core: Q K^T and the weighted sum of V."""
    return 4 * batch * shape.seq * shape.seq * shape.hidden


def logit_flops(shape: GPTShape, batch: int) -> float:
    """Forward FLOPs of the logit layer (the head's h x V matmul)."""
    return 2 * batch * shape.seq * shape.hidden * shape.vocab


def step_flops(shape: GPTShape, batch: int, recompute: str = "none") -> float:
    """FLOPs one training step does on `batch` sequences: forward, backward (2x forward) and
    whatever `recompute` adds. With recompute="none" these are the model FLOPs MFU is based on."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute policy {recompute!r}; valid: {', '.join(RECOMPUTE)}")
    layers = sum(layer_matmul_flops(shape, batch, shape.is_moe(i)) for i in range(shape.layers))
    layers += shape.layers * layer_attention_flops(shape, batch)
    total = 3 * (layers + logit_flops(shape, batch))
    if recompute == "full":
        total += layers
    elif recompute == "selective":
        total += shape.layers * layer_attention_flops(shape, batch)
    return total


def narayanan_flops(shape: GPTShape, batch: int, recompute: str = "none") -> float:
    """Eq. (3) of Narayanan et al. 2021 as printed (it assumes m = 4h); `step_flops` equals it
    then. Full recompute is the printed 96-form; no recompute its 72-form."""
    B, s, l, h, V = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    if recompute == "full":
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    if recompute == "none":
        return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    raise ValueError("the paper prints the formula for no recomputation and full recomputation only")


def flash_backward_flops(shape: GPTShape, batch: int) -> float:
    """What a fused attention backward adds by recomputing the scores Q K^T, over all layers."""
    return shape.layers * 2 * batch * shape.seq * shape.seq * shape.hidden
