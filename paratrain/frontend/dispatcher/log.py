"""The instruction log (`PARATRAIN_INSTRUCTION_LOG` / `GT_INSTRUCTION_LOG`).

The dispatcher describes each instruction when it routes it and writes the line when the
worker reports when it ran, so every line is complete:

    start_s | client | op | inputs | outputs | worker | duration_ms

`start_s` is the worker's clock (seconds since the epoch). Handles are written `h12:float32[4, 8]`;
`t7` names a crossing (a tensor moved between workers, and later its gradient).
"""

from __future__ import annotations

from itertools import count

HEADER = "# start_s | client | op | inputs | outputs | worker | duration_ms\n"


class InstructionLog:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", buffering=1)
        self.file.write(HEADER)
        self.pending: dict[int, str] = {}
        self.ids = count()

    def describe(self, worker: int, instruction, table, note: str = "") -> int:
        """Remember what `instruction` is until its worker says when it ran; -> its log id.
        `note` says, for sharded work, the signal and the pattern (the collective it caused)."""
        name, outs, args, targs, kwargs = (instruction.op, instruction.outs, instruction.args, instruction.targs,
                                           instruction.kwargs)
        slot = table.slot if table is not None else "-"
        known = table.meta if table is not None else {}
        inputs = [_handle(args[i], known) for i in targs]
        outputs = [_handle(h, known) for h in outs]
        if name in ("send", "bw_send"):
            targets = kwargs["to"] if name == "send" else [to for to, _ in kwargs["to"]]
            outputs.append(f"t{kwargs['crossing']} -> worker {targets}")
        elif name in ("recv", "bw_recv"):
            inputs.append(f"t{kwargs['crossing']} <- worker {kwargs['src']}")
        elif name in ("free", "release"):
            inputs = [("t" if name == "release" else "h") + str(h) for h in args]
        if "g" in kwargs:
            note = f"{note} group {kwargs['g']}".strip()
        op = f"{name} {note}" if note else name
        log_id = next(self.ids)
        self.pending[log_id] = f"client {slot} | {op} | {' '.join(inputs)} | {' '.join(outputs)} | worker {worker}"
        return log_id

    def complete(self, timings: list) -> None:
        for timing in timings:
            text = self.pending.pop(timing.log, None)
            if text is not None:
                self.file.write(f"{timing.started:.6f} | {text} | {timing.seconds * 1e3:.3f}\n")

    def close(self) -> None:
        self.file.close()


def _handle(handle, known) -> str:
    meta = known.get(handle)
    return f"h{handle}:{meta[1]}{list(meta[0])}" if meta else f"h{handle}"
