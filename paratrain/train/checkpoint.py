"""Checkpoints on disk: written with torch.distributed.checkpoint (DCP), atomically, loadable
into another layout.

    DIR/step-000100/manifest.json     step, config, layout, LR schedule, and the crc32 of the
                                      rest of itself; written last
    DIR/step-000100/rank-00003/       rank 3's tensors: a DCP checkpoint (.metadata, *.distcp)
                                      and checksums.json (crc32 and size of each file)

What each rank writes is layout-free (train_state.py): whole tensors under the single-device
model's names, each by one owner, plus the rank's own RNG state. Every rank saves its part with
DCP independently (no_dist: the threads launcher has no torch process group), into
DIR/.tmp-step-000100/; after a barrier, rank 0 writes the manifest and renames the directory.
A crash before the rename leaves the previous checkpoint as the latest; a leftover .tmp
directory is never read and is removed by the next save.

Loading reads each whole tensor a rank needs from whichever rank directory holds it (DCP reads
only the requested tensors) and keeps the rank's shard: that is how dp 2 x tp 2 resumes as dp 4
or tp 1. Each file's checksum is checked first, so a truncated or corrupted checkpoint is an
error naming the file, not a crash inside the reader.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch

from paratrain.errors import UserError

MANIFEST, CHECKSUMS, FORMAT = "manifest.json", "checksums.json", 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used, with the reason in one line."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoints in `directory` that finished saving, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def skipped_checkpoints(chosen: Path) -> list[str]:
    """The step directories beside `chosen` that are newer but not used, one line each with why
    (a save cut off before its manifest was written; a manifest that cannot be read)."""
    step = int(_STEP_DIR.match(chosen.name).group(1)) if _STEP_DIR.match(chosen.name) else None
    if step is None or not chosen.parent.is_dir():
        return []
    newer = sorted((p for p in chosen.parent.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()
                    and int(_STEP_DIR.match(p.name).group(1)) > step), key=lambda p: p.name)
    lines = []
    for path in newer:
        if not (path / MANIFEST).is_file():
            lines.append(f"skipped {path}: it has no {MANIFEST} (its save did not finish)")
    return lines


def resolve(resume: str, save_dir: str | None) -> Path:
    """The checkpoint `--resume` means: "latest" in the save dir, a save dir (its latest), or
    one checkpoint's directory."""
    if resume == "latest":
        if save_dir is None:
            raise CheckpointError("--resume without a path needs --save-dir to look in")
        candidates = complete_checkpoints(save_dir)
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {save_dir} to resume from")
        return candidates[-1]
    path = Path(resume)
    if (path / MANIFEST).is_file():
        return path
    candidates = complete_checkpoints(path)
    if candidates:
        return candidates[-1]
    raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST}) nor a directory holding one")


# ---- saving --------------------------------------------------------------------------------


def save(group, directory: str | Path, step: int, tensors: dict[str, torch.Tensor], manifest: dict,
         keep: int) -> Path:
    """Every rank calls this with its own tensors; rank 0's `manifest` is the one written."""
    directory = Path(directory)
    final = step_dir(directory, step)
    temporary = directory / f".tmp-{final.name}"
    if group.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".tmp-step-*"):  # a crashed save's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        temporary.mkdir()
    group.barrier()
    mine = temporary / f"rank-{group.rank:05d}"
    try:
        mine.mkdir()
    except FileNotFoundError:  # rank 0 made it on a disk this rank does not see
        raise CheckpointError(f"rank {group.rank} cannot see {temporary}, which rank 0 made: --save-dir must be "
                              "one folder every node sees (a shared file system)") from None
    previous = complete_checkpoints(directory)
    last_good = f"the last complete checkpoint is {previous[-1]}" if previous else "no earlier checkpoint exists"
    with _dcp_call(f"rank {group.rank} could not save {final.name}", last_good, mine):
        dcp = _dcp()
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(mine), no_dist=True)
    with _dcp_call(f"rank {group.rank} could not save {final.name}", last_good, mine):
        _write_json(mine / CHECKSUMS, {p.name: _checksum(p) for p in sorted(mine.iterdir()) if p.name != CHECKSUMS})
    group.barrier()  # every rank's part is on disk
    if group.rank == 0:
        with _dcp_call(f"rank 0 could not save {final.name}", last_good, temporary):
            _write_json(temporary / MANIFEST, _sealed({"format": FORMAT, "step": step, "world_size": group.size,
                                                       **manifest}))
        if final.exists():
            shutil.rmtree(final)  # the same step saved again (a restarted run)
        os.rename(temporary, final)
        _fsync_dir(directory)
        for old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    group.barrier()
    return final


def _dcp():
    """torch.distributed.checkpoint, imported when a checkpoint is written or read: it brings
    DTensor with it, half a second every run without checkpoints would pay. Each rank calls it
    without a process group on purpose (it writes its own part), so DCP's warning that it
    assumes a single process says nothing: ignored. (A filter for the process, not a
    warnings.catch_warnings() around each call: that swaps the filters of the whole process, and
    ranks on threads would restore one another's.)"""
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    return dcp


