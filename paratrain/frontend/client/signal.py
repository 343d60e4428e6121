"""`gt.signal`: named regions of a program, placed by a configuration (see signals.py).

    with gt.signal.context("pp_stage0_colpar"):   # instructions issued here carry the name
        w = gt.randn(1024, 3072)                  # created split as the signal says
        qkv = x @ w                               # run on the signal's workers
    x1 = gt.signal.tensor(x, "pp_stage1")         # moved / re-split to the signal's layout

The configuration comes from GT_CONFIG or PARATRAIN_CONFIG (a YAML file) when the program
connects, or from `gt.load_config(path_or_dict)` and `gt.register_config(name, settings)`.
A name the configuration does not know places nothing: the region's operations run where
their inputs live, as outside any region.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

_state = threading.local()


def current() -> str | None:
    """The innermost active signal of this thread (None outside every region)."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def enter(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a signal name must be a non-empty string, got {name!r}")
    if not hasattr(_state, "stack"):
        _state.stack = []
    _state.stack.append(name)


def exit(name: str) -> None:  # noqa: A001 - GT's name
    stack = getattr(_state, "stack", [])
    if not stack or stack[-1] != name:
        raise RuntimeError(f"signal.exit({name!r}) does not match the innermost region {current()!r}")
    stack.pop()


@contextlib.contextmanager
def context(name: str, backward: str | None = None):
    """Issue what runs inside as part of region `name`. (`backward` is accepted for GT's
    programs; in paratrain a region's backward layout comes from its configuration.)"""
    enter(name)
    try:
        yield
    finally:
        exit(name)


def tensor(x, name: str):
    """`x` laid out as signal `name` says: moved to its workers, split or gathered. The move
    is differentiable; in backward its gradient travels back the same way."""
    from paratrain.frontend.client.tensor import Tensor

    session = x._session
    result = Tensor(session, session.new_handle(), x.shape, x.dtype, x.requires_grad)
    result._parents = (x,) if x.requires_grad else ()
    session.issue("reshard", [result._handle], [x._handle], [0], {"signal": name}, tensors=(x,), results=(result,))
    return result


# ---- configuration (GT's Python API, and YAML) ----------------------------------------------


@dataclass
class ShardConfig:
    axis: int = 0
    workers: list = field(default_factory=list)


@dataclass
class SignalConfig:
    shard: ShardConfig | None = None
    workers: list | None = None
    backward_signal: str | None = None

    def to_dict(self) -> dict:
        settings = {}
        if self.shard is not None:
            settings["shard"] = {"axis": self.shard.axis, "workers": list(self.shard.workers)}
        if self.workers is not None:
            settings["workers"] = list(self.workers)
        if self.backward_signal is not None:
            settings["backward"] = self.backward_signal
        return settings


def load_config(source, session=None) -> list[str]:
    """Use the signals of a YAML file (or a dict) from now on; -> their names. Every problem
    in it is reported at once, one line each (ConfigError)."""
    from paratrain.frontend import api, signals

    session = session or api.session()
    session.signal_config = dict(signals.load(source))
    return session.configure(session.signal_config)


def register_config(name: str, config, session=None) -> list[str]:
    """Add or replace one signal (a SignalConfig or a settings dict)."""
    from paratrain.frontend import api

    session = session or api.session()
    settings = config.to_dict() if isinstance(config, SignalConfig) else dict(config)
    session.signal_config = {**session.signal_config, name: settings}
    return session.configure(session.signal_config)
