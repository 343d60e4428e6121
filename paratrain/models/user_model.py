"""A user's own causal language model: `--model FILE.py:FUNCTION`.

FUNCTION(**options) returns an nn.Module mapping token ids (B, T) to logits (B, T, V). Its
vocabulary and context length are read from the module (`vocab_size`; `block_size`,
`max_seq_len`, `context_length` or `seq_len`; on the module or its `config`), or given as
options (`--vocab-size`, `--block-size`), which are also passed to FUNCTION when it takes them.
The other options (`model:` keys in YAML) are FUNCTION's keyword arguments.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from paratrain.errors import UserError
from paratrain.models.meta import on_meta

CONTEXT_ATTRS = ("block_size", "max_seq_len", "context_length", "seq_len")


class ModelFileError(UserError, ValueError):
    """A user's model that cannot be loaded or built; one line naming the file or function."""


def is_model_file(name) -> bool:
    """`path/to/model.py:build` names a user's model; preset names never contain '.py:'."""
    return isinstance(name, str) and ".py:" in name


def load_function(spec: str, kind: str = "model"):
    """The function FILE.py:FUNCTION names (`kind`: what the file is, for the message: a model,
    data, a loss); ModelFileError, one line, if there is none."""
    path_text, _, function_name = spec.rpartition(":")
    path = Path(path_text)
    if not path.is_file():
        raise ModelFileError(f"{kind} file {path} not found")
    key = f"paratrain_user_{kind}_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(key)
    if module is None or getattr(module, "__paratrain_mtime__", None) != path.stat().st_mtime:
        module_spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:  # the user's file: any error it raises is theirs, reported in one line
            raise ModelFileError(f"{kind} file {path}: {type(error).__name__}: {error}") from None
        module.__paratrain_mtime__ = path.stat().st_mtime
        sys.modules[key] = module
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelFileError(f"{kind} file {path} has no function {function_name!r}")
    return function


@dataclass
class CausalLMFile:
    spec: str  # FILE.py:FUNCTION
    options: dict = field(default_factory=dict)  # FUNCTION's keyword arguments
    vocab_size: int | None = None  # None: read from the module
    block_size: int | None = None

    def validate(self) -> None:
        """Builds the model on the meta device (no memory, no time) to read what is not given."""
        model = self.build(device="meta")
        if not isinstance(model, nn.Module):
            raise ModelFileError(f"model {self.spec} returned a {type(model).__name__}, not an nn.Module")
        if self.vocab_size is None:
            self.vocab_size = _read(model, ("vocab_size",))
        if self.block_size is None:
            self.block_size = _read(model, CONTEXT_ATTRS)
        for name, value, flag in (("vocab size", self.vocab_size, "--vocab-size"),
                                  ("context length", self.block_size, "--block-size")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelFileError(f"model {self.spec}: its {name} is not an attribute of the module "
                                 f"({', '.join(CONTEXT_ATTRS) if flag == '--block-size' else 'vocab_size'}); "
                                 f"give it with {flag}")
        self._check_forward(model)

    def _check_forward(self, model: nn.Module) -> None:
        """One sequence through the model, on the meta device: arguments that build a module which
        cannot run (a width its head count does not divide) are one line here, before any rank
        starts, not a traceback from every rank."""
        tokens = torch.zeros(1, self.block_size, dtype=torch.long, device="meta")
        try:
            with torch.no_grad():
                logits = model(tokens)
        except Exception as error:  # the user's code
            raise ModelFileError(f"model {self.spec} with {_options(self.options)}: one sequence of "
                                 f"{self.block_size} tokens does not pass through it: "
                                 f"{type(error).__name__}: {error}") from None
        if isinstance(logits, torch.Tensor) and tuple(logits.shape) != (1, self.block_size, self.vocab_size):
            raise ModelFileError(f"model {self.spec}: (1, {self.block_size}) token ids gave logits of shape "
                                 f"{tuple(logits.shape)}, not (1, {self.block_size}, {self.vocab_size}) "
                                 "(batch, position, vocabulary)")

    def build(self, device=None) -> nn.Module:
        function = load_function(self.spec)
        kwargs = dict(self.options)
        parameters = inspect.signature(function).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        for name in ("vocab_size", "block_size"):
            if getattr(self, name) is not None and (takes_any or name in parameters):
                kwargs[name] = getattr(self, name)
        unknown = sorted(k for k in kwargs if k not in parameters and not takes_any)
        if unknown:
            raise ModelFileError(f"model {self.spec}: the function takes no option {unknown[0]!r}; "
                             f"it takes: {', '.join(parameters) or 'nothing'}")
        try:
            if device is None:
                return function(**kwargs)
            with on_meta() if torch.device(device).type == "meta" else torch.device(device):
                return function(**kwargs)
        except Exception as error:  # the user's code
            raise ModelFileError(f"model {self.spec}: {type(error).__name__}: {error}") from None


def _options(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items()) or "its defaults"


def language_model_shape(model: nn.Module) -> tuple[int | None, int | None]:
    """(vocabulary, context length) read from a language model or its config; None where absent."""
    return _read(model, ("vocab_size",)), _read(model, CONTEXT_ATTRS)


def _read(model: nn.Module, names: tuple[str, ...]):
    for owner in (model, getattr(model, "config", None)):
        for name in names:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def file_model_config(spec: str, overrides: dict) -> CausalLMFile:
    options = dict(overrides)
    config = CausalLMFile(spec, options, options.pop("vocab_size", None), options.pop("block_size", None))
    path = Path(spec.rpartition(":")[0])
    key = (spec, path.stat().st_mtime if path.is_file() else None, repr(sorted(overrides.items())))
    if key not in _VALIDATED:  # building a model on the meta device still takes ~60 ms of init calls
        config.validate()
        _VALIDATED[key] = (config.vocab_size, config.block_size)
    config.vocab_size, config.block_size = _VALIDATED[key]
    return config


# (FILE.py:FUNCTION, the file's mtime, options) -> (vocabulary, context length) of a model that
# built: validation asks for a configuration many times, and the file changing starts afresh.
_VALIDATED: dict[tuple, tuple[int, int]] = {}
