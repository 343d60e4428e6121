"""`paratrain export CHECKPOINT --to hf OUT_DIR`: a checkpoint's weights as a Hugging Face
model directory that transformers' AutoModelForCausalLM.from_pretrained loads.

A checkpoint holds the single-device model's tensors whole, whatever layout saved it
(train_state.py), so exporting is renaming (hf_weights.py) and writing (hf_files.py). Each shard's
tensors are read from the checkpoint when that shard is written: the whole model is never in
memory at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import click
import torch

from paratrain.paths import cannot_write
from paratrain.train.hf_files import (
    CONFIG, DEFAULT_MAX_SHARD, INDEX, HfDirectoryError, clear_previous, parse_size, plan_shards, safetensors_module,
    shard_file_names, write_config, write_index, write_shard,
)
from paratrain.train.hf_weights import HfFormat, NoHfFormat, model_format


def export_to_hf(checkpoint: str, out_dir: str, max_shard_size: str = DEFAULT_MAX_SHARD,
                 echo: Callable[[str], None] = print) -> list[Path]:
    """Write the checkpoint (a step-* directory, or a save dir: its latest) into `out_dir` as a
    Hugging Face model; returns the files written, announcing each through `echo`."""
    from paratrain.train.checkpoint import CheckpointReader, resolve  # DCP: imported when used

    safetensors_module()
    max_bytes = parse_size(max_shard_size)
    reader = CheckpointReader(resolve(checkpoint, None))
    model = reader.manifest["config"]["model"]
    fmt, ours = model_format(model["name"], model.get("overrides", {}))
    reason = cannot_write(out_dir, directory=True)
    if reason:
        raise HfDirectoryError(f"cannot write {out_dir}: {reason}")
    out = Path(out_dir)
    sizes = {name: _stored_bytes(reader, name) for name in ours}
    shards = plan_shards(sizes, max_bytes)
    clear_previous(out)
    written, weight_map, total = [], {}, 0
    for names, file in zip(shards, shard_file_names(len(shards))):
        tensors = _hf_tensors(fmt, reader, names)
        write_shard(out / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        total += size
        written.append(out / file)
        echo(f"wrote {out / file} ({len(tensors)} tensors, {size / 1e6:.2f} MB)")
    if len(shards) > 1:
        write_index(out, weight_map, total)
        written.append(out / INDEX)
        echo(f"wrote {written[-1]} ({len(weight_map)} tensors in {len(shards)} files)")
    write_config(out, fmt.config)
    written.append(out / CONFIG)
    echo(f"wrote {written[-1]} ({fmt.config['architectures'][0]})")
    return written


def _stored_bytes(reader, name: str) -> int:
    if f"model/{name}" not in reader.where:
        raise NoHfFormat(f"{reader.path} has no model/{name}: not the model its manifest names")
    entry = reader.where[f"model/{name}"][1]
    return entry.size.numel() * entry.properties.dtype.itemsize


def _hf_tensors(fmt: HfFormat, reader, names: list[str]) -> dict[str, torch.Tensor]:
    ours = reader.read([f"model/{name}" for name in names])
    out = {}
    for name in names:
        tensor = ours[f"model/{name}"]
        if not fmt.hf_names(name) and tensor.any():
            raise NoHfFormat(f"{name} is not zero and {fmt.config['architectures'][0]} has no such tensor")
        out.update(fmt.to_hf(name, tensor))
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path())
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--to", "target", type=click.Choice(["hf"]), required=True,
              help="The format: hf, a Hugging Face model directory (safetensors and config.json).")
@click.option("--max-shard-size", default=DEFAULT_MAX_SHARD, show_default=True,
              help="Largest safetensors file (5GB: 10^9 bytes, 5GiB: 2^30); beyond it, numbered shards and "
                   "model.safetensors.index.json.")
def export(checkpoint, out_dir, target, max_shard_size):
    """Write a checkpoint's weights as a Hugging Face model in OUT_DIR.

    CHECKPOINT is a checkpoint's step-* directory or a save dir (its latest), of any
    dp/tp/pp/zero/ep layout. Llama models export as LlamaForCausalLM, GPT ones as
    GPT2LMHeadModel, MoE Llamas without shared experts as MixtralForCausalLM.

    \b
    Example:
      paratrain train --model llama-tiny --nproc 4 --tp 2 --pp 2 --microbatches 4 --steps 10 --save-dir ckpt
      paratrain export ckpt --to hf llama-hf
      python -c "from transformers import AutoModelForCausalLM as M; print(M.from_pretrained('llama-hf'))"
      paratrain train --model llama-tiny --nproc 2 --init-from llama-hf --steps 10
    """
    del target  # one format so far
    export_to_hf(checkpoint, out_dir, max_shard_size, echo=click.echo)
