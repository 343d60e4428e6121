"""`gt.signal`: named regions of a program, placed by a configuration (see signals.py).

    with gt.signal.context("pp_stage0_colpar"):   # instructions issued here carry the name
        w = gt.randn(1024, 3072)                  # created split as the signal says
        qkv = x @ w                               # run on the signal's workers
    x1 = gt.signal.tensor(x, "pp_stage1")         # moved / re-split to the signal's layout

The configuration comes from GT_CONFIG or PARATRAIN_CONFIG (a YAML file) when the program
connects, or from `gt.load_config(path_or_dict)` and `gt.register_config(name, settings)`.
A name the configuration does not know places nothing: the region's operations run where
their inputs live, as outside any region. A region whose signal says `compile: true` runs
compiled on the workers from its second execution on (the session marks where it begins and
ends in the instruction stream).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from paratrain.frontend.client import defaults, regions
from paratrain.frontend.client.tensor import Tensor

current = regions.current
enter = regions.enter
exit = regions.leave  # noqa: A001 - GT's name


@contextlib.contextmanager
def context(name: str, backward: str | None = None):
    """Issue what runs inside as part of region `name`. (`backward` is accepted for GT's
    programs; in paratrain a region's backward layout comes from its configuration.)"""
    regions.enter(name)
    try:
        yield
    finally:
        regions.leave(name)


def tensor(x: Tensor, name: str) -> Tensor:
    """`x` laid out as signal `name` says: moved to its workers, split or gathered. The move
    is differentiable; in backward its gradient travels back the same way."""
    session = x._session
    result = Tensor(session, session.new_handle(), x.shape, x.dtype, x.requires_grad)
    result._parents = (x,) if x.requires_grad else ()
    session.issue("reshard", [result._handle], [x._handle], [0], {"signal": name}, tensors=(x,))
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
    compile: bool = False

    def to_dict(self) -> dict:
        settings = {}
        if self.shard is not None:
            settings["shard"] = {"axis": self.shard.axis, "workers": list(self.shard.workers)}
        if self.workers is not None:
            settings["workers"] = list(self.workers)
        if self.backward_signal is not None:
            settings["backward"] = self.backward_signal
        if self.compile:
            settings["compile"] = True
        return settings


def load_config(source, session=None) -> list[str]:
    """Use the signals of a YAML file (or a dict) from now on; -> their names. Every problem
    in it is reported at once, one line each (ConfigError)."""
    return (session or defaults.session()).load_config(source)


def register_config(name: str, config, session=None) -> list[str]:
    """Add or replace one signal (a SignalConfig or a settings dict)."""
    session = session or defaults.session()
    settings = config.to_dict() if isinstance(config, SignalConfig) else dict(config)
    return session.configure({**session.signal_config, name: settings})
