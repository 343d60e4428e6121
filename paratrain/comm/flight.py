"""The flight recorder: each rank's last calls, written out when something goes wrong.

Every collective and point-to-point call a `Group` makes leaves a `Call` in its rank's ring
buffer (the last 64): what it was, on which ranks, with what tensor and algorithm, when it
started and finished, and whether it completed or failed. Recording is one small object and a
deque append per call; nothing is formatted until a dump.

A timeout, a lost peer or a mismatched call dumps the records this process holds (every rank's
on the threads fabric, its own under processes) as `rank<global rank>.json` into the trace
folder of its settings (PARATRAIN_TRACE_DIR), or a temporary folder named after the run or
fresh, named in the error. `paratrain debug hang
DIR` reads them and says which rank is behind or which calls differ.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections import deque
from contextlib import nullcontext

import torch

from paratrain.errors import UserError

CAPACITY = 64  # enough to see the calls around a hang; small enough to dump in a blink
_NO_RANGE = nullcontext()


def named_range(op: str):
    """A collective as a named range (`paratrain.all_reduce`) in a torch.profiler trace while
    one records (`train --profile`); otherwise nothing. torch.profiler sets the flag read here
    for the whole process (its C++ `_profiler_enabled()` answers for the calling thread only,
    and not for a Kineto profiler); a torch without the flag gets the ranges always."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(f"paratrain.{op}")
    return _NO_RANGE


class Call:
    """One recorded call. `group` is the group's key: (its global ranks, how many groups on
    these ranks this rank made before it); `tensor` is a collective's CallSignature or a p2p's
    (shape, dtype); `peer` is a p2p's peer, numbered in the group."""

    __slots__ = ("group", "kind", "seq", "op", "tensor", "algo", "peer", "started", "finished", "state")

    def __init__(self, group, kind, seq, op, tensor, algo, peer):
        self.group, self.kind, self.seq, self.op = group, kind, seq, op
        self.tensor, self.algo, self.peer = tensor, algo, peer
        self.started = time.time()  # wall clock: comparable across the processes of one host
        self.finished = None
        self.state = "started"

    def complete(self) -> None:
        self.finished = time.time()
        self.state = "completed"

    def fail(self) -> None:
        self.finished = time.time()
        self.state = "failed"

    def to_json(self) -> dict:
        ranks = self.group[0]
        entry = {
            "group": list(ranks), "group_index": self.group[1], "kind": self.kind, "seq": self.seq,
            "op": self.op, "algo": self.algo,
            "peer": ranks[self.peer] if self.peer is not None else None,
            "started": self.started, "finished": self.finished, "state": self.state,
        }
        if self.kind == "collective":
            signature = self.tensor
            entry.update(shape=list(signature.shape), dtype=_dtype_name(signature.dtype),
                         reduce_op=signature.reduce_op or None,
                         root=signature.root if signature.root >= 0 else None)
        else:
            shape, dtype = self.tensor
            entry.update(shape=list(shape), dtype=_dtype_name(dtype))
        return entry


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


