"""A monitor's connection to a dispatcher: statistics for `paratrain top`, instruction-log lines
for `paratrain frontend trace --live`. A monitor may ask for nothing else."""

from __future__ import annotations

import os
import socket
import time

import zmq

from paratrain.frontend.errors import ProtocolError
from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.addresses import endpoint
from paratrain.frontend.protocol.handshake import join, receive

KEEP_S = 2.0  # each request keeps the dispatcher logging this long: a capture that dies stops it soon
POLL_S = 0.1  # between requests that found nothing new


class Monitor:
    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0, name: str = "paratrain top"):
        self.address, self.timeout = address, timeout
        self.context = zmq.Context()
        hello = messages.Hello("monitor", VERSION, os.getpid(), name, socket.gethostname()[:256], "", None)
        try:
            self.sock, _ = join(self.context, endpoint(address), hello, token, timeout, address)
        except BaseException:
            self.context.term()
            raise

    def stats(self) -> messages.Stats:
        return self._ask(messages.StatsRequest(), messages.Stats)

    def trace(self, first: int, keep_s: float = KEEP_S) -> messages.TraceEvents:
        """Log lines numbered `first` on (0: none yet, start from the next one)."""
        return self._ask(messages.TraceRequest(first, keep_s), messages.TraceEvents)

    def _ask(self, request, kind):
        self.sock.send_multipart(codec.encode(request))
        reply = receive(self.sock, "monitor", self.timeout, self.address)
        if isinstance(reply, messages.Error):
            raise ProtocolError(f"{self.address} could not take our {request.KIND}: {reply.message}")
        if not isinstance(reply, kind):
            raise ProtocolError(f"{self.address} answered {reply.KIND!r} to {request.KIND!r}")
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def capture(address: str, token: str | None, seconds: float, max_events: int | None = None) -> tuple[list[str], int]:
    """The instruction-log lines a running dispatcher writes in the next `seconds` (at most
    `max_events` of them); -> (lines, how many were missed because the capture fell behind)."""
    monitor = Monitor(address, token, name="paratrain frontend trace --live")
    lines, missed = [], 0
    try:
        following = monitor.trace(0).first
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and (max_events is None or len(lines) < max_events):
            reply = monitor.trace(following)
            lines += reply.lines
            missed += reply.missed
            following = reply.first + len(reply.lines)
            if not reply.lines:
                time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    finally:
        monitor.close()
    return (lines if max_events is None else lines[:max_events]), missed