@contextmanager
def _dcp_call(what: str, then: str = "", writing_to: Path | None = None):
    """Run a DCP call (or a write beside it) and turn its failure into a CheckpointError: `what`:
    the writer's or reader's own error[; `then`]. A full disk is named as such: PyTorch's writer
    says only "[enforce fail at inline_container.cc] unexpected pos"."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (CheckpointException, Exception) as error:  # DCP's exception is a BaseException
        cause = _first_failure(error)
        full = _disk_full(cause, writing_to)
        reason = full or f"{type(cause).__name__}: {cause}"
        raise CheckpointError(f"{what}: {reason}" + (f"; {then}" if then else "")) from error


FULL_BELOW_BYTES = 16 << 20  # a write that failed with less free than this failed for want of space


def _disk_full(cause: BaseException, path: Path | None) -> str | None:
    """'no space left on device (...)' when that is why a write failed, else None."""
    import errno

    if path is None:
        return None
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return None
    if getattr(cause, "errno", None) == errno.ENOSPC or free < FULL_BELOW_BYTES:
        return f"no space left on device ({free / 2**20:.1f} MiB free where it writes, {path})"
    return None


def _first_failure(error: BaseException) -> BaseException:
    """DCP wraps a writer's exception in a CheckpointException that maps ranks to failures."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


def _sealed(manifest: dict) -> dict:
    """The manifest with the crc32 of the rest of it, so that a damaged manifest is told from
    a good one (its other files have checksums of their own)."""
    return {**manifest, "crc32": _manifest_crc(manifest)}


def _manifest_crc(manifest: dict) -> int:
    rest = {key: value for key, value in manifest.items() if key != "crc32"}
    return zlib.crc32(json.dumps(rest, sort_keys=True).encode())


def _checksum(path: Path) -> dict:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- loading -------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path / MANIFEST} cannot be read: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{path} has checkpoint format {found!r}; this paratrain reads {FORMAT}")
    missing = [key for key in ("step", "world_size", "config", "scheduler", "crc32") if key not in manifest]
    if missing:
        raise CheckpointError(f"{path / MANIFEST} has no {', '.join(missing)}: it is damaged")
    if manifest["crc32"] != _manifest_crc(manifest):
        raise CheckpointError(f"{path / MANIFEST} is corrupted (its crc32 differs from the one it was written with)")
    return manifest


class CheckpointReader:
    """Reads whole tensors by name from a checkpoint's rank directories."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.where: dict[str, tuple[Path, object]] = {}  # key -> (rank directory, its metadata)
        self._verified: set[Path] = set()
        rank_dirs = sorted(self.path.glob("rank-*"))
        if len(rank_dirs) != self.manifest["world_size"]:
            raise CheckpointError(
                f"{self.path} holds {len(rank_dirs)} rank directories, its manifest says {self.manifest['world_size']}")
        for rank_dir in rank_dirs:
            self._verify(rank_dir)
            try:
                metadata = _dcp().FileSystemReader(rank_dir).read_metadata()
            except Exception as error:  # noqa: BLE001 - any reader failure means a damaged file
                raise CheckpointError(f"{rank_dir} cannot be read: {type(error).__name__}: {error}") from error
            for key, entry in metadata.state_dict_metadata.items():
                self.where[key] = (rank_dir, entry)

    def _verify(self, rank_dir: Path) -> None:
        try:
            expected = json.loads((rank_dir / CHECKSUMS).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{rank_dir / CHECKSUMS} cannot be read: {error}") from None
        if not isinstance(expected, dict) or not all(
                isinstance(r, dict) and {"size", "crc32"} <= r.keys() for r in expected.values()):
            raise CheckpointError(f"{rank_dir / CHECKSUMS} is damaged: not a size and crc32 per file")
        for name, recorded in expected.items():
            file = rank_dir / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} is missing")
            actual = _checksum(file)
            if actual["size"] != recorded["size"]:
                raise CheckpointError(
                    f"checkpoint file {file} is {actual['size']} bytes, {recorded['size']} when saved: truncated")
            if actual["crc32"] != recorded["crc32"]:
                raise CheckpointError(f"checkpoint file {file} is corrupted (its crc32 differs from when it was saved)")

    def keys(self) -> list[str]:
        return list(self.where)

    def read(self, keys, prefixes=()) -> dict[str, torch.Tensor]:
        """The named tensors that exist, plus every tensor whose key starts with a prefix."""
        prefixes = tuple(prefixes)
        wanted = [k for k in keys if k in self.where]
        if prefixes:
            wanted += [k for k in self.where if k.startswith(prefixes) and k not in wanted]
        by_dir: dict[Path, dict[str, torch.Tensor]] = {}
        for key in wanted:
            rank_dir, entry = self.where[key]
            by_dir.setdefault(rank_dir, {})[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        for rank_dir, tensors in by_dir.items():
            with _dcp_call(f"{rank_dir} cannot be read"):
                _dcp().load(tensors, storage_reader=_dcp().FileSystemReader(rank_dir), no_dist=True)
        return {key: tensor for tensors in by_dir.values() for key, tensor in tensors.items()}


def load_for_inference(path: str):
    """(the run's TrainConfig, a single-device model on the CPU with the checkpoint's weights),
    whatever dp/tp/pp layout saved it."""
    from paratrain.train.config import TrainConfig, from_dict  # here: the rest of this file is I/O only
    from paratrain.train.setup import build_seeded_model

    checkpoint = resolve(path, None) if path != "latest" else None
    if checkpoint is None:
        raise CheckpointError("give the checkpoint's path (or the save dir holding it)")
    reader = CheckpointReader(checkpoint)
    raw = reader.manifest["config"]
    config = from_dict({k: v for k, v in raw.items() if k in {f.name for f in dataclasses.fields(TrainConfig)}})
    model = build_seeded_model(config.model.name, config.model.overrides, config.seed)
    names = [name for name, _ in model.named_parameters()]
    tensors = reader.read([f"model/{name}" for name in names])
    missing = [name for name in names if f"model/{name}" not in tensors]
    if missing:
        raise CheckpointError(f"{checkpoint} has no weights for {missing[0]} ({len(missing)} missing)")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[f"model/{name}"])
    model.eval()
    return config, model