class FlightRecorder:
    """One rank's ring buffer of calls, shared by all of that rank's groups."""

    def __init__(self, rank: int, capacity: int = CAPACITY):
        self.rank = rank  # global
        self.calls: deque[Call] = deque(maxlen=capacity)
        self.error: str | None = None  # this rank's own failure, if it had one
        self._groups_on: dict[tuple[int, ...], int] = {}

    def group_key(self, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """A key for a new group on `ranks`: ranks that make their groups in the same order
        (as they must for process groups) give the same group the same key."""
        index = self._groups_on.get(ranks, 0)
        self._groups_on[ranks] = index + 1
        return ranks, index

    def start(self, group, kind, seq, op, tensor, algo, peer=None) -> Call:
        call = Call(group, kind, seq, op, tensor, algo, peer)
        self.calls.append(call)
        return call

    def done(self, group, kind, seq, op, tensor, algo, peer=None) -> None:
        """A call that completed as it started (a message that went straight into a ring)."""
        call = Call(group, kind, seq, op, tensor, algo, peer)
        call.finished, call.state = call.started, "completed"
        self.calls.append(call)

    def to_json(self) -> dict:
        calls = self.calls.copy()  # one C call: safe while the rank's thread keeps appending
        return {
            "rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "capacity": self.calls.maxlen, "error": self.error,
            "calls": [call.to_json() for call in calls],
        }


class FlightRecords:
    """The recorders one process holds, and the folder they are dumped into (chosen once, at
    the first dump, so that every rank of a world dumps into the same one). `trace_dir` and
    `run_id` come from the process's settings (see run_directory)."""

    def __init__(self, ranks, trace_dir: str | None = None, run_id: str | None = None):
        self.recorders = {rank: FlightRecorder(rank) for rank in ranks}
        self.trace_dir, self.run_id = trace_dir, run_id
        self._directory: str | None = None
        self._lock = threading.Lock()

    def directory(self) -> str:
        with self._lock:
            if self._directory is None:
                self._directory = (run_directory(self.run_id, self.trace_dir)
                                   or tempfile.mkdtemp(prefix="paratrain-trace-"))
            return self._directory

    def dump(self, directory: str | None = None, reason: str | None = None) -> list[str]:
        """Write every record held here as rank<r>.json; return the files' paths."""
        directory = directory or self.directory()
        os.makedirs(directory, exist_ok=True)
        paths = []
        with self._lock:  # ranks failing together rewrite the same files one at a time
            for rank, recorder in sorted(self.recorders.items()):
                record = recorder.to_json()
                record.update(run_id=self.run_id, dumped_at=time.time(), reason=reason)
                path = os.path.join(directory, f"rank{rank}.json")
                partial = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
                with open(partial, "w") as file:
                    json.dump(record, file, indent=1)
                os.replace(partial, path)  # a reader never sees half a file
                paths.append(path)
        return paths


def run_directory(run_id: str | None, trace_dir: str | None = None) -> str | None:
    """Where the ranks of run `run_id` dump: `trace_dir` (PARATRAIN_TRACE_DIR) if set, or a
    temporary folder named after the run, so that ranks in separate processes agree on it
    without talking (created at the first dump). None: no run id to name one after."""
    if trace_dir:
        return trace_dir
    if run_id:
        return os.path.join(tempfile.gettempdir(), f"paratrain-trace-{run_id.removeprefix('paratrain-')}")
    return None


class MalformedRecord(UserError):
    """A rank<N>.json that is not a flight record (cut short, edited, another program's)."""


def read_dumps(directory: str) -> dict[int, dict]:
    """The flight records in `directory`, by rank; MalformedRecord names a file that is not one."""
    dumps = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank") and name.endswith(".json") and name[4:-5].isdigit():
            path = os.path.join(directory, name)
            try:
                with open(path) as file:
                    record = json.load(file)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
                raise MalformedRecord(f"{path} cannot be read as a flight record: {error}") from None
            problem = _record_problem(record)
            if problem:
                raise MalformedRecord(f"{path} is not a flight record: {problem}")
            dumps[int(name[4:-5])] = record
    return dumps


_NUMBER, _MAYBE_STR, _MAYBE_INT = (int, float), (str, type(None)), (int, type(None))
_RECORD_FIELDS = {"calls": list, "capacity": int, "error": _MAYBE_STR}
_CALL_FIELDS = {"group": list, "group_index": int, "kind": str, "seq": int, "op": str, "algo": _MAYBE_STR,
                "peer": _MAYBE_INT, "started": _NUMBER, "finished": (*_NUMBER, type(None)), "state": str,
                "shape": list, "dtype": _MAYBE_STR}


def _record_problem(record) -> str | None:
    """What is wrong with a decoded flight record (what `paratrain debug hang` reads), or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    for entry, fields, where in [(record, _RECORD_FIELDS, "")] + [
            (call, _CALL_FIELDS, f"calls[{i}].") for i, call in enumerate(record.get("calls") or [])]:
        if not isinstance(entry, dict):
            return f"{where.rstrip('.')} is not an object"
        for field, kind in fields.items():
            if field not in entry:
                return f"{where}{field} is missing"
            if not isinstance(entry[field], kind):
                return f"{where}{field} is {entry[field]!r}, expected {_kind_name(kind)}"
    return None


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def dump_flight_record(group, directory: str | None = None) -> list[str]:
    """Write the flight records this process holds (every rank's on the threads fabric, this
    rank's under processes) into `directory` (default: the settings' trace folder or a
    temporary one); returns the files written."""
    return group.flight.dump(directory, reason="dumped on request")
