"""A token stream for the GPT: walks on a fixed random sparse Markov chain over the vocabulary.

Purely random tokens would leave a language model nothing to learn (its loss would sit at
log V). Here each token can be followed by only `branching` tokens, so a model that learns
the bigram table brings the loss from log(vocab_size) down to at most log(branching).

Shape legend: B batch, T sequence position (block_size), V vocabulary, N branching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from paratrain.data.synthetic import (
    check_batch_request,
    check_positive_fields,
    check_seed,
    draw_rows,
    seeded_generator,
)


@dataclass
class TokensConfig:
    vocab_size: int = 256  # the `gpt-tiny` preset's vocabulary
    block_size: int = 64  # tokens per sequence: the `gpt-tiny` preset's context
    branching: int = 4  # successors per token: sets how low the loss can go (<= log 4 nats)

    def validate(self) -> None:
        check_positive_fields(self, ("vocab_size", "block_size", "branching"))


class TokenDataset:
    name = "tokens"
    task = "language_modeling"

    def __init__(self, seed: int, config: TokensConfig):
        config.validate()
        self.seed, self.config = check_seed(seed), config
        self.vocab_size, self.block_size = config.vocab_size, config.block_size
        g = seeded_generator(seed, "markov-chain")
        # Drawn with replacement (distinct draws would need a V x V sort, 10 GB at GPT-2's
        # vocabulary); a repeat only makes that successor likelier and the loss lower.
        V, N = config.vocab_size, config.branching
        self.successors_VN = torch.randint(V, (V, N), generator=g)

    @property
    def chain_entropy_bound(self) -> float:
        """The loss of a model that knows the chain is at most this (nats per token): every
        next token is one of `branching` equally likely draws."""
        return math.log(self.config.branching)

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx_BT, targets_BT): targets are the inputs shifted left by one position."""
        return self.batch_rows(step, batch_size, 0, batch_size)

    def batch_rows(self, step: int, batch_size: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_batch_request(step, batch_size)
        T, N = self.block_size, self.config.branching

        def draw_block(g, n):
            first_B = torch.randint(self.vocab_size, (n,), generator=g)
            choices_BT = torch.randint(N, (n, T), generator=g).numpy()
            # The walk in numpy: T steps of one gather each, a tenth of torch's cost per call on
            # rows this short (it runs for every rank and microbatch).
            successors_VN = self.successors_VN.numpy()
            tokens_BT1 = np.empty((n, T + 1), dtype=np.int64)
            tokens_BT1[:, 0] = first_B.numpy()
            for t in range(T):
                tokens_BT1[:, t + 1] = successors_VN[tokens_BT1[:, t], choices_BT[:, t]]
            tokens_BT1 = torch.from_numpy(tokens_BT1)
            return tokens_BT1[:, :-1], tokens_BT1[:, 1:]

        inputs, targets = draw_rows(self.seed, step, batch_size, start, stop, draw_block)
        return inputs.clone(), targets.clone()

    def loss(self, logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))
