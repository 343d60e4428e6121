"""How a processes run that failed is reported: every rank that failed, root cause first.

The elastic agent tells us about the rank it saw fail first: its exit code or signal, and the
traceback that @record wrote for it. A rank that died by a signal wrote nothing. A rank that
failed only because a peer died (PeerLostError) is a consequence, so it goes after the rank
that died; the agent usually stops such ranks before it hears of them, so we find their errors
in the flight records they dumped.
"""

from __future__ import annotations

import os

from paratrain.comm.flight import read_dumps, run_directory

_CONSEQUENCES = ("PeerLostError:", "FabricAborted:")  # errors caused by another rank's failure


def describe_failed_run(failures: dict, nproc: int, run_id: str, trace_dir: str | None = None) -> str:
    """One line per failed rank, root cause first, each followed by its traceback if it has
    one; then where the flight records are (`trace_dir`, the settings', else the run's folder).
    `failures` maps global ranks to torch's ProcessFailure."""
    reports = [_from_process(rank, failure) for rank, failure in failures.items()]
    directory = run_directory(run_id, trace_dir)
    dumps = _dumps_of_run(directory, run_id)
    reported = {report["rank"] for report in reports}
    reports += [
        {"rank": rank, "how": None, "error": dump["error"], "traceback": None, "time": dump["dumped_at"]}
        for rank, dump in sorted(dumps.items()) if rank not in reported and dump.get("error")
    ]
    reports.sort(key=lambda r: (_is_consequence(r["error"]), r["time"], r["rank"]))
    lines = []
    for index, report in enumerate(reports):
        heading = f"rank {report['rank']} of {nproc} failed"
        heading += " (launcher=processes)" if index == 0 else " after it"
        lines.append(f"{heading}: {_what_happened(report)}")
        if report["traceback"]:
            lines += ["  " + line for line in report["traceback"].rstrip().splitlines()]
    if dumps:
        lines.append(f"flight records: {directory} (read them with: paratrain debug hang {directory})")
    return "\n".join(lines)


def _from_process(rank: int, failure) -> dict:
    message = failure.message
    error = traceback = None
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        error = message.get("message")
        traceback = message.get("extraInfo", {}).get("py_callstack")
    elif os.path.isfile(failure.error_file):  # an error file holding the text alone
        error = message
    if failure.exitcode < 0:
        how = f"killed by {failure.signal_name()}"
    else:
        how = f"exit code {failure.exitcode}"
    return {"rank": rank, "how": how, "error": error, "traceback": traceback, "time": failure.timestamp}


def _what_happened(report: dict) -> str:
    how, error = report["how"], report["error"]
    if how is None:  # known only from its flight record: the agent stopped it first
        return f"{error} (from its flight record; the launcher stopped it)"
    if error:
        return f"{error} [{how}]"
    if how.startswith("killed"):
        return f"{how}; no traceback (the process was killed)"
    return f"{how}; no traceback (it exited without raising: os._exit, or a crash in native code)"


def _is_consequence(error: str | None) -> bool:
    return bool(error) and error.startswith(_CONSEQUENCES)


def _dumps_of_run(directory: str | None, run_id: str) -> dict[int, dict]:
    if not directory or not os.path.isdir(directory):
        return {}
    return {rank: dump for rank, dump in read_dumps(directory).items() if dump.get("run_id") == run_id}
