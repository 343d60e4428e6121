"""A data set and a loss of your own, for `--data FILE.py:FUNCTION` and `--loss FILE.py:FUNCTION`.

    paratrain train --model gpt-tiny --data examples/your_data/data.py:pairs \
        --loss examples/your_data/data.py:smoothed --steps 20

`pairs()` returns any map-style data set (here a list) of (inputs, targets) pairs; `smoothed`
is (outputs, targets) -> the batch's mean loss. paratrain draws global batches from the data
set in a shuffled order fixed by the seed, holds a tenth out for validation, and checks both
before any rank starts.
"""

import torch
import torch.nn.functional as F


def pairs():
    """200 sequences of 64 tokens from a 256-token vocabulary, each with its next tokens."""
    rows = torch.randint(0, 256, (200, 65), generator=torch.Generator().manual_seed(0))
    return [(row[:-1], row[1:]) for row in rows]


def smoothed(outputs, targets):
    """Cross-entropy with label smoothing: (B, T, V) logits against (B, T) token ids."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), label_smoothing=0.1)
