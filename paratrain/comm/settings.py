"""What the environment sets for communication: PARATRAIN_TIMEOUT (seconds a call may wait)
and PARATRAIN_DEBUG (check that all ranks make the same call). Read by every Group, and by
the launcher and the frontend, which pass the timeout on to the process groups they make."""

from __future__ import annotations

import os

DEFAULT_TIMEOUT_S = 300.0  # generous: a first NCCL call or a slow rank on a busy host is normal


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def timeout_from_env() -> float:
    raw = os.environ.get("PARATRAIN_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"PARATRAIN_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"PARATRAIN_TIMEOUT must be positive, got {raw!r}")
    return value
