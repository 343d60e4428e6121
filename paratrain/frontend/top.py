"""`paratrain top`: a live view of a dispatcher, its workers and its clients."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from paratrain.frontend.monitor import Monitor
from paratrain.frontend.protocol import messages


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


def run_top(address: str, token: str | None, interval: float, once: bool, snapshots: int | None = None) -> None:
    """Off a terminal (a pipe, a file) a view redrawn in place shows nothing until it ends: there
    each update is printed after the last, as `top -b` does. `snapshots`: stop after this many."""
    monitor = Monitor(address, token)
    console = Console()
    try:
        if once or not console.is_terminal:
            printed = 0
            while True:
                console.print(render(monitor.stats()))
                console.file.flush()  # a pipe's reader sees each update as it is made
                printed += 1
                if once or printed == snapshots:
                    return
                time.sleep(interval)
        with Live(render(monitor.stats()), console=console, refresh_per_second=4) as live:
            shown = 1
            while snapshots is None or shown < snapshots:
                time.sleep(interval)
                live.update(render(monitor.stats()))
                shown += 1
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
