"""What can go wrong in the frontend, each error naming where."""

from __future__ import annotations


class FrontendError(RuntimeError):
    """Base of the frontend's errors."""


class RemoteError(FrontendError):
    """An instruction failed on a worker (or was refused by the dispatcher). Raised at the
    client's next sync point; the message names the operation, its inputs, the worker and the
    line of the client program that issued it."""

    def __init__(self, op: str, inputs: list[str], worker, source: str, message: str, more: int = 0):
        where = f"worker {worker}" if worker is not None else "the dispatcher"
        text = f"{op}({', '.join(inputs)}) failed on {where}, issued at {source}: {message}"
        if more:
            text += f" (and {more} more error{'s' if more > 1 else ''} since the last sync)"
        super().__init__(text)
        self.op, self.inputs, self.worker, self.source, self.detail = op, inputs, worker, source, message


class WorkerLost(FrontendError):
    """A worker this client used is gone (its process exited, or its heartbeat stopped); the
    tensors that lived there are gone with it."""


class ProtocolError(FrontendError):
    """The dispatcher could not make sense of a message (or the client of a reply)."""


class ConnectionLost(FrontendError):
    """The dispatcher stopped serving this client (it dropped it, or its server exited); the
    session is closed."""


class AuthenticationError(FrontendError):
    """The dispatcher refused the connection (missing or wrong token)."""


class DispatcherUnreachable(FrontendError, TimeoutError):
    """No reply from the dispatcher within the timeout."""
