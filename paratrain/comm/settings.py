"""What the environment sets for communication: PARATRAIN_TIMEOUT (seconds a call may wait)
and PARATRAIN_DEBUG (check that all ranks make the same call; the `paratrain` command then
prints the traceback of an error too, see cli_errors.py). Read by every Group, and by
the launcher and the frontend, which pass the timeout on to the process groups they make.
(The shared-memory settings, PARATRAIN_SHM*, are read through int_from_env by
transport/shm_setup.py.)"""

from __future__ import annotations

import math
import os

DEFAULT_TIMEOUT_S = 300.0  # generous: a first NCCL call or a slow rank on a busy host is normal


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def timeout_from_env() -> float:
    return _from_env("PARATRAIN_TIMEOUT", DEFAULT_TIMEOUT_S, float, "a number of seconds", lambda v: 0 < v < math.inf,
                     "positive and finite")


def int_from_env(name: str, default: int, least: int) -> int:
    return _from_env(name, default, int, "a whole number", lambda v: v >= least, f"at least {least}")


def _from_env(name: str, default, kind, what: str, valid, rule: str):
    """`name`'s value read as `kind` (`default` when unset or empty), or a ValueError that says
    what it must be."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be {what}, got {raw!r}") from None
    if not valid(value):
        raise ValueError(f"{name} must be {rule}, got {raw!r}")
    return value
