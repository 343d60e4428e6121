"""Text from a trained byte-level GPT: `generate` and the `paratrain sample` command.

The model continues a prompt one byte at a time: the last block_size bytes go in, the next
byte is drawn from the softmax of the last position's logits (divided by the temperature,
and cut to the top k when asked). Ids above 255 are never drawn: they name no byte, and a
model trained on text never saw them. Sampling uses its own generator seeded from `seed`, so
the same seed gives the same text and leaves torch's global RNG alone.

Shape legend: T sequence position (at most block_size), V vocabulary.
"""

from __future__ import annotations

import click
import torch

from paratrain.cli_types import FiniteFloat
from paratrain.data.text import BYTE_VOCAB, is_text_name
from paratrain.errors import UserError
from paratrain.models.user_model import language_model_shape


class CannotSample(UserError, ValueError):
    """A model or an argument `generate` cannot sample with."""


def generate(model: torch.nn.Module, prompt: bytes | str, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0) -> str:
    """The prompt followed by `max_new_tokens` sampled bytes, decoded as UTF-8 (a byte
    sequence that is not valid UTF-8 shows as U+FFFD)."""
    vocab_size, block_size = language_model_shape(model)
    if vocab_size is None or block_size is None:
        raise CannotSample(f"sampling needs a language model (a vocab_size and a block_size), got {type(model).__name__}")
    if vocab_size < BYTE_VOCAB:
        raise CannotSample(f"the model's vocab_size is {vocab_size}: byte-level text needs "
                           f"{BYTE_VOCAB}+ (train it on --data text with a vocab of {BYTE_VOCAB} or more)")
    prompt_bytes = prompt.encode("utf-8") if isinstance(prompt, str) else bytes(prompt)
    if not prompt_bytes:
        raise CannotSample("the prompt is empty: give at least one byte to continue")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise CannotSample(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not temperature > 0:
        raise CannotSample(f"temperature must be positive, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise CannotSample(f"top_k must be a positive integer, got {top_k!r}")

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = list(prompt_bytes)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                context_1T = torch.tensor([tokens[-block_size:]], device=device)
                logits_V = model(context_1T)[0, -1, :BYTE_VOCAB].float() / temperature
                if top_k is not None and top_k < BYTE_VOCAB:
                    kth_largest = torch.topk(logits_V, top_k).values[-1]
                    logits_V = logits_V.masked_fill(logits_V < kth_largest, float("-inf"))
                probs_V = torch.softmax(logits_V, dim=-1)
                tokens.append(int(torch.multinomial(probs_V, 1, generator=generator)))
    finally:
        model.train(was_training)
    return bytes(tokens).decode("utf-8", errors="replace")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint", "checkpoint_path", required=True, type=click.Path(),
              help="A checkpoint saved by `paratrain train --save-dir` (any dp/tp/pp layout).")
@click.option("--prompt", default="\n", show_default="a newline", help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=200, show_default=True, help="Bytes to generate.")
@click.option("--temperature", type=FiniteFloat(min=0, min_open=True), default=1.0, show_default=True,
              help="Below 1: safer, more repetitive text; above 1: more surprising.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Draw only from the k likeliest bytes.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same text.")
def sample(checkpoint_path, prompt, max_new_tokens, temperature, top_k, seed):
    """Continue a prompt with a GPT trained on text.

    \b
    Example:
      paratrain train --model gpt-tiny --data text --steps 200 --save-dir ckpt
      paratrain sample --checkpoint ckpt --prompt "HAMLET." --max-new-tokens 200 --temperature 0.8 --top-k 40
    """
    from paratrain.train.checkpoint import load_for_inference  # imports torch.distributed.checkpoint

    config, model = load_for_inference(checkpoint_path)  # a CheckpointError says what is wrong with it
    if not is_text_name(config.data.name):
        click.echo(f"note: this model was trained on {config.data.name or 'tokens'} data, not text: "
                   "expect noise", err=True)
    try:
        text = generate(model, prompt, max_new_tokens, temperature, top_k, seed)
    except CannotSample as error:
        raise CannotSample(f"{checkpoint_path}: {error}") from None
    click.echo(text)
