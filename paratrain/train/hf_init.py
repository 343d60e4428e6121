"""`--init-from HF_DIR`: a run that starts from a Hugging Face model's weights (a fine-tune).

The directory's tensors are mapped back to our names (hf_weights.py) and put in place the way a
checkpoint's are (train_state.load_state): each rank reads, with safetensors.safe_open, only
the tensors of the parameters it holds (its pipeline stage's), and of those only its part
(hf_slices.py: its tensor-parallel rows, its experts). The optimizer and the LR schedule start fresh, at step 0.
"""

from __future__ import annotations

import torch

from paratrain.errors import UserError
from paratrain.train.config import TrainConfig
from paratrain.train.hf_files import HfDirectory, HfDirectoryError
from paratrain.train.hf_slices import Cut, local_cuts, read_local
from paratrain.train.hf_weights import HfFormat, config_mismatch, model_format
from paratrain.train.setup import meta_model
from paratrain.train.train_state import TrainState, load_state


def checked_hf_directory(path: str, config: TrainConfig) -> tuple[HfDirectory, HfFormat, dict]:
    """The directory, the run's model's HF format and its tensors on the meta device; or an
    error saying in one line why the run cannot start from it."""
    fmt, ours = model_format(config.model.name, config.model.overrides)
    directory = HfDirectory(path)
    mismatch = config_mismatch(fmt.config, directory.config)
    if mismatch:
        raise HfDirectoryError(f"{path} does not fit model {config.model.name}: its {mismatch}")
    missing = [hf for name in ours for hf in fmt.hf_names(name) if hf not in directory.weight_map]
    if missing:
        raise HfDirectoryError(f"{path} has no tensor {missing[0]} ({len(missing)} missing) that "
                               f"{config.model.name} needs")
    return directory, fmt, ours


def init_from_problems(config: TrainConfig) -> list[str]:
    """What stops the run from starting from --init-from, one line each (checked before any rank starts)."""
    if config.checkpoint.init_from is None:
        return []
    if config.checkpoint.resume is not None:
        return ["checkpoint.init_from: --init-from starts a run from other weights, --resume continues one: "
                "give one of them"]
    try:
        checked_hf_directory(config.checkpoint.init_from, config)
    except UserError as error:
        return [f"checkpoint.init_from: {error}"]
    return []


def hf_reader(path: str, config: TrainConfig):
    """read(keys, prefixes) as train_state.load_state calls it: our model/<name> keys from the
    HF directory; no optimizer state (the prefixes find nothing)."""
    directory, fmt, ours = checked_hf_directory(path, config)
    tied = tied_names(config)

    def read(keys, prefixes=()) -> dict[str, torch.Tensor]:
        del prefixes  # optim/...: a fresh optimizer
        wanted = {key.removeprefix("model/"): tied.get(key.removeprefix("model/"), key.removeprefix("model/"))
                  for key in keys}
        names = sorted({name for name in wanted.values() if name in ours})
        tensors = directory.read([hf for name in names for hf in fmt.hf_names(name)])
        found = {name: fmt.from_hf(name, tensors, ours[name]) for name in names}
        return {f"model/{key}": found[name] for key, name in wanted.items() if name in found}

    return read


def tied_names(config: TrainConfig) -> dict[str, str]:
    """A shared parameter's other names -> the name it is listed under once (tied embeddings:
    output.weight -> tok_emb.weight), read from the model built on the meta device."""
    model = meta_model(config.model.name, config.model.overrides)
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.update({name: first[id(param)]} if id(param) in first else {})
        first.setdefault(id(param), name)
    return aliases


def init_from_hf(path: str, config: TrainConfig, state: TrainState) -> None:
    """Put the HF directory's weights in this rank's parameters, reading only its part of each
    (hf_slices.py: its tensor-parallel rows, its experts)."""
    directory, fmt, ours = checked_hf_directory(path, config)
    tied, cuts = tied_names(config), local_cuts(state)

    def read(keys, prefixes=()) -> dict[str, torch.Tensor]:
        del prefixes  # optim/...: a fresh optimizer
        out = {}
        for key in keys:
            name = key.removeprefix("model/")
            source = tied.get(name, name)
            if source in ours:
                out[key] = read_local(directory, fmt, source, cuts.get(name, Cut()), ours[source])
        return out

    load_state(state, read)


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, path: str, config: TrainConfig) -> None:
    """The same weights into a single-device model (the reference `paratrain check` compares with)."""
    read = hf_reader(path, config)
    tensors = read([f"model/{name}" for name in model.state_dict()])
    for name, value in model.state_dict(keep_vars=True).items():
        if f"model/{name}" in tensors:
            value.copy_(tensors[f"model/{name}"])
