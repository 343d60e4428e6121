"""`paratrain frontend trace`: the instruction log (see dispatcher/log.py) as a Chrome trace."""

from __future__ import annotations

import json


def chrome_trace(log_path: str) -> dict:
    """The instruction log as a Chrome trace (open it in Perfetto or chrome://tracing): one
    track per worker, one slice per instruction, named by its operation and client."""
    events, first = [], None
    with open(log_path) as lines:
        for line in lines:
            if line.startswith("#") or not line.strip():
                continue
            parts = [part.strip() for part in line.rstrip("\n").split(" | ")]
            if len(parts) != 7:
                continue
            started, client, op, inputs, outputs, worker, duration = parts
            start_us = float(started) * 1e6
            first = start_us if first is None else min(first, start_us)
            events.append({
                "name": op.split(" ")[0], "cat": client, "ph": "X", "ts": start_us, "dur": float(duration) * 1e3,
                "pid": 0, "tid": int(worker.split()[-1]),
                "args": {"client": client, "op": op, "inputs": inputs, "outputs": outputs},
            })
    for event in events:
        event["ts"] -= first or 0.0
    workers = sorted({event["tid"] for event in events})
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}}
             for w in workers]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def write_chrome_trace(log_path: str, out_path: str) -> int:
    trace = chrome_trace(log_path)
    with open(out_path, "w") as out:
        json.dump(trace, out)
    return sum(1 for event in trace["traceEvents"] if event["ph"] == "X")
