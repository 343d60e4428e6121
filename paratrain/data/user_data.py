"""`--data FILE.py:FUNCTION`: a user's own data set, drawn from as ours are.

FUNCTION() returns any map-style data set (a `torch.utils.data.Dataset`, a list: anything with
`len()` and `[i]`) whose items are (inputs, targets) pairs of tensors or numbers. Global batches
come from it the way the digits' do: a shuffled order of the training items, fixed by the seed,
step k taking items k*B .. (k+1)*B - 1 of it (wrapping around), so what a step trains on depends
only on (seed, step, batch size), never on the layout. A tenth of the items (at least one) is
held out for validation, the same split for every seed.

The loss, unless `--loss FILE.py:FUNCTION` gives one: cross-entropy for integer targets (over
the last dimension of the outputs: classes, or a language model's vocabulary), mean squared
error for float ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paratrain.data.synthetic import seeded_generator
from paratrain.errors import UserError
from paratrain.models.user_model import is_model_file, load_function

HELD_OUT_SHARE = 0.1


class DataFileError(UserError, ValueError):
    """A user's data set that cannot be used as one; one line."""


def is_data_file(name) -> bool:
    return is_model_file(name)  # the same spelling: FILE.py:FUNCTION


@dataclass
class UserDataConfig:
    spec: str  # FILE.py:FUNCTION

    def validate(self) -> None:
        if not is_data_file(self.spec):
            raise DataFileError(f"--data {self.spec!r}: a data file is FILE.py:FUNCTION")


class UserDataset:
    name = "user"

    def __init__(self, seed: int, config: UserDataConfig):
        config.validate()
        self.seed, self.config = seed, config
        try:
            self.items = load_function(config.spec, "data")()
        except DataFileError:
            raise
        except UserError as error:
            raise DataFileError(str(error)) from None
        except Exception as error:  # the user's function: its error is theirs, in one line
            raise DataFileError(f"data {config.spec}: {type(error).__name__}: {error}") from None
        if not hasattr(self.items, "__len__") or not hasattr(self.items, "__getitem__"):
            raise DataFileError(f"data {config.spec} returned a {type(self.items).__name__}: a data set needs "
                                "len() and [i] (a torch Dataset, a list)")
        count = len(self.items)
        if count < 2:
            raise DataFileError(f"data {config.spec} has {count} item(s): at least 2 (one is held out)")
        first = self._item(0)
        self.task = "regression" if first[1].is_floating_point() else (
            "classification" if first[1].dim() == 0 else "language_modeling")
        order = torch.randperm(count, generator=seeded_generator(0, "user-data-split"))
        held = max(1, int(count * HELD_OUT_SHARE))
        self.held_out, train = order[:held], order[held:]
        self.train = train[torch.randperm(len(train), generator=seeded_generator(seed, "user-data-order"))]

    def _item(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.items[index]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataFileError(f"data {self.config.spec}: item {index} is a {type(item).__name__}, "
                                "not an (inputs, targets) pair")
        return torch.as_tensor(item[0]), torch.as_tensor(item[1])

    def _batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self._item(int(i)) for i in indices]
        try:
            return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        except RuntimeError as error:
            raise DataFileError(f"data {self.config.spec}: items of different shapes cannot make a batch "
                                f"({error})") from None

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = (step * batch_size + torch.arange(batch_size)) % len(self.train)
        return self._batch(self.train[positions])

    def validation_batches(self, batch_size: int, max_batches: int) -> list:
        count = min(max_batches, -(-len(self.held_out) // batch_size))
        return [self._batch(self.held_out[(k * batch_size + torch.arange(batch_size)) % len(self.held_out)])
                for k in range(count)]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.is_floating_point():
            return F.mse_loss(outputs, targets)
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))
