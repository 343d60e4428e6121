"""`paratrain frontend trace`: the instruction log (its format is in dispatcher/log.py) read back
as events, and written as a Chrome trace: one track per worker with a slice per instruction,
and the dispatcher's messages as instants on a track of their own."""

from __future__ import annotations

import json
from typing import NamedTuple


class Event(NamedTuple):
    elapsed: float  # seconds since the dispatcher started
    seq: int
    event: str  # OP, RECV, SEND, WORKER_SEND, WORKER_RECV, CONNECT, DISCONNECT
    source: str  # CLIENT <n> or WORKER <rank>
    command: str
    size: int  # bytes
    details: dict  # key -> value (text)

    @property
    def worker(self) -> int | None:
        kind, _, number = self.source.partition(" ")
        return int(number) if kind == "WORKER" and number.isdigit() else None

    @property
    def op(self) -> str:
        return self.command.split(" ", 1)[0]


def parse_line(line: str) -> Event | None:
    """One line of the log as an Event; None for comments and for what is not a log line."""
    if line.startswith("#") or not line.strip():
        return None
    parts = [part.strip() for part in line.rstrip("\n").split(" | ", 6)]
    if len(parts) != 7 or not parts[0].endswith("s") or not parts[1].startswith("#") or not parts[5].endswith("B"):
        return None
    try:
        elapsed, seq, size = float(parts[0][:-1]), int(parts[1][1:]), int(parts[5][:-1])
    except ValueError:
        return None
    details = dict(item.split("=", 1) for item in parts[6].split() if "=" in item)
    return Event(elapsed, seq, parts[2], parts[3], parts[4], size, details)


def read_events(lines) -> list[Event]:
    return [event for event in map(parse_line, lines) if event is not None]


def read_log(path: str) -> list[Event]:
    with open(path) as lines:
        return read_events(lines)


DISPATCHER_PID = 1  # the Chrome trace's "process" for the dispatcher's messages; workers are pid 0


def chrome_trace(events: list[Event]) -> dict:
    """The events as a Chrome trace (open it in Perfetto or chrome://tracing)."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    first = min(event.elapsed for event in events)
    slices, instants = [], []
    for event in events:
        ts = (event.elapsed - first) * 1e6
        if event.event == "OP" and event.worker is not None:
            slices.append({"name": event.op, "cat": f"client {event.details.get('client', '-')}", "ph": "X", "ts": ts,
                           "dur": float(event.details.get("dur_ms", 0.0)) * 1e3, "pid": 0, "tid": event.worker,
                           "args": {"command": event.command, "bytes": event.size, **event.details}})
        elif event.event != "OP":
            instants.append({"name": f"{event.event} {event.command}", "ph": "i", "s": "t", "ts": ts,
                             "pid": DISPATCHER_PID, "tid": 0,
                             "args": {"source": event.source, "bytes": event.size, "seq": event.seq, **event.details}})
    workers = sorted({s["tid"] for s in slices})
    names = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "workers"}},
             {"name": "process_name", "ph": "M", "pid": DISPATCHER_PID, "args": {"name": "dispatcher"}}]
    names += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}} for w in workers]
    return {"traceEvents": names + slices + instants, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[Event], out_path: str) -> int:
    """-> how many instructions (slices) it holds."""
    trace = chrome_trace(events)
    with open(out_path, "w") as out:
        json.dump(trace, out)
    return sum(1 for event in trace["traceEvents"] if event["ph"] == "X")
