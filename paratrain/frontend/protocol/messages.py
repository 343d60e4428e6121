"""Every message between client, dispatcher and worker, as a class with typed fields.

Each class says who sends it to whom, and each field how it is checked when decoded (`spec`):
a message that `decode` returns has every field of the type and range written here, so no code
past decoding checks a field again. Tensor bytes travel as extra frames (`frames`), never inside
the msgpack header.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.frontend.protocol import fields
from paratrain.frontend.protocol.fields import MalformedMessage
from paratrain.frontend.protocol.instructions import check_instruction, upload_bytes
from paratrain.frontend.protocol.records import (
    HANDLE, MAX_FETCH, MAX_WORKERS, RANK, ClientRow, Timing, WorkerRow, compile_counts, error_reports, fetched_list,
    op_counts, records, worker_reports, worker_times,
)

VERSION = 4  # bumped when a message changes; a hello with another version is refused
ROLES = ("client", "worker", "monitor")
MAX_BATCH = 1 << 14  # instructions in one message (a client sends at most 256)
MAX_TRACE_LINES = 4096  # log lines in one TraceEvents; a capture asks again for the rest
MAX_TRACE_LINE = 4096  # characters of one line (longer ones are cut)
MAX_KEEP_S = 10.0  # how long one TraceRequest keeps the dispatcher recording: a gone monitor stops it soon
SLOT = (1, (1 << 31) - 1)  # a client's number at the dispatcher


def spec(check, *args):
    """A message field, checked on decoding by `check(value, name, *args)`."""
    return field(metadata={"check": check, "args": args})


def frames_field(kw_only: bool = False):
    """The raw frames after the header (tensor bytes); not part of the header."""
    return field(default_factory=list, kw_only=kw_only, metadata={"frames": True})


# ---- checks of whole fields -----------------------------------------------------------------------

def _instructions(value, name, from_client):
    return [check_instruction(raw, name, i, from_client) for i, raw in enumerate(fields.items(value, name, MAX_BATCH))]


def _config(value, name, depth: int = 4):
    """A signal configuration as sent: maps with string keys, nested at most `depth` deep, over
    plain values (signals.parse says what is wrong with its contents)."""
    if type(value) is dict:
        if depth == 0 or len(value) > 4096:
            raise MalformedMessage("a configuration nested at most 4 deep, at most 4096 entries a map", name)
        for key, item in value.items():
            _config(item, f"{name}.{fields.text(key, name, 256)}", depth - 1)
        return value
    return fields.plain(value, name)


def _keep_seconds(value, name):
    seconds = fields.number(value, name)
    if not 0 < seconds <= MAX_KEEP_S:
        raise MalformedMessage(f"must be more than 0 and at most {MAX_KEEP_S:g} seconds, got {seconds}", name)
    return seconds


def _check_upload_frames(instructions, frames, name: str) -> None:
    for i, instruction in enumerate(instructions):
        if instruction.op != "upload":
            continue
        frame = instruction.kwargs["frame"]
        if frame >= len(frames):
            raise MalformedMessage(f"frame {frame} is not among the message's {len(frames)} frames",
                                   f"{name}[{i}].kwargs.frame")
        if len(frames[frame]) != upload_bytes(instruction):
            raise MalformedMessage(f"frame {frame} holds {len(frames[frame])} bytes; a {instruction.kwargs['dtype']}"
                                   f"{instruction.kwargs['shape']} tensor has {upload_bytes(instruction)}",
                                   f"{name}[{i}].kwargs.shape")


def _check_fetched_frames(fetched, frames) -> None:
    expected = sum(entry.parts for entry in fetched if entry.dtype is not None)
    if expected != len(frames):
        raise MalformedMessage(f"the fetched tensors need {expected} frames, the message has {len(frames)}", "fetched")


# ---- joining: any peer and the dispatcher ------------------------------------------------------

@dataclass(slots=True)
class Hello:
    """peer -> dispatcher, first: who it is. `rank`: a worker's rank in a world formed by a
    launcher (torchrun); None lets the dispatcher number it."""
    KIND = "hello"
    role: str = spec(fields.one_of, ROLES)
    version: int = spec(fields.integer, 0, 1 << 16)
    pid: int = spec(fields.integer, 0, (1 << 31) - 1)
    name: str = spec(fields.text, 256)
    host: str = spec(fields.text, 256)
    device: str = spec(fields.text, 64)
    rank: int | None = spec(fields.optional, fields.integer, *RANK)


@dataclass(slots=True)
class Challenge:
    """dispatcher -> peer (with a token): prove you know it; answer HMAC(token, nonce || role)."""
    KIND = "challenge"
    nonce: bytes = spec(fields.raw, 32)


@dataclass(slots=True)
class Auth:
    """peer -> dispatcher: the answer to the challenge (hex HMAC-SHA256)."""
    KIND = "auth"
    mac: str = spec(fields.text, 64)


@dataclass(slots=True)
class Refused:
    """dispatcher -> peer: not admitted, or no longer (a dropped client); the reason says why."""
    KIND = "refused"
    reason: str = spec(fields.text, fields.MAX_TEXT)


@dataclass(slots=True)
class Waiting:
    """dispatcher -> worker: admitted; the world forms when all `need` workers are here."""
    KIND = "waiting"
    have: int = spec(fields.integer, 0, MAX_WORKERS)
    need: int = spec(fields.integer, 1, MAX_WORKERS)


@dataclass(slots=True)
class ClientWelcome:
    """dispatcher -> client: admitted as client number `client`, homed on worker `home`.
    `secret` is what its heartbeat connection proves itself with."""
    KIND = "client_welcome"
    client: int = spec(fields.integer, *SLOT)
    secret: bytes = spec(fields.raw, 16)
    workers: int = spec(fields.integer, 1, MAX_WORKERS)
    home: int = spec(fields.integer, *RANK)
    log: bool = spec(fields.flag)
    max_message_mb: int = spec(fields.integer, 1, 1 << 20)
    devices: list = spec(fields.texts, MAX_WORKERS, 64)


@dataclass(slots=True)
class WorkerWelcome:
    """dispatcher -> worker: your rank in a world of `size`; meet the others at the store on
    the dispatcher's host and `store_port` (None: a launcher formed the world already)."""
    KIND = "worker_welcome"
    rank: int = spec(fields.integer, *RANK)
    size: int = spec(fields.integer, 1, MAX_WORKERS)
    store_port: int | None = spec(fields.optional, fields.integer, 1, 65535)
    max_message_mb: int = spec(fields.integer, 1, 1 << 20)  # the largest reply the dispatcher takes


