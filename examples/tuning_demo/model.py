"""The GT seed's GPT, written against paratrain's frontend with signals.

Nothing here says how many workers there are or how the model is split: every tensor is
created inside a named region, and the YAML file says what each region means.

    pp_stage<s>          the residual stream, layer norms and row-parallel biases of stage s
    pp_stage<s>_colpar   weights split on their output features (QKV, MLP up)
    pp_stage<s>_rowpar   weights split on their input features (attention out, MLP down)
    embed                the token table (split by rows: vocabulary-parallel)
    head                 the output projection (split on the vocabulary)
    data, targets        where a microbatch's tokens and targets are uploaded

The number of stages is the number of `pp_stage<s>` signals in the configuration. The layers are
cut into `stages x virtual` chunks (virtual > 1 for the interleaved schedule), chunk c living on
stage c mod stages; the embedding is on the first chunk and the head on the last. The attention is
real causal self-attention (PyTorch's scaled_dot_product_attention on each worker's heads).

Parameters are laid out like paratrain's own GPT (`paratrain/models/gpt.py`) in GT's [in, out]
convention, so `weights_from_paratrain` can start this model from exactly the weights
`paratrain train` starts from. Shape legend: B batch, T sequence, D width, H heads, M MLP, V vocabulary.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

import paratrain.frontend as gt
F = gt.nn.functional


@dataclass
class Shape:
    n_layer: int = 8  # the seed's "Mini-GPT": 8 layers, 1024 wide, 16 heads, 4096 MLP, GPT-2's vocabulary
    d_model: int = 1024
    n_head: int = 16
    d_mlp: int = 4096
    vocab_size: int = 50257
    block_size: int = 1024


SEED = Shape()
SMALL = Shape(n_layer=8, d_model=128, n_head=4, d_mlp=512, vocab_size=512, block_size=64)  # paratrain's gpt-small


def stages_in(config: dict) -> int:
    """How many pipeline stages a signal configuration describes (its pp_stage<s> signals)."""
    found = {int(m.group(1)) for name in config if (m := re.fullmatch(r"pp_stage(\d+)", name))}
    if not found or found != set(range(len(found))):
        raise ValueError(f"the configuration must define pp_stage0 .. pp_stage<k>, found {sorted(found)}")
    return len(found)


class _Parameters:
    """Creates each parameter in its region: from given values, or drawn on the workers."""

    def __init__(self, weights: dict | None):
        self.weights = weights

    def __call__(self, name: str, signal: str, shape: tuple, init: str = "normal", std: float = 0.02):
        with gt.signal.context(signal):
            if self.weights is not None:
                value = gt.from_numpy(np.ascontiguousarray(self.weights[name], dtype=np.float32))
            elif init == "zeros":
                value = gt.zeros(*shape)
            elif init == "ones":
                value = gt.ones(*shape)
            else:
                value = gt.randn(*shape) * std
        return gt.nn.Parameter(value)


class Block(gt.nn.Module):
    def __init__(self, shape: Shape, index: int, stage: int, param: _Parameters):
        super().__init__()
        D, M, p = shape.d_model, shape.d_mlp, f"blocks.{index}."
        self.rep, self.col, self.row = f"pp_stage{stage}", f"pp_stage{stage}_colpar", f"pp_stage{stage}_rowpar"
        self.n_head = shape.n_head
        resid = 0.02 / math.sqrt(2 * shape.n_layer)  # GPT-2's scaling of residual projections
        self.ln1_w, self.ln1_b = param(p + "ln1.weight", self.rep, (D,), "ones"), param(p + "ln1.bias", self.rep, (D,), "zeros")
        self.wq, self.wk, self.wv = (param(p + f"attn.{n}.weight", self.col, (D, D)) for n in "qkv")
        self.bq, self.bk, self.bv = (param(p + f"attn.{n}.bias", self.col, (D,), "zeros") for n in "qkv")
        self.wo = param(p + "attn.proj.weight", self.row, (D, D), std=resid)
        self.bo = param(p + "attn.proj.bias", self.rep, (D,), "zeros")
        self.ln2_w, self.ln2_b = param(p + "ln2.weight", self.rep, (D,), "ones"), param(p + "ln2.bias", self.rep, (D,), "zeros")
        self.w_up, self.b_up = param(p + "mlp.up.weight", self.col, (D, M)), param(p + "mlp.up.bias", self.col, (M,), "zeros")
        self.w_down = param(p + "mlp.down.weight", self.row, (M, D), std=resid)
        self.b_down = param(p + "mlp.down.bias", self.rep, (D,), "zeros")

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        with gt.signal.context(self.rep):
            h_BTD = F.layer_norm(x_BTD, D, self.ln1_w, self.ln1_b)
        with gt.signal.context(self.col):  # each worker computes whole heads of its own
            q, k, v = (F.linear(h_BTD, w, b).reshape(B, T, self.n_head, D // self.n_head).transpose(1, 2)
                       for w, b in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
            y_BHTK = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y_BTD = y_BHTK.transpose(1, 2).reshape(B, T, D)
        with gt.signal.context(self.row):  # partial sums over the heads, all-reduced
            x_BTD = x_BTD + F.linear(y_BTD, self.wo, self.bo)
        with gt.signal.context(self.rep):
            h_BTD = F.layer_norm(x_BTD, D, self.ln2_w, self.ln2_b)
        with gt.signal.context(self.col):
            u_BTM = F.linear(h_BTD, self.w_up, self.b_up).gelu()
        with gt.signal.context(self.row):
            return x_BTD + F.linear(u_BTM, self.w_down, self.b_down)


class SignalGPT(gt.nn.Module):
    def __init__(self, shape: Shape, stages: int, weights: dict | None = None, virtual: int = 1):
        super().__init__()
        chunks = stages * virtual
        if shape.n_layer % chunks:
            raise ValueError(f"{shape.n_layer} layers do not split evenly into {chunks} chunks ({stages} stages x {virtual})")
        self.shape, self.stages, self.chunks = shape, stages, chunks
        self.per_chunk = shape.n_layer // chunks
        param = _Parameters(weights)
        D, V = shape.d_model, shape.vocab_size
        self.tok_emb = param("tok_emb.weight", "embed", (V, D))
        self.pos_emb = param("pos_emb.weight", "pp_stage0", (shape.block_size, D))
        self.blocks = [Block(shape, i, (i // self.per_chunk) % stages, param) for i in range(shape.n_layer)]
        last = self.stage_signal(chunks - 1)
        self.ln_f_w, self.ln_f_b = param("ln_f.weight", last, (D,), "ones"), param("ln_f.bias", last, (D,), "zeros")
        self.head = param("head.weight", "head", (D, V))

    def stage_signal(self, chunk: int) -> str:
        """The region a chunk runs in: its stage's."""
        return f"pp_stage{chunk % self.stages}"

    def chunk_forward(self, chunk: int, x):
        """Chunk `chunk` of the model: token ids -> activations on the first, -> logits on the last."""
        if chunk == 0:
            B, T = x.shape
            with gt.signal.context("pp_stage0"):
                positions = gt.arange(T)
                x = F.embedding(x, self.tok_emb) + F.embedding(positions, self.pos_emb)
        for block in self.blocks[chunk * self.per_chunk:(chunk + 1) * self.per_chunk]:
            x = block(x)
        if chunk == self.chunks - 1:
            with gt.signal.context(self.stage_signal(chunk)):
                x = F.layer_norm(x, self.shape.d_model, self.ln_f_w, self.ln_f_b)
            with gt.signal.context("head"):
                x = x @ self.head  # logits split on the vocabulary
        return x

    def loss(self, logits_BTV, targets_BT):
        """Mean cross-entropy over tokens; on split logits, the vocabulary-parallel one."""
        B, T, V = logits_BTV.shape
        return F.cross_entropy(logits_BTV.reshape(B * T, V), targets_BT.reshape(B * T))


def weights_from_paratrain(torch_gpt) -> dict:
    """paratrain's GPT weights as this model's parameters: linear weights transposed to
    [in, out], and the fused QKV projection cut into Q, K and V."""
    weights = {}
    for name, value in torch_gpt.state_dict().items():
        array = value.detach().numpy()
        if name.endswith("attn.qkv.weight"):
            for part, block in zip("qkv", np.split(array, 3, axis=0)):
                weights[name.replace("qkv", part)] = block.T
        elif name.endswith("attn.qkv.bias"):
            for part, block in zip("qkv", np.split(array, 3)):
                weights[name.replace("qkv", part)] = block
        elif array.ndim == 2 and not name.endswith("emb.weight"):
            weights[name] = array.T  # nn.Linear keeps [out, in]
        else:
            weights[name] = array
    return weights
