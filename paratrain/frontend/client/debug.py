"""`gt.debug`: what the program has issued (the tape) and what each worker has run.

Both return plain dicts and lists with GT's keys, which GT programs index into:

    get_tape()          [{'output_id', 'output_shape', 'input_ids', 'grad_fn', 'requires_grad', ...}]
    get_worker_stats()  {'worker_0': {'operations': {'total', ...}, ...}, ...}, or {'error': ...}
                        when the program has no session

GT's tape is its autograd tape; here autograd runs on the workers, so the tape is the client's
instruction stream (tape.py), and `grad_fn` names the operation that made the output. Neither
function starts a session: asking what ran does not start a server.
"""

from __future__ import annotations

from paratrain.frontend.client.defaults import DEFAULTS
from paratrain.frontend.client.session import Session


def _current(session: Session | None) -> Session | None:
    session = session if session is not None else DEFAULTS.session
    return session if session is not None and not session.closed else None


def get_tape(session: Session | None = None) -> list[dict]:
    """The instructions issued so far (the newest 10,000), oldest first."""
    session = _current(session)
    if session is None:
        return []
    tape = []
    for entry in session.tape.entries():
        first = entry.outputs[0] if entry.outputs else None
        tape.append({
            "output_id": first.handle if first else None,
            "output_shape": first.shape if first else None,
            "input_ids": list(entry.inputs),
            "grad_fn": entry.op,
            "requires_grad": any(out.requires_grad for out in entry.outputs),
            "seq": entry.seq,
            "op": entry.op,
            "output_ids": [out.handle for out in entry.outputs],
            "output_shapes": [out.shape for out in entry.outputs],
            "dtype": first.dtype if first else None,
            "worker": entry.worker,
        })
    return tape


def print_tape(session: Session | None = None) -> None:
    tape = get_tape(session)
    if not tape:
        print("Tape: empty (nothing issued yet)")
        return
    print(f"Tape: {len(tape)} instruction(s)")
    for entry in tape:
        outputs = ", ".join(f"Tensor[{h}]" for h in entry["output_ids"]) or "-"
        inputs = ", ".join(f"Tensor[{h}]" for h in entry["input_ids"])
        shape = f"  shape={entry['output_shape']}" if entry["output_shape"] is not None else ""
        where = f"  worker={entry['worker']}" if entry["worker"] is not None else ""
        grad = "  requires_grad" if entry["requires_grad"] else ""
        print(f"#{entry['seq']:<5} {outputs} = {entry['op']}({inputs}){shape}{grad}{where}")


def get_worker_stats(session: Session | None = None) -> dict:
    """Per worker (keyed `worker_<rank>`): what it has run, for all clients, counting everything
    this program issued before the call (it waits for it to run)."""
    session = _current(session)
    if session is None:
        return {"error": "not connected to a dispatcher (no operation has run yet)"}
    stats = {}
    for report in session.worker_reports():
        stats[f"worker_{report.rank}"] = {
            "rank": report.rank, "host": report.host, "pid": report.pid, "device": report.device,
            "alive": report.alive,
            # Every instruction runs eagerly: nothing is compiled here (GT's 'compiled' stays 0).
            "operations": {"total": report.ops, "compiled": 0, "eager": report.ops, "by_op": dict(report.by_op)},
            "busy_s": report.busy_s, "queue": report.queue, "memory_bytes": report.memory,
        }
    return stats


def print_worker_stats(session: Session | None = None) -> None:
    stats = get_worker_stats(session)
    if "error" in stats:
        print(f"Error: {stats['error']}")
        return
    print(f"Worker statistics ({len(stats)} worker(s)):")
    for name, worker in stats.items():
        operations = worker["operations"]
        common = sorted(operations["by_op"].items(), key=lambda item: (-item[1], item[0]))
        mix = ", ".join(f"{count} {op}" for op, count in common[:5]) + (", ..." if len(common) > 5 else "")
        state = "alive" if worker["alive"] else "LOST"
        print(f"  {name}: {operations['total']} instructions ({mix or 'none'}); {state} on {worker['device']} "
              f"({worker['host']} pid {worker['pid']}); busy {worker['busy_s']:.3f}s, queue {worker['queue']}, "
              f"memory {worker['memory_bytes'] / 2**20:.1f} MiB")
