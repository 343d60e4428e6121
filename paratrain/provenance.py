"""Where a measurement came from: the date and the code's commit, stated beside every generated
figure (docs/results.md)."""

from __future__ import annotations

import datetime
import subprocess


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def code_commit() -> str | None:
    """The code's commit (None outside a git checkout), marked when paratrain/ differs from it
    (docs/ changing is expected: the figures are being written)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "paratrain"]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + (" with uncommitted changes to paratrain/" if dirty else "")
