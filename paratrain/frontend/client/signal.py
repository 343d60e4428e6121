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

from paratrain.frontend.client import defaults, regions
from paratrain.frontend.client.config import Config, ShardConfig, SignalConfig  # noqa: F401 - GT's names here too
from paratrain.frontend.client.autograd import Node
from paratrain.frontend.client.tensor import Tensor

current = regions.current
exit = regions.leave  # noqa: A001 - GT's name


def enter(name: str, backward: str | None = None) -> None:
    """Begin region `name` (end it with `exit(name)`). `backward` names the signal its
    gradients travel back as: the same as a `backward:` key in the configuration."""
    regions.enter(name)
    if backward is not None:
        _backward_is(name, backward)


@contextlib.contextmanager
def context(name: str, backward: str | None = None):
    """Issue what runs inside as part of region `name`; `backward` as for `enter`."""
    enter(name, backward)
    try:
        yield
    finally:
        regions.leave(name)


def tensor(x: Tensor, name: str, backward_name: str | None = None) -> Tensor:
    """`x` laid out as signal `name` says: moved to its workers, split or gathered. The move
    is differentiable; in backward its gradient travels back the same way, or laid out as
    signal `backward_name` says (instead of the configuration's `backward` for `name`)."""
    session = x._session
    result = Tensor(session, session.new_handle(), x.shape, x.dtype, x.requires_grad)
    if x.requires_grad:
        result._node = Node(result, (x._graph_node(),))
    kwargs = {"signal": name} if backward_name is None else {"signal": name, "backward": backward_name}
    session.issue("reshard", [result._handle], [x._handle], [0], kwargs, tensors=(x,))
    return result


def _backward_is(name: str, backward: str) -> None:
    """A region entered with `backward=`: record it in the configuration, once (a configured
    signal only: a name the configuration does not know places nothing, forward or back)."""
    if not isinstance(backward, str) or not backward:
        raise ValueError(f"backward must name a signal, got {backward!r}")
    config = defaults.DEFAULTS.config
    known = config.get_signal(name)
    if known is not None and known.backward_signal != backward:
        known.backward_signal = backward
        config.register_signal(name, known)


# ---- configuration (GT's Python API, and YAML): kept by the program, see config.py --------------


def load_config(source, session=None) -> list[str]:
    """Use the signals of a YAML file (or a dict) from now on; -> their names. Every problem
    in it is reported at once, one line each (ConfigError)."""
    if session is not None:
        return session.load_config(source)
    return defaults.DEFAULTS.config.load(source)


def register_config(name: str, config, session=None) -> list[str]:
    """Add or replace one signal (a SignalConfig or a settings dict), in any order."""
    if session is not None:
        settings = config.to_dict() if isinstance(config, SignalConfig) else dict(config)
        return session.configure({**session.signal_config, name: settings})
    return defaults.DEFAULTS.config.register_signal(name, config)


def get_config() -> Config:
    """The program's configuration object (GT's)."""
    return defaults.DEFAULTS.config


def get_signal_config(name: str) -> SignalConfig | None:
    return defaults.DEFAULTS.config.get_signal(name)
