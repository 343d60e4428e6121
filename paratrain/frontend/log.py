"""The instruction log (`PARATRAIN_INSTRUCTION_LOG` / `GT_INSTRUCTION_LOG`) and its Chrome trace.

The dispatcher describes each instruction when it routes it and writes the line when the
worker reports when it ran, so every line is complete:

    start_s | client | op | inputs | outputs | worker | duration_ms

`start_s` is the worker's clock (seconds since the epoch). Handles are written `h12:float32[4, 8]`;
`t7` names a crossing (a tensor moved between workers, and later its gradient).
"""

from __future__ import annotations

import json
from itertools import count

HEADER = "# start_s | client | op | inputs | outputs | worker | duration_ms\n"


class InstructionLog:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", buffering=1)
        self.file.write(HEADER)
        self.pending: dict[int, str] = {}
        self.ids = count()

    def describe(self, worker: int, instr: list, table, note: str = "") -> int:
        """Remember what `instr` is until its worker says when it ran; -> its log id. `note`
        says, for sharded work, the signal and the pattern (the collective it caused)."""
        seq, name, outs, args, targs, kwargs, flags = instr
        slot = table.slot if table is not None else "-"
        known = table.meta if table is not None else {}
        inputs = [_handle(args[i], known) for i in targs]
        outputs = [_handle(h, known) for h in outs]
        if name in ("send", "bw_send"):
            targets = kwargs["to"] if name == "send" else [to for to, _ in kwargs["to"]]
            outputs.append(f"t{kwargs['t']} -> worker {targets}")
        elif name in ("recv", "bw_recv"):
            inputs.append(f"t{kwargs['t']} <- worker {kwargs['src']}")
        elif name in ("free", "release"):
            inputs = [("t" if name == "release" else "h") + str(h) for h in args]
        if "g" in kwargs:
            note = f"{note} group {kwargs['g']}".strip()
        op = f"{name} {note}" if note else name
        log_id = next(self.ids)
        self.pending[log_id] = f"client {slot} | {op} | {' '.join(inputs)} | {' '.join(outputs)} | worker {worker}"
        return log_id

    def complete(self, timings: list) -> None:
        for log_id, started, duration in timings:
            text = self.pending.pop(log_id, None)
            if text is not None:
                self.file.write(f"{started:.6f} | {text} | {duration * 1e3:.3f}\n")

    def close(self) -> None:
        self.file.close()


def _handle(handle, known) -> str:
    meta = known.get(handle)
    return f"h{handle}:{meta[1]}{list(meta[0])}" if meta else f"h{handle}"


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
