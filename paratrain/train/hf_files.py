"""A Hugging Face model directory on disk: safetensors files, sharded as transformers shards
them, and config.json; written by `paratrain export --to hf`, read by `--init-from`.

    OUT/config.json
    OUT/model.safetensors                              when the weights fit in one shard
    OUT/model-00001-of-00003.safetensors ...           else, beside
    OUT/model.safetensors.index.json                   {"metadata": {"total_size"}, "weight_map": {name: file}}

Reading opens each file with safetensors.safe_open and takes only the tensors asked for, so a
rank reads what it holds and nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from paratrain.errors import UserError

HF_EXTRA = "pip install 'paratrain[hf]'"
CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"  # transformers' save_pretrained default
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class HfDirectoryError(UserError, ValueError):
    """A Hugging Face model directory that cannot be written or read, with why in one line."""


def safetensors_module():
    try:
        import safetensors.torch
    except ImportError:
        raise HfDirectoryError(f"Hugging Face weights need the safetensors package: {HF_EXTRA}") from None
    return safetensors


def parse_size(text: str | int) -> int:
    """Bytes in '5GB' (10^9, as transformers reads it), '500MiB' (2^20) or '1000'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise HfDirectoryError(f"--max-shard-size: {text!r} is not a size (e.g. 5GB, 500MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into consecutive shards of at most max_bytes (a larger tensor
    alone in its shard)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def shard_file_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def clear_previous(out_dir: Path) -> None:
    """Remove an earlier export's weights: a stale shard or index would be read beside the new."""
    for path in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / SINGLE, out_dir / INDEX]:
        path.unlink(missing_ok=True)


def write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    safetensors_module().torch.save_file(tensors, str(path), metadata={"format": "pt"})


def write_index(out_dir: Path, weight_map: dict[str, str], total_size: int) -> None:
    (out_dir / INDEX).write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map},
                                            indent=2) + "\n")


def write_config(out_dir: Path, config: dict) -> None:
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


class HfDirectory:
    """A Hugging Face model directory's config and weights, read by tensor name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / CONFIG).is_file():
            raise HfDirectoryError(f"{self.path} is not a Hugging Face model directory (no {CONFIG})")
        self.config = self._json(self.path / CONFIG)
        self.weight_map = self._weight_map()

    def _json(self, path: Path) -> dict:
        try:
            value = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise HfDirectoryError(f"{path} cannot be read: {error}") from None
        if not isinstance(value, dict):
            raise HfDirectoryError(f"{path} is not a JSON object")
        return value

    def _weight_map(self) -> dict[str, str]:
        if (self.path / INDEX).is_file():
            weight_map = self._json(self.path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HfDirectoryError(f"{self.path / INDEX} has no weight_map")
            return weight_map
        if (self.path / SINGLE).is_file():
            with safetensors_module().safe_open(str(self.path / SINGLE), framework="pt") as f:
                return {name: SINGLE for name in f.keys()}
        raise HfDirectoryError(f"{self.path} has neither {SINGLE} nor {INDEX} (only safetensors weights are read)")

    def read_rows(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Only the given ranges of `dim` of one tensor, side by side (safetensors reads no more
        of the file than they cover)."""
        if name not in self.weight_map:
            raise HfDirectoryError(f"{self.path} has no tensor {name}: another model?")
        path = self.path / self.weight_map[name]
        try:
            with safetensors_module().safe_open(str(path), framework="pt") as f:
                part = f.get_slice(name)
                index = [slice(None)] * len(part.get_shape())
                pieces = []
                for start, end in ranges:
                    index[dim] = slice(start, end)
                    pieces.append(part[tuple(index)])
        except (OSError, safetensors_module().SafetensorError) as error:
            raise HfDirectoryError(f"{path} cannot be read: {error}") from None
        return torch.cat(pieces, dim=dim)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors, each file opened once; a missing one is an error naming it."""
        missing = [name for name in names if name not in self.weight_map]
        if missing:
            raise HfDirectoryError(f"{self.path} has no tensor {missing[0]} ({len(missing)} missing): another model?")
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.weight_map[name], []).append(name)
        out = {}
        for file, wanted in by_file.items():
            try:
                with safetensors_module().safe_open(str(self.path / file), framework="pt") as f:
                    out.update({name: f.get_tensor(name) for name in wanted})
            except (OSError, safetensors_module().SafetensorError) as error:
                raise HfDirectoryError(f"{self.path / file} cannot be read: {error}") from None
        return out
