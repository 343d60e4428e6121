"""Joining: hello, the challenge (with a token), and admission as a worker, client or monitor.

Workers are numbered as they come (or keep a launcher's rank) and welcomed once all have come,
with the store to form their world at. Clients are admitted once every worker serves; until
then an authenticated client waits. Monitors may only ask for statistics.
"""

from __future__ import annotations

import os
import time

from paratrain.frontend.dispatcher.peers import ClientState, Pending, Peers, WorkerState
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.dispatcher.store import WorkerStore
from paratrain.frontend.dispatcher.table import ClientTable
from paratrain.frontend.protocol import VERSION, messages
from paratrain.frontend.protocol.auth import auth_ok, new_nonce


class Admission:
    def __init__(self, settings: DispatcherSettings, peers: Peers, send, say, warn, on_ready=None):
        self.settings, self.peers, self.send, self.say = settings, peers, send, say
        self.warn = warn  # (kind, text): a warning about a peer, at most one line a second per kind
        self.on_ready = on_ready  # called once, when every worker serves
        self.store: WorkerStore | None = None
        self.next_slot = 1

    @property
    def ready(self) -> bool:
        workers = self.peers.workers
        return len(workers) == self.settings.workers and all(w.serving for w in workers.values())

    def hello(self, identity: bytes, hello: messages.Hello) -> None:
        if hello.version != VERSION:
            self.warn("version", f"refused a {hello.role} (pid {hello.pid}) speaking protocol {hello.version}")
            self.send(identity, messages.Refused(f"protocol version {hello.version}; this dispatcher speaks {VERSION} "
                                                 "(is the peer's paratrain the same version?)"))
            return
        pending = Pending(hello, time.monotonic())
        self.peers.add_pending(identity, pending)
        if self.settings.token:
            pending.nonce = new_nonce()
            self.send(identity, messages.Challenge(pending.nonce))
            return
        self._admit(identity, pending)

    def auth(self, identity: bytes, auth: messages.Auth) -> None:
        pending = self.peers.pending.get(identity)
        if pending is None or pending.nonce is None or pending.authenticated:
            self.send(identity, messages.Refused("an answer without a challenge"))
            return
        if not auth_ok(self.settings.token, pending.nonce, pending.hello.role, auth.mac):
            del self.peers.pending[identity]
            self.warn("token", f"refused a {pending.hello.role} connection: wrong token (HMAC mismatch)")
            self.send(identity, messages.Refused("wrong token"))
            return
        self._admit(identity, pending)

    def _admit(self, identity: bytes, pending: Pending) -> None:
        role = pending.hello.role
        if role == "worker":
            del self.peers.pending[identity]
            self._admit_worker(identity, pending.hello)
        elif role == "monitor":
            del self.peers.pending[identity]
            self.peers.monitors[identity] = time.monotonic()
            self.send(identity, messages.MonitorWelcome(self.settings.workers))
        elif self.ready:
            del self.peers.pending[identity]
            self._admit_client(identity, pending.hello)
        else:
            pending.authenticated = True  # waits for the workers

    def _admit_worker(self, identity: bytes, hello: messages.Hello) -> None:
        taken = set(self.peers.workers)
        rank = hello.rank
        if rank is None:
            rank = next((r for r in range(self.settings.workers) if r not in taken), None)
        if rank is None or rank in taken or rank >= self.settings.workers:
            self.warn("slots", f"refused a worker (rank {hello.rank}): this dispatcher has {self.settings.workers} "
                               f"worker slots, taken: {sorted(taken)}")
            self.send(identity, messages.Refused("no free worker slot"))
            return
        self.peers.add_worker(WorkerState(identity, rank, hello, time.monotonic()))
        self.say(f"worker {rank} ({hello.name}) joined ({hello.host}, pid {hello.pid}, {hello.device}); "
                 f"{len(self.peers.workers)}/{self.settings.workers}")
        if len(self.peers.workers) < self.settings.workers:
            self.send(identity, messages.Waiting(len(self.peers.workers), self.settings.workers))
            return
        self._welcome_workers()

    def _welcome_workers(self) -> None:
        workers = self.peers.workers.values()
        if any(w.hello.rank is None for w in workers) and self.store is None:
            self.store = WorkerStore(self.settings.host, self.settings.workers)
        for worker in workers:
            store_port = self.store.port if self.store is not None else None
            self.send(worker.identity, messages.WorkerWelcome(worker.rank, self.settings.workers, store_port,
                                                              self.settings.max_message_mb))

    def worker_serving(self, worker: WorkerState) -> None:
        """A worker's first heartbeat: it has joined the world. When all have, open to clients."""
        worker.serving = True
        if not self.ready:
            return
        if self.on_ready is not None:
            self.on_ready()
        for identity, pending in [(k, p) for k, p in self.peers.pending.items() if p.authenticated]:
            del self.peers.pending[identity]
            self._admit_client(identity, pending.hello)

    def _admit_client(self, identity: bytes, hello: messages.Hello) -> None:
        slot = self.next_slot
        self.next_slot += 1
        home = self._least_busy_worker()
        client = ClientState(identity, ClientTable(slot, home), hello, os.urandom(16), time.monotonic())
        self.peers.add_client(client)
        devices = [self.peers.workers[r].hello.device for r in sorted(self.peers.workers)]
        self.send(identity, messages.ClientWelcome(slot, client.secret, self.settings.workers, home,
                                                   self.settings.log_path is not None, self.settings.max_message_mb,
                                                   devices))

    def _least_busy_worker(self) -> int:
        live = [r for r, w in self.peers.workers.items() if w.alive]
        if not live:
            return 0
        homes = [c.table.home for c in self.peers.clients.values()]
        return min(live, key=lambda r: (homes.count(r), r))
