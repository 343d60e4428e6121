"""A client's sync: ask every worker it has used since its last sync for its errors and the
values the client wants, gather the answers as they come, and reply once all have.

A split tensor is fetched part by part from its workers (the client puts the parts together);
a replicated one from its first worker. Each worker's answer also carries its running totals of
busy and waiting time, which the client uses to measure a pipeline's bubble. A worker lost
while a sync waits on it fails that sync at once, naming the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratrain.frontend.protocol import messages
from paratrain.frontend.protocol.records import ErrorReport, Fetched, WorkerTimes

MAX_ERRORS_KEPT = 256  # per client between two syncs: the first ones explain the rest


@dataclass
class FetchEntry:
    """One tensor a sync reads: from which workers, and the parts that have come."""

    fetched: Fetched
    holders: tuple = ()
    parts: dict = field(default_factory=dict)  # worker -> frame

    def fail(self, reason: str) -> None:
        self.fetched = Fetched(self.fetched.handle, None, [], 0, None, reason)


@dataclass
class PendingSync:
    token: int
    entries: list  # FetchEntry, in the order the client asked
    waiting: set = field(default_factory=set)  # workers yet to answer
    stats: dict = field(default_factory=dict)  # worker -> WorkerTimes


class Syncs:
    def __init__(self, peers, send, is_alive):
        self.peers, self.send, self.is_alive = peers, send, is_alive

    def start(self, client, token: int, fetch: list[int]) -> dict:
        """What each worker must report for this client's sync: {rank: the handles it fetches},
        for the caller to ask (in a Collect, or with the batch it sends that worker); answers
        the client now if no worker is needed."""
        table, by_worker, entries = client.table, {}, []
        for handle in fetch:
            entry = self._entry(table, handle)
            entries.append(entry)
            for worker in entry.holders:
                by_worker.setdefault(worker, []).append(handle)
        sync = PendingSync(token, entries)
        client.sync = sync  # a sync still pending is abandoned: the client asked again
        asks = {}
        for worker in sorted(client.dirty | set(by_worker)):
            if not self.is_alive(worker):
                self._lost_in(client, worker, self.peers.lost_reason(worker))
                continue
            asks[worker] = by_worker.get(worker, [])
            sync.waiting.add(worker)
        client.dirty = set()
        self._finish_if_done(client)
        return asks

    def _entry(self, table, handle: int) -> FetchEntry:
        if handle in table.refused:
            return FetchEntry(Fetched(handle, None, [], 0, None, table.refused[handle]))
        if handle not in table.where or table.meta.get(handle) is None:
            return FetchEntry(Fetched(handle, None, [], 0, None, f"handle {handle} is not a tensor of this client"))
        placement = table.where[handle]
        holders = placement.workers if placement.split is not None else placement.workers[:1]
        shape, dtype = table.meta[handle]
        return FetchEntry(Fetched(handle, dtype, list(shape), len(holders), placement.split, None), tuple(holders))

    def collected(self, worker, message: messages.Collected) -> None:
        """A worker's answer: its errors, the parts it holds, its totals."""
        client = self.peers.by_slot.get(message.slot)
        sync = client.sync if client is not None else None
        if sync is None or sync.token != message.token or worker.rank not in sync.waiting:
            return  # the client left, or asked again meanwhile
        self.add_errors(client, message.errors)
        sync.stats[worker.rank] = WorkerTimes(worker.rank, message.busy_s, message.wait_s, message.compiled)
        frames = iter(message.frames)
        answers = {fetched.handle: (fetched, next(frames) if fetched.dtype is not None else None)
                   for fetched in message.fetched}
        for entry in sync.entries:
            if worker.rank not in entry.holders or entry.fetched.dtype is None:
                continue
            answer, frame = answers.get(entry.fetched.handle, (None, None))
            if answer is None:
                entry.fail(f"worker {worker.rank} did not send it")
            elif answer.dtype is None:
                entry.fail(answer.error)
            else:
                entry.parts[worker.rank] = frame
        sync.waiting.discard(worker.rank)
        self._finish_if_done(client)

    def worker_lost(self, rank: int, reason: str) -> None:
        """Fail at once every sync waiting on a worker that is gone."""
        for client in list(self.peers.clients.values()):
            if client.sync is not None and rank in client.sync.waiting:
                client.sync.waiting.discard(rank)
                self._lost_in(client, rank, reason)
                self._finish_if_done(client)

    def _lost_in(self, client, rank: int, reason: str) -> None:
        self.add_errors(client, [ErrorReport(-1, "sync", [], rank, f"worker {rank} is lost ({reason})")])
        for entry in client.sync.entries:
            if rank in entry.holders and entry.fetched.dtype is not None:
                entry.fail(f"worker {rank} is lost ({reason})")

    def add_errors(self, client, errors: list) -> None:
        room = MAX_ERRORS_KEPT - len(client.errors)
        client.errors.extend(errors[:max(0, room)])

    def _finish_if_done(self, client) -> None:
        sync = client.sync
        if sync is None or sync.waiting:
            return
        fetched, frames = [], []
        for entry in sync.entries:
            fetched.append(entry.fetched)
            if entry.fetched.dtype is not None:
                frames.extend(entry.parts[worker] for worker in entry.holders)
        errors = sorted(client.errors, key=lambda error: error.seq)
        client.errors, client.sync = [], None
        stats = [sync.stats[rank] for rank in sorted(sync.stats)]
        self.send(client.identity, messages.Synced(sync.token, errors, fetched, stats, frames=frames))
