"""What the dispatcher knows of each peer: workers, clients, and those still proving who they are."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from paratrain.frontend.routing import ClientTable


@dataclass
class WorkerState:
    identity: bytes
    rank: int
    info: dict  # host, pid, device
    last_seen: float
    stats: dict = field(default_factory=dict)  # the last heartbeat's figures
    rates: dict = field(default_factory=dict)  # ops_per_s, busy (fraction), from two heartbeats
    alive: bool = True
    welcomed: bool = False
    serving: bool = False  # it has joined the world and sent its first heartbeat

    def heartbeat(self, stats: dict) -> None:
        previous, now = self.stats, time.monotonic()
        if previous:
            span = max(now - previous["at"], 1e-6)
            self.rates = {
                "ops_per_s": (stats.get("ops", 0) - previous.get("ops", 0)) / span,
                "busy": min(1.0, (stats.get("busy_s", 0) - previous.get("busy_s", 0)) / span),
            }
        self.stats = {**stats, "at": now}

    def snapshot(self) -> dict:
        """One row of `paratrain top`."""
        return {**self.info, "rank": self.rank, "alive": self.alive, "ops": self.stats.get("ops", 0),
                "queue": self.stats.get("queue", 0), "memory": self.stats.get("memory", 0),
                "ops_per_s": self.rates.get("ops_per_s", 0.0), "busy": self.rates.get("busy", 0.0)}


@dataclass
class ClientState:
    identity: bytes
    table: ClientTable
    info: dict
    secret: bytes  # what its heartbeat connection proves itself with
    last_seen: float
    instructions: int = 0
    dirty: set = field(default_factory=set)  # workers given work since the last sync
    sync: dict | None = None  # errors gathered since the last sync; the sync in progress

    def snapshot(self) -> dict:
        return {"client": self.table.slot, "pid": self.info.get("pid"), "name": self.info.get("name"),
                "instructions": self.instructions, "tensors": len(self.table.where)}


@dataclass
class Pending:
    """A peer that said hello and has not yet proved itself."""

    role: str
    info: dict
    nonce: bytes | None = None
