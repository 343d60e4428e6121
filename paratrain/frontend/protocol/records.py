"""The records inside messages: an error, a fetched tensor, a worker's times, the rows of
`paratrain top`. Each travels as a list of its fields (they repeat by the hundred); `records`
checks such a list into its NamedTuple."""

from __future__ import annotations

from typing import NamedTuple

from paratrain.frontend.protocol import fields
from paratrain.frontend.protocol.fields import MalformedMessage

MAX_WORKERS = 1 << 12
MAX_ERRORS = 1 << 10  # error reports in one reply
MAX_FETCH = 1 << 16  # tensors read in one sync
HANDLE = (0, (1 << 31) - 1)
RANK = (0, MAX_WORKERS - 1)


class ErrorReport(NamedTuple):
    """An instruction that failed (on a worker) or was refused (by the dispatcher)."""
    seq: int  # the client's number for the instruction (-1: not one instruction)
    op: str
    inputs: list  # its tensor inputs, described as dtype[shape]
    worker: int | None  # None: the dispatcher refused it
    message: str


class Fetched(NamedTuple):
    """A tensor's value asked for by a sync: its bytes follow as `parts` frames (one per worker
    holding a part of it, split along `axis`), or `error` says why it cannot be read."""
    handle: int
    dtype: str | None  # None: not read, see error
    shape: list
    parts: int
    axis: int | None
    error: str | None


class CompileCounts(NamedTuple):
    """What a worker's compiler has done since it started (see workers/compiled.py)."""
    functions: int  # compiled functions it holds, one per run signature
    compiled_runs: int  # runs executed by a compiled function (the run that compiled it included)
    eager_runs: int  # runs of compiled regions executed one instruction at a time (first sightings, fallbacks)
    failures: int  # compiles given up on (their runs execute eagerly)


NO_COMPILES = CompileCounts(0, 0, 0, 0)


class WorkerTimes(NamedTuple):
    worker: int
    busy_s: float  # running instructions, since the worker started
    wait_s: float  # waiting for another worker's tensor (a pipeline's bubble)
    compiled: CompileCounts = NO_COMPILES


class Timing(NamedTuple):
    log: int  # the instruction's line in the log
    started: float  # when it started, seconds since the epoch (the worker's clock)
    seconds: float


class WorkerRow(NamedTuple):
    """One row of `paratrain top`."""
    rank: int
    host: str
    pid: int
    device: str
    alive: bool
    ops: int
    queue: int
    memory: int
    ops_per_s: float
    busy: float


class WorkerReport(NamedTuple):
    """One worker as `gt.debug.get_worker_stats` shows it: its last heartbeat, taken after the
    request arrived, so everything the client synced before asking is counted."""
    rank: int
    host: str
    pid: int
    device: str
    alive: bool
    ops: int  # instructions run, all clients
    busy_s: float  # running instructions, since the worker started
    queue: int
    memory: int
    by_op: dict  # operation name -> instructions of it run


class ClientRow(NamedTuple):
    client: int
    name: str
    pid: int
    instructions: int
    tensors: int


def records(kind, value, name: str, max_len: int, *checks):
    """A list of `kind` records, each a list whose items pass `checks` (one per field). A
    record's fields are named in an error only once one fails (naming each costs more than
    checking it)."""
    if value == [] and type(value) is list:
        return []
    out = []
    width = len(checks)
    for i, item in enumerate(fields.items(value, name, max_len)):
        if type(item) is not list or len(item) != width:
            raise MalformedMessage(f"a record of {width} fields ({', '.join(kind._fields)})", f"{name}[{i}]")
        try:
            out.append(kind(*[check(v, name) for check, v in zip(checks, item)]))
        except MalformedMessage:
            for check, v, field in zip(checks, item, kind._fields):
                check(v, f"{name}[{i}].{field}")
            raise
    return out


def error_reports(value, name):
    return records(ErrorReport, value, name, MAX_ERRORS,
                    lambda v, n: fields.integer(v, n, -1), lambda v, n: fields.text(v, n, 64),
                    lambda v, n: fields.texts(v, n, 4096, 256),
                    lambda v, n: fields.optional(v, n, fields.integer, *RANK),
                    lambda v, n: fields.text(v, n, fields.MAX_TEXT))


def fetched_list(value, name):
    return records(Fetched, value, name, MAX_FETCH,
                    lambda v, n: fields.integer(v, n, *HANDLE), lambda v, n: fields.optional(v, n, fields.text, 16),
                    lambda v, n: fields.integers(v, n, 64, 0), lambda v, n: fields.integer(v, n, 0, MAX_WORKERS),
                    lambda v, n: fields.optional(v, n, fields.integer, 0, 63),
                    lambda v, n: fields.optional(v, n, fields.text, fields.MAX_TEXT))


def op_counts(value, name):
    """Operation name -> how many ran (at most one entry per operation of the table)."""
    for key, count in fields.mapping(value, name, 1024).items():
        fields.integer(count, f"{name}.{fields.text(key, name, 64)}", 0)
    return value


def worker_reports(value, name):
    return records(WorkerReport, value, name, MAX_WORKERS, lambda v, n: fields.integer(v, n, *RANK), fields.text,
                   fields.integer, fields.text, fields.flag, lambda v, n: fields.integer(v, n, 0), fields.number,
                   lambda v, n: fields.integer(v, n, 0), lambda v, n: fields.integer(v, n, 0), op_counts)


def compile_counts(value, name) -> CompileCounts:
    width = len(CompileCounts._fields)
    if type(value) is not list or len(value) != width:
        raise MalformedMessage(f"a record of {width} counts ({', '.join(CompileCounts._fields)})", name)
    return CompileCounts(*fields.integers(value, name, width, 0))


def worker_times(value, name):
    return records(WorkerTimes, value, name, MAX_WORKERS, lambda v, n: fields.integer(v, n, *RANK),
                    fields.number, fields.number, compile_counts)
