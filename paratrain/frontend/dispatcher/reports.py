"""`gt.debug.get_worker_stats`: each worker as of a heartbeat it sent after the client asked.

A worker sends its heartbeats on the socket its replies go out on, in order, and a client asks
after the reply to its last sync has come: so one more heartbeat from every live worker counts
every instruction the client synced before asking. A worker that sends none within `WAIT_S`
(lost, or about to be) is reported as it was last heard.
"""

from __future__ import annotations

from paratrain.frontend.protocol import messages

WAIT_S = 2.0  # four heartbeats: a live worker sends one well within it


class WorkerReports:
    def __init__(self, peers, send):
        self.peers, self.send = peers, send
        self.waiting: list[tuple[bytes, float]] = []  # (client identity, when it asked: monotonic)

    def ask(self, identity: bytes, now: float) -> None:
        self.waiting.append((identity, now))

    def answer_ready(self, now: float) -> None:
        """Answer every request that every live worker has sent a heartbeat since, or that has
        waited `WAIT_S`."""
        if not self.waiting:
            return
        waiting, self.waiting = self.waiting, []
        for identity, asked in waiting:
            if now - asked >= WAIT_S or self._heard_since(asked):
                self.send(identity, self.report())
            else:
                self.waiting.append((identity, asked))

    def report(self) -> messages.WorkerStats:
        return messages.WorkerStats([self.peers.workers[rank].report() for rank in sorted(self.peers.workers)])

    def _heard_since(self, asked: float) -> bool:
        return all(worker.beat_at > asked for worker in self.peers.workers.values() if worker.alive)
