"""A worker's compilation settings, read from the environment once, when the worker starts.

GT's variables, each also under a PARATRAIN_ name (which wins when both are set):

    GT_AUTO_COMPILE=1          find repeated operation sequences and compile them, no markers needed
    GT_HOTPATH_THRESHOLD=5     sightings of a sequence before it counts as hot
    GT_HOTPATH_MIN_SEQ=3       the shortest sequence (in operations) considered
    GT_HOTPATH_WINDOW=20       how many recent operations are searched for repeats
    GT_HOTPATH_MAX_EXPAND=4    repetitions of a hot sequence compiled together as one function
    GT_DEBUG_COMPILE=1         print one line per region compiled, run or given up on
    GT_SAVE_COMPILED_CODE=DIR  write each generated function's source to DIR (1: a folder in the
                               system's temporary directory, printed when the first file is written)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

_FLAG_OFF = ("", "0", "false", "no", "off")


class SettingsError(ValueError):
    """An environment variable that does not hold what it must."""


@dataclass(frozen=True)
class CompileSettings:
    auto: bool = False  # hot-path detection on every client's stream
    threshold: int = 5  # GT's documented default: a loop is hot after five iterations
    min_ops: int = 3  # shorter sequences save too little launch overhead to pay for a compile
    window: int = 20  # bounds the detector's work per operation (it counts every suffix)
    expand: int = 4  # GT's default: four iterations per function cut calls by four
    debug: bool = False
    save_dir: str | None = None  # where generated sources go (None: nowhere)

    def __post_init__(self):
        for name in ("threshold", "min_ops", "window", "expand"):
            if getattr(self, name) < 1:
                raise SettingsError(f"compile setting {name} must be at least 1, got {getattr(self, name)}")
        if self.min_ops > self.window:
            raise SettingsError(f"GT_HOTPATH_MIN_SEQ ({self.min_ops}) is longer than GT_HOTPATH_WINDOW ({self.window})")

    @classmethod
    def from_env(cls, env=None) -> CompileSettings:
        env = os.environ if env is None else env

        def read(name: str) -> str | None:
            return env.get(f"PARATRAIN_{name}", env.get(f"GT_{name}"))

        def number(name: str, default: int) -> int:
            text = read(name)
            if text is None or text.strip() == "":
                return default
            try:
                return int(text)
            except ValueError:
                raise SettingsError(f"GT_{name} / PARATRAIN_{name} must be an integer, got {text!r}") from None

        save = read("SAVE_COMPILED_CODE")
        if save is not None and save.strip().lower() in _FLAG_OFF:
            save = None
        elif save is not None and save.strip().lower() in ("1", "true", "yes", "on"):
            save = os.path.join(tempfile.gettempdir(), "paratrain_compiled")
        return cls(
            auto=(read("AUTO_COMPILE") or "").strip().lower() not in _FLAG_OFF,
            threshold=number("HOTPATH_THRESHOLD", cls.threshold),
            min_ops=number("HOTPATH_MIN_SEQ", cls.min_ops),
            window=number("HOTPATH_WINDOW", cls.window),
            expand=number("HOTPATH_MAX_EXPAND", cls.expand),
            debug=(read("DEBUG_COMPILE") or "").strip().lower() not in _FLAG_OFF,
            save_dir=save,
        )
