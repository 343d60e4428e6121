"""The dispatcher: one ZeroMQ ROUTER socket that clients, workers and monitors connect to.

It never touches tensor data except what a client uploads or asks to see. For each batch of
instructions it asks the router (`routing.py`) which worker runs what and forwards the
streams; for a sync it asks every worker the client has used since its last sync to report
(errors, fetched values) and answers the client once all have. One thread, no locks: all
state lives in this object and changes only in `serve`'s loop.

Peers say hello with a role. With a token, each must answer an HMAC challenge first; without
one, the dispatcher binds loopback only. Workers and clients are watched by heartbeat: a
worker that falls silent is lost (its tensors with it), a client that falls silent (or says
bye) has its tensors freed everywhere.
"""

from __future__ import annotations

import os
import sys
import time
import zmq

from paratrain.frontend import signals, wire
from paratrain.frontend.log import InstructionLog
from paratrain.frontend.peers import ClientState, Pending, WorkerState
from paratrain.frontend.syncs import SyncReplies
from paratrain.frontend.routing import ClientTable, Router

PING_S = 1.0


class Dispatcher(SyncReplies):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, workers: int = 1, *,
                 token: str | None = None, log_path: str | None = None,
                 client_timeout: float = 30.0, worker_timeout: float = 5.0,
                 max_message_mb: int = wire.DEFAULT_MAX_MESSAGE_MB, quiet: bool = False):
        if workers < 1:
            raise ValueError(f"a dispatcher needs at least one worker, got {workers}")
        if not wire.is_loopback(host) and not token:
            raise ValueError(
                f"binding {host} exposes the dispatcher beyond this machine: give a token "
                "(--token or PARATRAIN_TOKEN)"
            )
        self.n_workers, self.token, self.quiet = workers, token, quiet
        self.max_message_mb = max_message_mb
        self.client_timeout, self.worker_timeout = client_timeout, worker_timeout
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises instead of dropping
        self.sock.setsockopt(zmq.SNDHWM, 0)  # clients bound their own backlog (see client.py)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_mb << 20)
        self.host = host
        self.port = self.sock.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        self.log = InstructionLog(log_path) if log_path else None
        self.router = Router(workers, self._is_alive, self.log)
        self.workers: dict[int, WorkerState] = {}
        self.clients: dict[bytes, ClientState] = {}
        self.by_secret: dict[bytes, ClientState] = {}
        self.by_slot: dict[int, ClientState] = {}
        self.pending: dict[bytes, Pending] = {}
        self.waiting_clients: list[tuple[bytes, Pending]] = []
        self.next_slot = 1
        self.started = time.time()
        self.store = None  # a TCPStore for workers that arrive without a launcher's world
        self.stopping = False
        self.on_ready = None  # called once, when every worker has arrived

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ready(self) -> bool:
        return len(self.workers) == self.n_workers and all(w.serving for w in self.workers.values())

    def say(self, text: str, warning: bool = False) -> None:
        """A line on stderr; `quiet` keeps only warnings (what a user must know of)."""
        if warning or not self.quiet:
            print(f"paratrain serve: {text}", file=sys.stderr, flush=True)

    # ---- the loop ---------------------------------------------------------------------------

    def serve(self, should_stop=lambda: False) -> None:
        last_ping = 0.0
        try:
            while not self.stopping and not should_stop():
                if self.sock.poll(250, zmq.POLLIN):
                    while self.sock.poll(0, zmq.POLLIN):
                        self._receive()
                now = time.monotonic()
                if now - last_ping >= PING_S:
                    self._ping_workers()
                    self._check_liveness(now)
                    last_ping = now
        finally:
            self.close()

    def stop(self) -> None:
        self.stopping = True

    def close(self) -> None:
        for worker in self.workers.values():
            self._send(worker.identity, {"t": "exit"})
        if self.log is not None:
            self.log.close()
        self.sock.close(linger=200)
        self.context.term()

    def _receive(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        identity, body = frames[0].bytes, frames[1:]
        try:
            header = wire.decode(body[0].bytes if body else b"")
            self._handle(identity, header, body[1:])
        except wire.MalformedMessage as error:
            self.say(f"dropped a malformed message from peer {identity.hex()}: {error}", warning=True)
            self._send(identity, {"t": "error", "message": f"malformed message: {error}"})

    def _handle(self, identity: bytes, header: dict, frames: list) -> None:
        kind = header["t"]
        if identity in self.clients:
            client = self.clients[identity]
            client.last_seen = time.monotonic()
            if kind == "run":
                self._run(client, header, frames)
            elif kind == "config":
                self._configure(client, header)
            elif kind == "bye":
                self._drop_client(client, "said bye")
            else:
                raise wire.MalformedMessage(f"a client cannot send {kind!r}")
        elif worker := self._worker_by_identity(identity):
            worker.last_seen = time.monotonic()
            if kind == "hb":
                worker.heartbeat(wire.field(header, "stats", dict))
                if not worker.serving:
                    self._worker_serving(worker)
            elif kind == "synced":
                self._worker_synced(worker, header, frames)
            elif kind == "done" and self.log is not None:
                self.log.complete(wire.field(header, "timings", list))
        elif kind == "alive":  # a client's heartbeat connection
            client = self.by_secret.get(header.get("secret"))
            if client is not None:
                client.last_seen = time.monotonic()
        elif kind == "stats" and identity in self.pending and self.pending[identity].role == "monitor+":
            self._send(identity, self.stats())
        elif kind in ("hello", "auth"):
            self._authenticate(identity, kind, header)
        else:
            self.say(f"refused {kind!r} from an unauthenticated peer {identity.hex()}", warning=True)
            self._send(identity, {"t": "refused", "reason": "say hello (and authenticate) first"})

    # ---- joining --------------------------------------------------------------------------

    def _authenticate(self, identity: bytes, kind: str, header: dict) -> None:
        if kind == "hello":
            role = header.get("role")
            if role not in ("client", "worker", "monitor") or header.get("v") != wire.PROTOCOL_VERSION:
                self.say(f"refused a hello with role {role!r}, protocol {header.get('v')!r}", warning=True)
                self._send(identity, {"t": "refused", "reason": f"unknown role {role!r} or protocol version"})
                return
            pending = Pending(role, {k: v for k, v in header.items() if k not in ("t", "v", "role")})
            self.pending[identity] = pending
            if self.token:
                pending.nonce = wire.new_nonce()
                self._send(identity, {"t": "challenge", "nonce": pending.nonce})
                return
        else:
            pending = self.pending.get(identity)
            if pending is None or pending.nonce is None:
                self._send(identity, {"t": "refused", "reason": "auth without a challenge"})
                return
            if not wire.auth_ok(self.token, pending.nonce, pending.role, header.get("mac")):
                del self.pending[identity]
                self.say(f"refused a {pending.role} connection: wrong token (HMAC mismatch)", warning=True)
                self._send(identity, {"t": "refused", "reason": "wrong token"})
                return
        self._admit(identity, self.pending[identity])

    def _admit(self, identity: bytes, pending: Pending) -> None:
        if pending.role == "worker":
            del self.pending[identity]
            self._admit_worker(identity, pending.info)
        elif pending.role == "monitor":
            pending.role = "monitor+"  # authenticated: may ask for stats
            self._send(identity, {"t": "welcome", "workers": self.n_workers})
        elif self.ready:
            del self.pending[identity]
            self._admit_client(identity, pending.info)
        else:
            self.waiting_clients.append((identity, pending))

    def _admit_worker(self, identity: bytes, info: dict) -> None:
        taken = set(self.workers)
        rank = info.get("rank")
        if rank is None:
            free = [r for r in range(self.n_workers) if r not in taken]
            rank = free[0] if free else None
        if not isinstance(rank, int) or rank in taken or not 0 <= rank < self.n_workers:
            self.say(f"refused a worker (rank {info.get('rank')!r}): this dispatcher has {self.n_workers} "
                     f"worker slots, taken: {sorted(taken)}", warning=True)
            self._send(identity, {"t": "refused", "reason": "no free worker slot"})
            return
        self.workers[rank] = WorkerState(identity, rank, info, time.monotonic())
        self.say(f"worker {rank} joined ({info.get('host')}, pid {info.get('pid')}, {info.get('device')}); "
                 f"{len(self.workers)}/{self.n_workers}")
        if len(self.workers) < self.n_workers:
            self._send(identity, {"t": "waiting", "have": len(self.workers), "need": self.n_workers})
            return
        self._welcome_workers()

    def _welcome_workers(self) -> None:
        needs_store = any(w.info.get("rank") is None for w in self.workers.values())
        if needs_store and self.store is None:
            import torch.distributed as dist

            self.store = dist.TCPStore(self.host, 0, self.n_workers, is_master=True, wait_for_workers=False)
        for worker in self.workers.values():
            welcome = {"t": "welcome", "rank": worker.rank, "size": self.n_workers}
            if self.store is not None:
                welcome["store"] = [None, self.store.port]
            self._send(worker.identity, welcome)
            worker.welcomed = True

    def _worker_serving(self, worker: WorkerState) -> None:
        """A worker's first heartbeat: it has joined the world. When all have, open to clients."""
        worker.serving = True
        if not self.ready:
            return
        self.say(f"all {self.n_workers} workers are serving; clients connect to {self.address}")
        if self.on_ready is not None:
            self.on_ready()
        for identity, pending in self.waiting_clients:
            self.pending.pop(identity, None)
            self._admit_client(identity, pending.info)
        self.waiting_clients.clear()

    def _admit_client(self, identity: bytes, info: dict) -> None:
        slot = self.next_slot
        self.next_slot += 1
        home = self._least_busy_worker()
        secret = os.urandom(16)
        client = ClientState(identity, ClientTable(slot, home), info, secret, time.monotonic())
        self.clients[identity] = client
        self.by_secret[secret] = client
        self.by_slot[slot] = client
        self._send(identity, {"t": "welcome", "client": slot, "secret": secret, "workers": self.n_workers,
                              "home": home, "log": self.log is not None, "max_message_mb": self.max_message_mb,
                              "devices": [self.workers[r].info.get("device") for r in sorted(self.workers)]})

    def _least_busy_worker(self) -> int:
        live = [r for r, w in self.workers.items() if w.alive]
        if not live:
            return 0
        homes = [c.table.home for c in self.clients.values()]
        return min(live, key=lambda r: (homes.count(r), r))

    # ---- instructions and syncs ---------------------------------------------------------

    def _run(self, client: ClientState, header: dict, frames: list) -> None:
        ops = wire.field(header, "ops", list)
        token = wire.field(header, "sync", int, optional=True)
        fetch = wire.field(header, "fetch", list, optional=True) or []
        client.instructions += len(ops)
        streams, stream_frames, errors = self.router.route(client.table, ops, frames)
        self._forward(client.table.slot, streams, stream_frames)
        client.dirty.update(streams)
        if client.sync is None:
            client.sync = {"token": None, "waiting": set(), "errors": [], "fetched": {}}
        client.sync["errors"].extend(errors)
        if token is not None:
            self._start_sync(client, token, fetch)

    def _configure(self, client: ClientState, header: dict) -> None:
        """A client's signal configuration, checked against this dispatcher's workers."""
        try:
            client.table.signals = signals.parse(header.get("signals"), self.n_workers)
        except signals.ConfigError as error:
            self._send(client.identity, {"t": "error", "message": str(error)})
            return
        self._send(client.identity, {"t": "configured", "signals": sorted(client.table.signals)})

    def _forward(self, slot: int, streams: dict, stream_frames: dict) -> None:
        for worker, ops in streams.items():
            message = {"t": "run", "slot": slot, "ops": ops, "log": self.log is not None}
            self._send(self.workers[worker].identity, message, stream_frames.get(worker, ()))

    # ---- liveness -----------------------------------------------------------------------------

    def _ping_workers(self) -> None:
        for worker in self.workers.values():
            if worker.alive and worker.serving:
                self._send(worker.identity, {"t": "ping"})

    def _check_liveness(self, now: float) -> None:
        for worker in self.workers.values():
            if worker.alive and worker.serving and now - worker.last_seen > self.worker_timeout:
                worker.alive = False
                self.say(f"worker {worker.rank} is lost: no heartbeat for {now - worker.last_seen:.1f}s", warning=True)
                for client in self.clients.values():
                    if client.sync is not None and worker.rank in client.sync["waiting"]:
                        client.sync["errors"].append(
                            [-1, "sync", [], worker.rank, f"worker {worker.rank} was lost (no heartbeat)"])
                        client.sync["waiting"].discard(worker.rank)
                        self._finish_sync_if_done(client)
        for client in list(self.clients.values()):
            if now - client.last_seen > self.client_timeout:
                self._drop_client(client, f"silent for {now - client.last_seen:.1f}s")

    def _drop_client(self, client: ClientState, why: str) -> None:
        self._forward(client.table.slot, self.router.drop_client(client.table), {})
        for worker in self.workers.values():
            if worker.alive:
                self._send(worker.identity, {"t": "drop", "slot": client.table.slot})
        del self.clients[client.identity]
        self.by_secret.pop(client.secret, None)
        self.by_slot.pop(client.table.slot, None)
        self.say(f"client {client.table.slot} left ({why}); its {len(client.table.where)} tensors are freed")

    # ---- monitoring -----------------------------------------------------------------------

    def stats(self) -> dict:
        return {"t": "stats", "address": self.address, "uptime_s": time.time() - self.started,
                "workers": [self.workers[rank].snapshot() for rank in sorted(self.workers)],
                "clients": [client.snapshot() for client in self.clients.values()]}

    # ---- helpers ------------------------------------------------------------------------------

    def _is_alive(self, rank: int) -> bool:
        worker = self.workers.get(rank)
        return worker is not None and worker.alive

    def _worker_by_identity(self, identity: bytes) -> WorkerState | None:
        for worker in self.workers.values():
            if worker.identity == identity:
                return worker
        return None

    def _send(self, identity: bytes, header: dict, frames=()) -> None:
        try:
            self.sock.send_multipart([identity, wire.encode(header), *frames], copy=False)
        except zmq.ZMQError:
            pass  # the peer is gone; liveness checks deal with it
