"""How a processes run that failed is reported: every rank that failed, root cause first.

The elastic agent tells us about the rank it saw fail first: its exit code or signal, and the
traceback that @record wrote for it. A rank that died by a signal wrote nothing. A rank that
failed only because a peer died (PeerLostError) is a consequence, so it goes after the rank
that died; the agent usually stops such ranks before it hears of them, so we find their errors
in the flight records they dumped.

Whose fault the root cause is decides how much is shown: a rank that was killed (by someone,
or the kernel's out-of-memory killer) or lost, or that raised a user's error (a bad
checkpoint, a path it cannot write), fails the run as a RanksFailed, which the command prints
in a line or two; any other error is a bug, and its report keeps every traceback.
"""

from __future__ import annotations

import os
import signal

from paratrain.comm.flight import read_dumps, run_directory
from paratrain.errors import UserError

_CONSEQUENCES = ("PeerLostError:", "FabricAborted:")  # errors caused by another rank's failure
_LOST = ("PeerLostError", "CommTimeoutError")  # a rank lost, a rank that did not answer
# Signals someone sends to stop a process (the out-of-memory killer sends SIGKILL); a SIGSEGV
# or SIGABRT is a crash, which is a bug.
_STOPPED_BY = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


class RanksFailed(UserError, RuntimeError):
    """Ranks of a processes run failed for a reason the user can act on. str(): the whole
    report; lines(): the root cause and where the flight records are."""

    def __init__(self, report: str, summary: list[str]):
        super().__init__(report)
        self.summary = summary

    def lines(self) -> list[str]:
        return self.summary


class RunStopped(UserError, RuntimeError):
    """The launcher was sent a signal (Ctrl-C, kill): the agent stopped the ranks and itself."""

    def __init__(self, signum: int):
        super().__init__(f"the run was stopped by {signal.Signals(signum).name}; its ranks were stopped with it "
                         "(launcher=processes)")
        self.exit_code = 128 + signum  # as a shell reports a process a signal ended


def failed_run_error(failures: dict, nproc: int, run_id: str, trace_dir: str | None = None) -> RuntimeError:
    """The error a processes run that failed raises: a RanksFailed, or, when the root cause is
    a bug, a RuntimeError with the whole report."""
    reports, directory, dumps = _reports(failures, run_id, trace_dir)
    report = _describe(reports, nproc, directory, dumps)
    if not _users_fault(reports[0]):
        return RuntimeError(report)
    summary = [report.splitlines()[0]]
    if dumps:
        summary.append(_where_records_are(directory))
    return RanksFailed(report, summary)


def describe_failed_run(failures: dict, nproc: int, run_id: str, trace_dir: str | None = None) -> str:
    """One line per failed rank, root cause first, each followed by its traceback if it has
    one; then where the flight records are (`trace_dir`, the settings', else the run's folder).
    `failures` maps global ranks to torch's ProcessFailure."""
    reports, directory, dumps = _reports(failures, run_id, trace_dir)
    return _describe(reports, nproc, directory, dumps)


def _reports(failures: dict, run_id: str, trace_dir: str | None) -> tuple[list[dict], str | None, dict[int, dict]]:
    reports = [_from_process(rank, failure) for rank, failure in failures.items()]
    directory = run_directory(run_id, trace_dir)
    dumps = _dumps_of_run(directory, run_id)
    reported = {report["rank"] for report in reports}
    reports += [
        {"rank": rank, "how": None, "signal": None, "error": dump["error"], "traceback": None,
         "time": dump["dumped_at"]}
        for rank, dump in sorted(dumps.items()) if rank not in reported and dump.get("error")
    ]
    reports.sort(key=lambda r: (_is_consequence(r["error"]), r["time"], r["rank"]))
    return reports, directory, dumps


def _describe(reports: list[dict], nproc: int, directory: str | None, dumps: dict) -> str:
    lines = []
    for index, report in enumerate(reports):
        heading = f"rank {report['rank']} of {nproc} failed"
        heading += " (launcher=processes)" if index == 0 else " after it"
        lines.append(f"{heading}: {_what_happened(report)}")
        if report["traceback"]:
            lines += ["  " + line for line in report["traceback"].rstrip().splitlines()]
    if dumps:
        lines.append(_where_records_are(directory))
    return "\n".join(lines)


def _where_records_are(directory: str) -> str:
    return f"flight records: {directory} (read them with: paratrain debug hang {directory})"


def _users_fault(report: dict) -> bool:
    """Whether the rank that failed first was stopped or lost, or raised a user's error."""
    if report["signal"] is not None:
        return report["signal"] in _STOPPED_BY
    kind = (report["error"] or "").split(":", 1)[0]
    return kind in _LOST or kind in _names_of(UserError) or kind in _names_of(OSError)


def _names_of(error_class: type) -> set[str]:
    """The names of `error_class` and of every subclass defined so far (the ranks run this
    program's code, so they raise the classes it has imported)."""
    names, pending = set(), [error_class]
    while pending:
        cls = pending.pop()
        names.add(cls.__name__)
        pending += cls.__subclasses__()
    return names


def _from_process(rank: int, failure) -> dict:
    message = failure.message
    error = traceback = None
    if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
        error = message.get("message")
        traceback = message.get("extraInfo", {}).get("py_callstack")
    elif os.path.isfile(failure.error_file):  # an error file holding the text alone
        error = message
    if failure.exitcode < 0:
        how, stopped_by = f"killed by {failure.signal_name()}", -failure.exitcode
    else:
        how, stopped_by = f"exit code {failure.exitcode}", None
    return {"rank": rank, "how": how, "signal": stopped_by, "error": error, "traceback": traceback,
            "time": failure.timestamp}


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
    try:
        dumps = read_dumps(directory)
    except UserError:  # a stray file where records go: the report does without the records
        return {}
    return {rank: dump for rank, dump in dumps.items() if dump.get("run_id") == run_id}
