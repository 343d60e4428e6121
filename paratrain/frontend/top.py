"""`paratrain top`: a live view of a dispatcher, its workers and its clients."""

from __future__ import annotations

import os
import socket
import time

import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from paratrain.frontend.errors import ProtocolError
from paratrain.frontend.protocol import VERSION, codec, messages
from paratrain.frontend.protocol.addresses import endpoint
from paratrain.frontend.protocol.handshake import handshake, receive


class Monitor:
    """A connection that may only ask for statistics."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0):
        self.address, self.timeout = address, timeout
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint(address))
        hello = messages.Hello("monitor", VERSION, os.getpid(), "paratrain top", socket.gethostname()[:256], "", None)
        handshake(self.sock, hello, token, timeout, address)

    def stats(self) -> messages.Stats:
        self.sock.send_multipart(codec.encode(messages.StatsRequest()))
        reply = receive(self.sock, "monitor", self.timeout, self.address)
        if not isinstance(reply, messages.Stats):
            raise ProtocolError(f"{self.address} answered {reply.KIND!r} to a request for statistics")
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def render(stats: messages.Stats) -> Group:
    workers = Table(title=f"paratrain frontend at {stats.address} (up {stats.uptime_s:.0f}s)")
    for column in ("worker", "host", "pid", "device", "state", "ops/s", "busy", "queue", "memory"):
        workers.add_column(column, justify="right" if column in ("ops/s", "busy", "queue", "memory") else "left")
    for w in stats.workers:
        workers.add_row(str(w.rank), w.host, str(w.pid), w.device, "alive" if w.alive else "LOST",
                        f"{w.ops_per_s:.0f}", f"{w.busy:.0%}", str(w.queue), _bytes(w.memory))
    clients = Table(title="clients")
    for column in ("client", "program", "pid", "instructions", "tensors"):
        clients.add_column(column)
    for c in stats.clients:
        clients.add_row(str(c.client), c.name, str(c.pid), str(c.instructions), str(c.tensors))
    return Group(workers, clients)


def run_top(address: str, token: str | None, interval: float, once: bool) -> None:
    monitor = Monitor(address, token)
    console = Console()
    try:
        if once:
            console.print(render(monitor.stats()))
            return
        with Live(render(monitor.stats()), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render(monitor.stats()))
    except KeyboardInterrupt:
        pass
    finally:
        monitor.close()


def _bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)
