"""The instruction log (`--instruction-log`, PARATRAIN_INSTRUCTION_LOG / GT_INSTRUCTION_LOG) and
its live tap (`paratrain frontend trace --live`).

One line per event, in GT's columns, so that GT's recipes (`grep WORKER_SEND`, its timeline
script's pattern) read it:

    elapsed | #seq | event | source | command | size | details

    elapsed  seconds since the dispatcher started; an OP's is when it started on its worker
             (the worker's clock: the same clock on one machine)
    seq      the line's number in this log, from 1
    event    RECV / SEND: a message from / to a client; WORKER_SEND / WORKER_RECV: to / from a
             worker; CONNECT / DISCONNECT: a client joins / leaves; OP: an instruction ran
    source   CLIENT <n> or WORKER <rank>
    command  the message's kind; for an OP its operation, then (sharded work) the signal and
             the pattern, or the collective's group
    size     bytes (`1024B`): the message's frames; for an OP its results (a `send`: the tensor
             it moves)
    details  key=value pairs: the message's counts; for an OP op=, client=, instr= (the
             client's number for it), in= and out= (`h12:float32[4,8]`; `t7` is a tensor
             crossing between workers), dur_ms=

An OP line is written when its worker reports when it ran, after the messages that made it:
the file is in `seq` order, not in `elapsed` order.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from itertools import count

from paratrain.frontend.ops import ITEM_SIZES
from paratrain.frontend.protocol import messages

HEADER = ("# paratrain frontend instruction log; GT's columns:\n"
          "# elapsed | #seq | event | source | command | size | details\n")
TAP_LINES = 1 << 16  # lines a live capture may fall behind by before it misses some
# The messages of the instruction stream (heartbeats, pings and statistics are not).
LOGGED = (messages.Run, messages.Configure, messages.Bye, messages.Synced, messages.Configured, messages.Error,
          messages.Refused, messages.WorkerStatsRequest, messages.WorkerStats, messages.Tasks, messages.Collect,
          messages.Forget, messages.Collected, messages.Timings, messages.Exit)


class InstructionLog:
    """Writes to a file, to the tap a live capture reads, or both. `started`: the dispatcher's
    start (seconds since the epoch), from which `elapsed` counts."""

    def __init__(self, path: str | None, started: float):
        self.file = open(path, "w", buffering=1) if path else None
        if self.file is not None:
            self.file.write(HEADER)
        self.started = started
        self.pending: dict[int, tuple] = {}  # log id -> what to write when the worker reports
        self.ids = count()
        self.written = 0  # lines so far: the last line's seq
        self.tap: deque | None = None  # the newest lines, while a live capture asks for them
        self.tap_until = 0.0  # (monotonic) when to stop keeping them

    # ---- events ------------------------------------------------------------------------------

    def message(self, event: str, source: str, message, size: int, now: float) -> None:
        """A message to or from a peer, `size` bytes in all; `now`: seconds since the epoch."""
        self._write(now - self.started, event, source, message.KIND, size, _counts(message))

    def received(self, role: str, name: str, message, size: int, now: float) -> None:
        """A message from a client or a worker, if it is one of the stream's (LOGGED)."""
        if isinstance(message, LOGGED):
            self.message("RECV" if role == "client" else "WORKER_RECV", f"{role.upper()} {name}", message, size, now)

    def sent(self, role: str, name: str, message, frames: list, now: float) -> None:
        """A message to a client or a worker, if it is one of the stream's or a client's welcome."""
        if not isinstance(message, (*LOGGED, messages.ClientWelcome)):
            return
        event = ("CONNECT" if isinstance(message, messages.ClientWelcome) else
                 "SEND" if role == "client" else "WORKER_SEND")
        size = sum(frame.nbytes if isinstance(frame, memoryview) else len(frame) for frame in frames)
        self.message(event, f"{role.upper()} {name}", message, size, now)

    def event(self, event: str, source: str, command: str, size: int, details: str, now: float) -> None:
        self._write(now - self.started, event, source, command, size, details)

    def describe(self, worker: int, instruction, table, note: str = "") -> int:
        """Remember what `instruction` is until its worker says when it ran; -> its log id.
        `note` says, for sharded work, the signal and the pattern (the collective it caused)."""
        name, outs, args, kwargs = instruction.op, instruction.outs, instruction.args, instruction.kwargs
        known = table.meta if table is not None else {}
        inputs = [args[i] for i in instruction.targs]
        details = [f"op={name}", f"client={table.slot if table is not None else '-'}", f"instr={instruction.seq}"]
        size = sum(_bytes(known.get(h)) for h in outs)
        if name in ("send", "bw_send"):
            targets = [kwargs["to"]] if name == "send" else [to for to, _ in kwargs["to"]]
            details.append(f"crossing=t{kwargs['crossing']} to={','.join(map(str, targets))}")
            size = sum(_bytes(known.get(h)) for h in inputs)
        elif name in ("recv", "bw_recv"):
            details.append(f"crossing=t{kwargs['crossing']} from={kwargs['src']}")
        if name in ("free", "release"):
            details.append("in=" + ",".join(("t" if name == "release" else "h") + str(h) for h in args))
        elif inputs:
            details.append("in=" + ",".join(_handle(h, known) for h in inputs))
        if outs:
            details.append("out=" + ",".join(_handle(h, known) for h in outs))
        if "g" in kwargs:
            note = f"{note} group {kwargs['g']}".strip()
        log_id = next(self.ids)
        self.pending[log_id] = (f"WORKER {worker}", f"{name} {note}" if note else name, size, " ".join(details))
        return log_id

    def complete(self, timings: list) -> None:
        """A worker's report of when its instructions ran: their OP lines."""
        for timing in timings:
            described = self.pending.pop(timing.log, None)
            if described is not None:
                source, command, size, details = described
                self._write(timing.started - self.started, "OP", source, command, size,
                            f"{details} dur_ms={timing.seconds * 1e3:.3f}")

    # ---- the live tap ------------------------------------------------------------------------

    def listen(self, keep_s: float, now: float) -> None:
        """Keep the newest lines for a live capture until `keep_s` seconds from `now` (monotonic)."""
        if self.tap is None:
            self.tap = deque(maxlen=TAP_LINES)
        self.tap_until = max(self.tap_until, now + keep_s)

    def lines_from(self, first: int) -> messages.TraceEvents:
        """Lines numbered `first` on (0: from the next one written), at most a message's worth."""
        kept = self.tap or ()
        oldest = self.written - len(kept) + 1
        if first == 0:
            return messages.TraceEvents(self.written + 1, [], 0)
        start = max(first, oldest)
        lines = [kept[i] for i in range(start - oldest, min(len(kept), start - oldest + messages.MAX_TRACE_LINES))]
        return messages.TraceEvents(start, lines, start - first)

    def tap_expired(self, now: float) -> bool:
        """Stop keeping lines once no capture has asked for them for a while; -> whether the log
        is now of no use (no file, no capture)."""
        if self.tap is not None and now > self.tap_until:
            self.tap = None
        return self.tap is None and self.file is None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def _write(self, elapsed: float, event: str, source: str, command: str, size: int, details: str) -> None:
        self.written += 1
        line = (f"{elapsed:11.6f}s | #{self.written:04d} | {event:<11} | {source:<9} | {command:<15} | "
                f"{size:>9}B | {details}")
        if self.file is not None:
            self.file.write(line + "\n")
        if self.tap is not None:
            self.tap.append(line[:messages.MAX_TRACE_LINE])


def _counts(message) -> str:
    """A message's numbers, flags and list lengths (its contents are the OP lines' business)."""
    parts = []
    for field in dataclasses.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, float):
            parts.append(f"{field.name}={value:.6g}")
        elif isinstance(value, (bool, int)):
            parts.append(f"{field.name}={value}")
        elif isinstance(value, (list, dict)):
            parts.append(f"{field.name}={len(value)}")
    return " ".join(parts)


def _bytes(meta) -> int:
    if meta is None:
        return 0
    shape, dtype = meta
    elements = 1
    for size in shape:
        elements *= size
    return elements * ITEM_SIZES.get(dtype, 0)


def _handle(handle, known) -> str:
    meta = known.get(handle)
    return f"h{handle}:{meta[1]}[{','.join(map(str, meta[0]))}]" if meta else f"h{handle}"