@dataclass(slots=True)
class MonitorWelcome:
    """dispatcher -> monitor: admitted; may ask for statistics."""
    KIND = "monitor_welcome"
    workers: int = spec(fields.integer, 1, MAX_WORKERS)


# ---- client and dispatcher ---------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """client -> dispatcher: instructions to route to the workers. With `sync` (a token), the
    dispatcher answers with Synced once they have all run, carrying the tensors in `fetch`.
    `frames`: the bytes of the uploads, which name their frame by index."""
    KIND = "run"
    instructions: list = spec(_instructions, True)
    sync: int | None = spec(fields.optional, fields.integer, 0)
    fetch: list = spec(fields.integers, MAX_FETCH, *HANDLE)
    frames: list = frames_field()

    def check_frames(self) -> None:
        _check_upload_frames(self.instructions, self.frames, "instructions")


@dataclass(slots=True)
class SyncAnswer:
    """What answers a sync, a worker's to the dispatcher (Collected) and the dispatcher's to a
    client (Synced): everything up to the sync `token` has run. `errors`: what failed since the
    last sync (by seq); `fetched`: the tensors asked for, their bytes in `frames` (a keyword, so
    that each answer's own fields follow these)."""
    token: int = spec(fields.integer, 0)
    errors: list = spec(error_reports)
    fetched: list = spec(fetched_list)
    frames: list = frames_field(kw_only=True)

    def check_frames(self) -> None:
        _check_fetched_frames(self.fetched, self.frames)


@dataclass(slots=True)
class Synced(SyncAnswer):
    """dispatcher -> client: the answer to a Run's sync, with each worker's running times."""
    KIND = "synced"
    stats: list = spec(worker_times)


@dataclass(slots=True)
class Configure:
    """client -> dispatcher: its signal configuration (GT's YAML schema, as a map)."""
    KIND = "configure"
    signals: dict = spec(_config)


@dataclass(slots=True)
class Configured:
    """dispatcher -> client: the configuration is in use; these are its signals."""
    KIND = "configured"
    signals: list = spec(fields.texts, 4096, 256)


@dataclass(slots=True)
class Error:
    """dispatcher -> peer: a message it could not take (the text names the field), or a
    configuration it refused (one problem per line)."""
    KIND = "error"
    message: str = spec(fields.text, fields.MAX_TEXT)


@dataclass(slots=True)
class Bye:
    """client -> dispatcher: leaving; free my tensors."""
    KIND = "bye"


@dataclass(slots=True)
class Alive:
    """a client's heartbeat connection -> dispatcher: the client is alive (it may be busy
    computing and not sending anything on its main connection)."""
    KIND = "alive"
    secret: bytes = spec(fields.raw, 16)


@dataclass(slots=True)
class WorkerStatsRequest:
    """client -> dispatcher: each worker's statistics (`gt.debug.get_worker_stats`)."""
    KIND = "worker_stats_request"


@dataclass(slots=True)
class WorkerStats:
    """dispatcher -> client: each worker, as of a heartbeat it sent after the request came."""
    KIND = "worker_stats"
    workers: list = spec(worker_reports)


# ---- monitor and dispatcher -------------------------------------------------------------------

@dataclass(slots=True)
class StatsRequest:
    """monitor -> dispatcher: what `paratrain top` shows."""
    KIND = "stats_request"


@dataclass(slots=True)
class Stats:
    """dispatcher -> monitor: its workers and clients now."""
    KIND = "stats"
    address: str = spec(fields.text, 300)
    uptime_s: float = spec(fields.number)
    workers: list = spec(lambda v, n: records(
        WorkerRow, v, n, MAX_WORKERS, lambda x, m: fields.integer(x, m, *RANK), fields.text, fields.integer, fields.text,
        fields.flag, fields.integer, fields.integer, fields.integer, fields.number, fields.number))
    clients: list = spec(lambda v, n: records(
        ClientRow, v, n, 1 << 16, fields.integer, fields.text, fields.integer, fields.integer, fields.integer))


@dataclass(slots=True)
class TraceRequest:
    """monitor -> dispatcher: the instruction log's lines from number `first` on (0: from the
    next one written), and go on keeping them for `keep_s` more seconds (the dispatcher logs
    only while asked, unless it writes a log file anyway)."""
    KIND = "trace_request"
    first: int = spec(fields.integer, 0)
    keep_s: float = spec(_keep_seconds)


@dataclass(slots=True)
class TraceEvents:
    """dispatcher -> monitor: log lines `first`, `first + 1`, ...; `missed`: lines asked for that
    had already left the dispatcher's buffer."""
    KIND = "trace_events"
    first: int = spec(fields.integer, 0)
    lines: list = spec(fields.texts, MAX_TRACE_LINES, MAX_TRACE_LINE)
    missed: int = spec(fields.integer, 0)


# ---- dispatcher and worker ---------------------------------------------------------------------

@dataclass(slots=True)
class Tasks:
    """dispatcher -> worker: instructions of client `slot`, to run in order; `frames`: the
    bytes of its uploads. `timed`: report when each ran (Timings), for the instruction log.
    With `sync` (a token), a Collect of `fetch` follows them at once, in the same message: the
    answer goes out as soon as the batch has run, with no second message to wait for."""
    KIND = "tasks"
    slot: int = spec(fields.integer, *SLOT)
    instructions: list = spec(_instructions, False)
    timed: bool = spec(fields.flag)
    sync: int | None = spec(fields.optional, fields.integer, 0)
    fetch: list = spec(fields.integers, MAX_FETCH, *HANDLE)
    frames: list = frames_field()

    def check_frames(self) -> None:
        _check_upload_frames(self.instructions, self.frames, "instructions")


@dataclass(slots=True)
class Collect:
    """dispatcher -> worker: once everything before this has run, report client `slot`'s errors
    and the values of the handles in `fetch` (Collected, with `token`)."""
    KIND = "collect"
    slot: int = spec(fields.integer, *SLOT)
    token: int = spec(fields.integer, 0)
    fetch: list = spec(fields.integers, MAX_FETCH, *HANDLE)


@dataclass(slots=True)
class Collected(SyncAnswer):
    """worker -> dispatcher: the answer to Collect for client `slot`. `busy_s`, `wait_s` and
    `compiled` are the worker's running totals (for the client's stats)."""
    KIND = "collected"
    slot: int = spec(fields.integer, *SLOT)
    busy_s: float = spec(fields.number)
    wait_s: float = spec(fields.number)
    compiled: list = spec(compile_counts)


@dataclass(slots=True)
class Forget:
    """dispatcher -> worker: client `slot` has left; free everything it held."""
    KIND = "forget"
    slot: int = spec(fields.integer, *SLOT)


@dataclass(slots=True)
class Ping:
    """dispatcher -> worker: I am here (a worker that hears nothing for a while exits)."""
    KIND = "ping"


@dataclass(slots=True)
class Exit:
    """dispatcher -> worker: stop serving."""
    KIND = "exit"
    reason: str = spec(fields.text, fields.MAX_TEXT)


@dataclass(slots=True)
class Heartbeat:
    """worker -> dispatcher, twice a second: alive, and its running totals for `paratrain top`
    and `gt.debug.get_worker_stats` (`by_op`: instructions run, per operation)."""
    KIND = "heartbeat"
    ops: int = spec(fields.integer, 0)
    busy_s: float = spec(fields.number)
    queue: int = spec(fields.integer, 0)
    memory: int = spec(fields.integer, 0)
    by_op: dict = spec(op_counts)


@dataclass(slots=True)
class Leaving:
    """worker -> dispatcher: this worker can serve no more (its executor thread ended); the
    dispatcher loses it now rather than after its heartbeats stop."""
    KIND = "leaving"
    reason: str = spec(fields.text, fields.MAX_TEXT)


@dataclass(slots=True)
class Timings:
    """worker -> dispatcher: when each instruction of a timed Tasks ran."""
    KIND = "timings"
    timings: list = spec(lambda v, n: records(
        Timing, v, n, MAX_BATCH, lambda x, m: fields.integer(x, m, 0), fields.number, fields.number))


# Who accepts what: the decoder of each receiver knows only the messages sent to it.
TO_DISPATCHER = (Hello, Auth, Run, Configure, Bye, Alive, WorkerStatsRequest, StatsRequest, TraceRequest, Heartbeat,
                 Collected, Timings, Leaving)
TO_CLIENT = (Challenge, Refused, ClientWelcome, Synced, Configured, WorkerStats, Error)
TO_WORKER = (Challenge, Refused, Waiting, WorkerWelcome, Tasks, Collect, Forget, Ping, Exit, Error)
TO_MONITOR = (Challenge, Refused, MonitorWelcome, Stats, TraceEvents, Error)
