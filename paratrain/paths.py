"""Whether a path the user named for output can be written, asked before the work that
would write it: a benchmark's JSON or a checkpoint directory refused at the end of a long
run wastes the run."""

from __future__ import annotations

import tempfile
from pathlib import Path


def cannot_write(path: str | Path, directory: bool = False) -> str | None:
    """Why `path` (a file, or with `directory` a folder) cannot be written, in a few words
    naming the path at fault; None if it can. The missing folders are made, as the command
    would make them, and a file is tried in the last: permission bits do not tell (root may
    write anywhere but /proc; a file system may be read-only). Ranks of one run may ask at
    once: nothing here races with another asking."""
    path = Path(path)
    folder = path if directory else path.parent
    existing = next(p for p in (folder, *folder.parents, Path(".")) if p.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot make {folder}: {_reason(error)}"
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        return f"{folder} is not writable: {_reason(error)}"
    if directory or not path.exists():
        return None
    if path.is_dir():
        return f"{path} is a directory"
    try:
        with open(path, "ab"):
            return None
    except OSError as error:
        return f"{path} is not writable: {_reason(error)}"


def _reason(error: OSError) -> str:
    return (error.strerror or str(error)).lower()
