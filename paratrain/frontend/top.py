"""`paratrain top`: a live view of a dispatcher, its workers and its clients."""

from __future__ import annotations

import os
import time

import zmq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from paratrain.frontend import wire
from paratrain.frontend.handshake import handshake, receive


class Monitor:
    """A connection that may only ask for statistics."""

    def __init__(self, address: str, token: str | None = None, timeout: float = 10.0):
        self.address, self.timeout = address, timeout
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{address}")
        handshake(self.sock, "monitor", token, {"pid": os.getpid()}, timeout, address)

    def stats(self) -> dict:
        self.sock.send(wire.encode({"t": "stats"}))
        return receive(self.sock, self.timeout, self.address)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def render(stats: dict) -> Group:
    workers = Table(title=f"paratrain frontend at {stats['address']} (up {stats['uptime_s']:.0f}s)")
    for column in ("worker", "host", "pid", "device", "state", "ops/s", "busy", "queue", "memory"):
        workers.add_column(column, justify="right" if column in ("ops/s", "busy", "queue", "memory") else "left")
    for w in stats["workers"]:
        workers.add_row(str(w["rank"]), str(w.get("host")), str(w.get("pid")), str(w.get("device")),
                        "alive" if w["alive"] else "LOST", f"{w['ops_per_s']:.0f}", f"{w['busy']:.0%}",
                        str(w["queue"]), _bytes(w["memory"]))
    clients = Table(title="clients")
    for column in ("client", "program", "pid", "instructions", "tensors"):
        clients.add_column(column)
    for c in stats["clients"]:
        clients.add_row(str(c["client"]), str(c.get("name")), str(c.get("pid")), str(c["instructions"]),
                        str(c["tensors"]))
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
