"""The program's signal configuration, GT's `gt.config`: YAML files and Python classes.

    gt.register_config("fwd", gt.SignalConfig(shard=gt.ShardConfig(axis=0), backward_signal="bwd"))
    gt.register_config("bwd", gt.SignalConfig(shard=gt.ShardConfig(axis=0, workers=[2, 3])))

The configuration lives here, in the program, and is sent to the dispatcher whenever it
changes while a session is open (and when a session opens). So it may be written before the
first operation, in any order: a signal may name a `backward` signal registered later. Each
signal's own settings are checked when it is registered (one line per problem); whether its
workers exist is checked by the dispatcher, which knows how many it has; a `backward` that
names no signal is reported when a tensor first crosses into the region.

A program that auto-starts gets as many workers as its configuration names (and at least
`gpu_workers(n)`), as GT's `signal_demo.py` expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from paratrain.frontend import signals


@dataclass
class ShardConfig:
    """How a signal splits the tensors created in it: along `axis`, over `workers` (None: all
    of them); `replicated=True` copies them whole onto those workers instead."""
    axis: int = 0
    workers: list | None = None
    replicated: bool = False


@dataclass
class SignalConfig:
    """One signal: its layout (`shard`, or paratrain's `workers` for a replicated region), the
    signal its gradients travel back as (`backward_signal`), and whether it is compiled."""
    shard: ShardConfig | None = None
    backward_signal: str | None = None
    compile: bool = False
    workers: list | None = None

    def to_dict(self) -> dict:
        """The YAML form of this signal (what the dispatcher is sent)."""
        settings: dict = {}
        if self.shard is not None:
            settings["shard"] = {"axis": self.shard.axis, "workers": _listed(self.shard.workers)}
            if self.shard.replicated:
                settings["shard"]["replicated"] = True
        if self.workers is not None:
            settings["workers"] = list(self.workers)
        if self.backward_signal is not None:
            settings["backward"] = self.backward_signal
        if self.compile:
            settings["compile"] = True
        return settings

    @classmethod
    def from_dict(cls, settings: dict) -> SignalConfig:
        shard = settings.get("shard")
        return cls(
            shard=None if shard is None else ShardConfig(shard.get("axis", 0), _listed(shard.get("workers")),
                                                         bool(shard.get("replicated", False))),
            backward_signal=settings.get("backward"),
            compile=bool(settings.get("compile", False)),
            workers=_listed(settings.get("workers")),
        )


def _listed(workers):
    return None if workers is None else list(workers)


class Config:
    """GT's configuration object (`gt.get_config()`): signal name -> settings. `on_change` is
    called with the whole configuration after each change (the defaults send it to the open
    session)."""

    def __init__(self, on_change: Callable[[dict], object] | None = None):
        self._settings: dict[str, dict] = {}
        self.on_change = on_change
        self.source: str | None = None  # the last file loaded

    @property
    def signals(self) -> dict[str, SignalConfig]:
        return {name: SignalConfig.from_dict(settings) for name, settings in self._settings.items()}

    def load(self, source) -> list[str]:
        """Add the signals of a YAML file (or a mapping); -> their names. ConfigError lists every
        problem of the file at once."""
        loaded = signals.load(source)
        signals.check(loaded)
        self._change({**self._settings, **{str(name): dict(settings) for name, settings in loaded.items()}})
        self.source = source if isinstance(source, str) else self.source
        return sorted(str(name) for name in loaded)

    def register_signal(self, name: str, config) -> list[str]:
        """Add or replace one signal (a SignalConfig or its YAML form as a dict)."""
        settings = config.to_dict() if isinstance(config, SignalConfig) else dict(config)
        signals.check({name: settings})
        self._change({**self._settings, str(name): settings})
        return sorted(self._settings)

    def get_signal(self, name: str) -> SignalConfig | None:
        settings = self._settings.get(name)
        return None if settings is None else SignalConfig.from_dict(settings)

    def has_signal(self, name: str) -> bool:
        return name in self._settings

    def clear(self) -> None:
        self._change({})
        self.source = None

    def to_dict(self) -> dict:
        return {name: dict(settings) for name, settings in self._settings.items()}

    def workers_named(self) -> int:
        """How many workers the configuration needs: one more than the highest it names."""
        return 1 + max((worker for settings in self._settings.values() for worker in signals.named_workers(settings)),
                       default=-1)

    def _change(self, settings: dict) -> None:
        """Take `settings` if the session (when there is one) accepts them; a refused change
        leaves the configuration as it was."""
        if self.on_change is not None:
            self.on_change({name: dict(value) for name, value in settings.items()})
        self._settings = settings
