"""The training loop's side of checkpoints: what to save when, and where to start again.

Resuming gives exactly the losses of the run that was not interrupted: weights and optimizer
state are saved bit for bit, the LR schedule's state with them, and the data depends only on
(seed, step), so the step number is the data position.
"""

from __future__ import annotations

import torch

from paratrain.parallel.data.strategy import strategy_of
from paratrain.train.checkpoint import CheckpointError, CheckpointReader, complete_checkpoints, resolve, save
from paratrain.train.config import TrainConfig, to_dict
from paratrain.train.train_state import TrainState, load_state, owned_state


def train_state_for(parallel, mesh, dp, optimizer) -> TrainState:
    tp_group = mesh.tp if mesh.shape["tp"] > 1 else None
    owner = mesh.dp_cp.rank == 0 and mesh.coords.tp == 0  # the first of the ranks sharing these parameters
    return TrainState(parallel.model, parallel.module, dp, optimizer, tp_group, owner, ep_group=mesh.ep)


def checkpoint_to_resume(config: TrainConfig, restarted: bool) -> str | None:
    """--resume as given; after an elastic restart (torchrun --max-restarts, or ours: `restarted`),
    the latest checkpoint in the save dir, if there is one."""
    ckpt = config.checkpoint
    if ckpt.resume is not None:
        return str(resolve(ckpt.resume, ckpt.dir))
    if restarted and ckpt.dir and complete_checkpoints(ckpt.dir):
        return str(complete_checkpoints(ckpt.dir)[-1])
    return None


def restarted_anywhere(group, config: TrainConfig) -> bool:
    """Whether the elastic agent of any rank counts a restart (only asked where a restart would
    resume: a save dir, no --resume). With several nodes, an agent that restarts its ranks because
    another node's failed does not count that one, and every rank must resume alike."""
    if config.checkpoint.resume is not None or not config.checkpoint.dir:
        return False
    count = torch.tensor([float(group.settings.launch.restart_count)])
    group.all_reduce(count, "max")
    return count.item() > 0


def checked_reader(path: str | os.PathLike, config: TrainConfig) -> CheckpointReader:
    """A reader of the checkpoint at `path` (its files checked against their checksums), or a
    CheckpointError saying why this run cannot continue from it."""
    reader = CheckpointReader(path)
    saved = reader.manifest.get("config")
    for section, key in (("model", "name"), ("model", "overrides"), ("optim", "name")):
        ours = getattr(getattr(config, section), key)
        try:
            theirs = saved[section][key]
        except (TypeError, KeyError):
            raise CheckpointError(f"{path}: its manifest has no {section}.{key}") from None
        if theirs != ours:
            raise CheckpointError(f"{path} was saved with {section}.{key} = {theirs!r}, this run has {ours!r}")
    if reader.manifest["step"] >= config.steps:
        raise CheckpointError(f"{path} is at step {reader.manifest['step']}; --steps {config.steps} leaves nothing to train")
    return reader


def restore(path: str, config: TrainConfig, group, state: TrainState, scheduler) -> int:
    """Load the checkpoint at `path` into this rank; returns the step to continue from."""
    reader = checked_reader(path, config)
    load_state(state, reader.read)
    scheduler.load_state_dict(reader.manifest["scheduler"])
    for param_group, lr in zip(state.optimizer.param_groups, scheduler.get_last_lr()):
        param_group["lr"] = lr
    rng_key = f"rng/{group.rank}"
    if reader.manifest["world_size"] == group.size and rng_key in reader.where:
        torch.set_rng_state(reader.read([rng_key])[rng_key])  # only dropout draws from it
    return reader.manifest["step"]


def save_if_due(config: TrainConfig, group, state: TrainState, scheduler, steps_done: int, layout: dict):
    """Save after `steps_done` steps when --save-every says so (and always after the last)."""
    ckpt = config.checkpoint
    if not ckpt.dir:
        return None
    due = (ckpt.every and steps_done % ckpt.every == 0) or steps_done == config.steps
    if not due:
        return None
    tensors = owned_state(state)  # collective: every rank calls it
    tensors[f"rng/{group.rank}"] = torch.get_rng_state()
    manifest = {"config": to_dict(config), "layout": layout, "scheduler": scheduler.state_dict()}
    return save(group, ckpt.dir, steps_done, tensors, manifest, ckpt.keep)


def layout_of(config: TrainConfig, world_size: int) -> dict:
    par = config.parallel
    return {"world_size": world_size, "dp": world_size // par.replica_ranks, "pp": par.pp, "tp": par.tp, "cp": par.cp,
            "zero": strategy_of(par).zero, "dp_mode": strategy_of(par).name}

