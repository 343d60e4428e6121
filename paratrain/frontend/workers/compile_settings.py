"""A worker's compilation settings, taken from the process's settings (paratrain/environment.py,
resolved once when the worker starts).

GT's variables, each also under a PARATRAIN_ name (which wins when both are set):

    GT_AUTO_COMPILE=1          find repeated operation sequences and compile them, no markers needed
    GT_HOTPATH_THRESHOLD=5     sightings of a sequence before it counts as hot
    GT_HOTPATH_MIN_SEQ=3       the shortest sequence (in operations) considered
    GT_HOTPATH_WINDOW=20       how many recent operations are searched for repeats
    GT_HOTPATH_MAX_EXPAND=4    repetitions of a hot sequence compiled together as one function
    GT_DEBUG_COMPILE=1         print one line per region compiled, run or given up on
    GT_SAVE_COMPILED_CODE=DIR  write each generated function's source to DIR (1: a folder in the
                               system's temporary directory, printed when the first file is written)

and one of paratrain's own:

    PARATRAIN_COMPILE_BACKEND=inductor  torch.compile's backend (aot_eager: traced and differentiated
                               as with inductor, run by torch's own kernels, with no C++ compiler)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from paratrain.environment import Settings, SettingsError, compile_backend_problem

_FLAG_ON, _FLAG_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class CompileSettings:
    auto: bool = Settings.auto_compile  # hot-path detection on every client's stream
    threshold: int = Settings.hotpath_threshold  # (the defaults say why they are what they are)
    min_ops: int = Settings.hotpath_min_seq
    window: int = Settings.hotpath_window
    expand: int = Settings.hotpath_max_expand
    debug: bool = False
    save_dir: str | None = None  # where generated sources go (None: nowhere)
    backend: str = "inductor"  # torch.compile's: aot_eager traces and differentiates, generating no code

    def __post_init__(self):
        for name in ("threshold", "min_ops", "window", "expand"):
            if getattr(self, name) < 1:
                raise SettingsError(f"compile setting {name} must be at least 1, got {getattr(self, name)}")
        problem = compile_backend_problem(self.backend)
        if problem:
            raise SettingsError(problem)
        if self.min_ops > self.window:
            raise SettingsError(f"GT_HOTPATH_MIN_SEQ ({self.min_ops}) is longer than GT_HOTPATH_WINDOW ({self.window})")

    @classmethod
    def from_settings(cls, settings: Settings) -> CompileSettings:
        save = settings.save_compiled_code
        if save is not None and save.lower() in _FLAG_OFF:
            save = None
        elif save is not None and save.lower() in _FLAG_ON:
            save = os.path.join(tempfile.gettempdir(), "paratrain_compiled")
        return cls(
            auto=settings.auto_compile, threshold=settings.hotpath_threshold, min_ops=settings.hotpath_min_seq,
            window=settings.hotpath_window, expand=settings.hotpath_max_expand, debug=settings.debug_compile,
            save_dir=save, backend=settings.compile_backend,
        )
