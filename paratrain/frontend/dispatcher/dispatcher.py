"""The dispatcher: one ZeroMQ ROUTER socket that clients, workers and monitors connect to.

It never touches tensor data except what a client uploads or asks to see. Each message is
decoded into its typed class (`protocol`), found in `handlers` by the sender's role and the
message's type, and handled; one thread (a second only warms up torch), no locks: all state
lives in its parts (`Peers`, `Admission`, `Router`, `Syncs`), changed only in `serve`'s loop.

Nothing a peer sends can stop the loop. A message that does not decode costs its sender an
Error naming the field (a stranger's is dropped and logged); an exception while handling one
message costs that sender an Error. Workers and clients are watched by heartbeat: a worker that
falls silent (or whose process exits, with local workers) is lost, and every sync waiting on it
fails at once; a client that falls silent is dropped, its tensors freed, and told why.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback

import zmq

from paratrain.frontend import signals
from paratrain.frontend.dispatcher.admission import Admission
from paratrain.frontend.dispatcher.backlog import Backlog, least_limit_bytes
from paratrain.frontend.dispatcher.auto_shard import AutoShard
from paratrain.frontend.dispatcher.complaints import Complaints
from paratrain.frontend.dispatcher.connections import Connections
from paratrain.frontend.dispatcher.descriptors import Descriptors
from paratrain.frontend.dispatcher.listener import listen
from paratrain.frontend.dispatcher.log import InstructionLog
from paratrain.frontend.dispatcher.peers import ClientState, Peers, WorkerState
from paratrain.frontend.dispatcher.reports import WorkerReports
from paratrain.frontend.dispatcher.router import Router
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.dispatcher.syncs import Syncs
from paratrain.frontend.protocol import MalformedMessage, codec, messages
from paratrain.frontend.shapes import warm_up

TICK_S = 1.0  # pings, liveness and expiry, this often
RECEIVE_SLICE_S = 0.2
STALL_S = 1.0  # a loop turn this much later than it should come: the dispatcher itself was stalled
DRAIN_MAX = 10_000  # messages read before judging a silent peer (its heartbeat may be among them)
STRANGER_HEADER = 64 << 10  # bytes a peer may send before it has joined


class Dispatcher:
    def __init__(self, settings: DispatcherSettings):
        self.settings = settings
        self.context = zmq.Context()
        self.sock, self.port = listen(self.context, settings)
        self.started = time.time()
        # The log exists while it has a file to write, or a live capture to feed (see _trace).
        self.log = InstructionLog(settings.log_path, self.started) if settings.log_path else None
        self.peers = Peers()
        self.backlog = Backlog(self.sock, least_limit_bytes(settings.max_message_mb << 20))
        self.complain = Complaints(self.say)
        max_tensor = settings.max_tensor_mb << 20 if settings.max_tensor_mb else None
        auto_shard = AutoShard(settings.auto_shard_min_bytes) if settings.auto_shard else None
        self.router = Router(settings.workers, self.peers.is_alive, self.log, max_tensor,
                             warn=lambda text: self.complain("router", text), auto_shard=auto_shard)
        self.syncs = Syncs(self.peers, self.send, self.peers.is_alive)
        self.admission = Admission(settings, self.peers, self.send, self.say, self.complain, on_ready=self._all_serving)
        self.reports = WorkerReports(self.peers, self.send)
        self.descriptors = Descriptors()
        self.connections = Connections(self.sock, settings.join_timeout)  # those that never join are shut
        self.stopping = False
        self.failure: str | None = None  # why it stopped serving, if it had to
        self.on_ready = None  # called once, when every worker serves
        self.accepts = codec.decoder(messages.TO_DISPATCHER)
        self.handlers = {
            ("client", messages.Run): self._run,
            ("client", messages.Configure): self._configure,
            ("client", messages.Bye): lambda client, message: self._drop_client(client, "said bye", tell=False),
            ("client", messages.WorkerStatsRequest): self._ask_worker_stats,
            ("worker", messages.Heartbeat): self._heartbeat,
            ("worker", messages.Collected): self.syncs.collected,
            ("worker", messages.Timings): self._timings,
            ("worker", messages.Leaving): lambda worker, message: self.lose_worker(worker.rank, message.reason),
            ("monitor", messages.StatsRequest): self._send_stats,
            ("monitor", messages.TraceRequest): self._trace,
            ("pending", messages.Auth): self.admission.auth,
            ("pending", messages.Hello): self.admission.hello,
            (None, messages.Hello): self.admission.hello,
        }

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @property
    def ready(self) -> bool:
        return self.admission.ready

    def say(self, text: str, warning: bool = False) -> None:
        """A line on stderr; `quiet` keeps only warnings (what a user must know of)."""
        if warning or not self.settings.quiet:
            print(f"paratrain serve: {text}", file=sys.stderr, flush=True)

    # ---- the loop ---------------------------------------------------------------------------

    def serve(self, should_stop=lambda: False, on_tick=lambda: None) -> None:
        """Serve until stopped; `should_stop()` is asked a few times a second, `on_tick()` is
        called once a second (serve.py watches its worker processes there)."""
        last_tick = last_turn = time.monotonic() - TICK_S
        # Meta kernels (for shape inference) load in ~1 s: on a thread, so joining workers are answered
        # meanwhile; joined at exit (an import cut off aborts). gc.freeze: what exists now lives on.
        warming = threading.Thread(target=lambda: (warm_up(), gc.freeze()), name="warm-up")
        warming.start()
        try:
            while not self.stopping and not should_stop():
                if self.sock.poll(5 if self.backlog else 250, zmq.POLLIN):  # what waits goes soon
                    # At most a slice of time on messages before the ticks: a flood from one peer
                    # must not stop the pings that keep the workers serving.
                    until = time.monotonic() + RECEIVE_SLICE_S
                    while self.sock.poll(0, zmq.POLLIN) and not self.stopping and time.monotonic() < until:
                        self._receive()
                        self._drop_peers_not_reading()
                self._drop_peers_not_reading()
                now = time.monotonic()
                # A turn takes at most a poll and a slice. Later than that, this process was not
                # running (a loaded host, a long import on another thread): its peers' silence in
                # that time is the dispatcher's, not theirs.
                stalled = now - last_turn - (0.25 + RECEIVE_SLICE_S)
                if stalled > STALL_S:
                    self.peers.excuse(stalled)
                    self.connections.excuse(stalled)
                last_turn = now
                if now - last_tick >= TICK_S:
                    self._tick(now)
                    on_tick()
                    last_tick = now
        finally:
            self.close()
            warming.join()

    def stop(self) -> None:
        self.stopping = True

    def fail(self, reason: str) -> None:
        """Stop serving, telling every client (and every client still waiting to join) why."""
        self.failure = reason
        self.say(f"cannot go on: {reason}", warning=True)
        for identity in [*self.peers.clients, *(k for k, p in self.peers.pending.items() if p.authenticated)]:
            self.send(identity, messages.Refused(f"the dispatcher stopped: {reason}"))
        self.stop()

    def close(self) -> None:
        for worker in self.peers.workers.values():
            if worker.alive:
                self.send(worker.identity, messages.Exit("the dispatcher stopped"))
        if self.log is not None:
            self.log.close()
        self.connections.close()
        self.sock.close(linger=200)
        self.context.term()

    def _receive(self) -> None:
        frames = self.sock.recv_multipart(copy=False)
        identity, body = frames[0].bytes, [frame.buffer for frame in frames[1:]]
        role = self.peers.role_of(identity)
        joined = role in ("client", "worker", "monitor")
        try:
            message = codec.decode(body, self.accepts, codec.MAX_HEADER if joined else STRANGER_HEADER,
                                   self.settings.max_message_mb << 20, cut=codec.cuts(self.settings.token))
        except MalformedMessage as error:
            who = f"{role} {self.peers.name(identity, role)}" if joined else f"an unjoined peer {identity.hex()}"
            self.complain(f"malformed {role}", f"dropped a malformed message from {who}: {error}")
            if joined:
                self.send(identity, messages.Error(f"malformed message: {error}"))
            return
        if self.log is not None and role in ("client", "worker"):
            self.log.received(role, self.peers.name(identity, role), message, sum(f.nbytes for f in body), time.time())
        try:
            self._dispatch(identity, role, message)
        except Exception as error:  # noqa: BLE001 - one message's failure is its sender's, never the loop's
            self.complain("handler", f"handling {message.KIND} from {role} {self.peers.name(identity, role)} failed:\n"
                                     f"{traceback.format_exc(limit=6)}")
            if joined:
                self.send(identity, messages.Error(f"the dispatcher could not handle your {message.KIND} "
                                                   f"({type(error).__name__}: {str(error)[:300]})"))
        if (self.peers.role_of(identity) in ("client", "worker", "monitor")
                or isinstance(message, messages.Alive) and message.secret in self.peers.by_secret):
            self.connections.joined(frames[0], time.monotonic())

    def _dispatch(self, identity: bytes, role: str | None, message) -> None:
        if isinstance(message, messages.Alive):
            self._alive(identity, message)
            return
        peer = (self.peers.clients.get(identity) if role == "client"
                else self.peers.worker_ids.get(identity) if role == "worker" else None)
        handler = self.handlers.get((role, type(message)))
        if peer is not None:
            peer.last_seen = time.monotonic()
            if role == "worker" and not peer.alive:
                self.send(identity, messages.Exit(f"this worker was declared lost: {peer.lost}"))
                return
        elif role == "monitor":
            self.peers.monitors[identity] = time.monotonic()
        if handler is not None:
            handler(peer if peer is not None else identity, message)
        elif role in ("client", "worker", "monitor"):
            self.send(identity, messages.Error(f"a {role} cannot send {message.KIND!r}"))
        elif self.peers.may_refuse(identity):  # a few times each: the replies to a flood would pile up unread
            reason = self.peers.dropped.get(identity) or "say hello (and authenticate) first"
            self.send(identity, messages.Refused(reason))

    # ---- clients -------------------------------------------------------------------------------

    def _run(self, client: ClientState, message: messages.Run) -> None:
        client.instructions += len(message.instructions)
        slot = client.table.slot
        routed = self.router.route(client.table, message.instructions, message.frames)
        client.dirty.update(routed.streams)
        self.syncs.add_errors(client, routed.errors)
        asks = self.syncs.start(client, message.sync, message.fetch) if message.sync is not None else {}
        outgoing = self._tasks(slot, routed, message.sync, asks)
        outgoing += [(self.peers.workers[rank].identity, messages.Collect(slot, message.sync, fetch))
                     for rank, fetch in asks.items() if rank not in routed.streams]
        # Everything is encoded before the first send: once a worker has its batch it competes
        # for the cores, and a message encoded after it could wait a time slice to be sent.
        for identity, message, frames in [(identity, message, codec.encode(message)) for identity, message in outgoing]:
            self.send_frames(identity, frames)
            if self.log is not None:
                self._log_sent(identity, message, frames)

    def _tasks(self, slot: int, routed, sync: int | None = None, asks: dict | None = None) -> list:
        """(identity, Tasks) for every live worker a routed batch gives work, each carrying the
        sync's request to that worker, if any."""
        tasks, asks = [], asks or {}
        for rank, instructions in routed.streams.items():
            worker = self.peers.workers.get(rank)
            if worker is not None and worker.alive:
                asked = rank in asks
                tasks.append((worker.identity, messages.Tasks(slot, instructions, self.log is not None,
                                                              sync if asked else None, asks.get(rank, []),
                                                              routed.frames.get(rank, []))))
        return tasks

    def _configure(self, client: ClientState, message: messages.Configure) -> None:
        """A client's signal configuration, checked against this dispatcher's workers."""
        try:
            parsed = signals.parse(message.signals, self.settings.workers)
        except signals.ConfigError as error:
            self.send(client.identity, messages.Error(str(error)))
            return
        client.table.signals = parsed  # those without workers place nothing (Signal.places)
        self.send(client.identity, messages.Configured(sorted(parsed)))

    def _alive(self, identity: bytes, message: messages.Alive) -> None:
        """A client's heartbeat connection: the client lives (or is told it was dropped)."""
        client = self.peers.by_secret.get(message.secret)
        if client is not None:
            client.last_seen = time.monotonic()
        elif message.secret in self.peers.dropped:
            self.send(identity, messages.Refused(self.peers.dropped[message.secret]))

    def _drop_client(self, client: ClientState, why: str, tell: bool = True) -> None:
        for identity, tasks in self._tasks(client.table.slot, self.router.drop_client(client.table)):
            self.send(identity, tasks)
        for worker in self.peers.workers.values():
            if worker.alive:
                self.send(worker.identity, messages.Forget(client.table.slot))
        if self.log is not None:
            self.log.event("DISCONNECT", f"CLIENT {client.table.slot}", "left", 0, f"why={why.replace(' ', '_')}",
                           time.time())
        self.peers.remove_client(client, f"dropped: {why}")
        if tell:
            self.send(client.identity, messages.Refused(f"dropped: {why}"))
        self.say(f"client {client.table.slot} left ({why}); its {len(client.table.where)} tensors are freed")

    # ---- workers -------------------------------------------------------------------------------

    def _heartbeat(self, worker: WorkerState, beat: messages.Heartbeat) -> None:
        now = time.monotonic()
        worker.heartbeat(beat, now)
        self.reports.answer_ready(now)
        if not worker.serving:
            self.admission.worker_serving(worker)

    def _timings(self, worker: WorkerState, message: messages.Timings) -> None:
        if self.log is not None:
            self.log.complete(message.timings)

    def _all_serving(self) -> None:
        self.say(f"all {self.settings.workers} workers are serving; clients connect to {self.address}")
        if self.on_ready is not None:
            self.on_ready()

    def lose_worker(self, rank: int, reason: str) -> None:
        """Worker `rank` is gone: fail the syncs waiting on it, rehome its clients, serve on."""
        worker = self.peers.workers.get(rank)
        if worker is None or not worker.alive:
            return
        worker.lost = reason
        self.say(f"worker {rank} is lost: {reason}", warning=True)
        if not self.ready:
            self.fail(f"worker {rank} was lost before every worker served ({reason})")
            return
        self.syncs.worker_lost(rank, reason)
        self.peers.rehome_clients_of(rank)
        if not any(w.alive for w in self.peers.workers.values()):
            self.fail("every worker is lost")

    # ---- time ---------------------------------------------------------------------------------

    def _overdue(self, now: float) -> bool:
        return any(w.alive and w.serving and now - w.last_seen > self.settings.worker_timeout
                   for w in self.peers.workers.values())

    def _tick(self, now: float) -> None:
        if self._overdue(now):
            # Read what has come before judging: a worker's heartbeat may be waiting behind a flood.
            for _ in range(DRAIN_MAX):
                if self.stopping or not self.sock.poll(0, zmq.POLLIN):
                    break
                self._receive()
            now = time.monotonic()
        for worker in list(self.peers.workers.values()):
            if not worker.alive:
                continue
            silent = now - worker.last_seen
            if worker.serving and silent > self.settings.worker_timeout:
                self.lose_worker(worker.rank, f"no heartbeat for {silent:.1f}s")
            else:
                self.send(worker.identity, messages.Ping())  # a waiting worker hears we are here
        for client in list(self.peers.clients.values()):
            silent = now - client.last_seen
            if silent > self.settings.client_timeout:
                self._drop_client(client, f"no heartbeat for {silent:.1f}s (--client-timeout "
                                          f"{self.settings.client_timeout:g}s)")
        for identity in self.peers.expire(now):
            self.complain("expired", f"forgot a peer that did not authenticate in time ({identity.hex()})")
        for kind, line in self.connections.shut_unjoined(now):
            self.complain(kind, line)
        running_out = self.descriptors.check(now)
        if running_out is not None:
            self.say(running_out, warning=True)
        self.reports.answer_ready(now)
        if self.log is not None and self.log.tap_expired(now):
            self._set_log(None)

    # ---- monitoring -----------------------------------------------------------------------

    def stats(self) -> messages.Stats:
        return messages.Stats(self.address, time.time() - self.started,
                              [self.peers.workers[rank].row() for rank in sorted(self.peers.workers)],
                              [client.row() for client in self.peers.clients.values()])

    def _send_stats(self, identity: bytes, message: messages.StatsRequest) -> None:
        self.send(identity, self.stats())

    def _ask_worker_stats(self, client: ClientState, message: messages.WorkerStatsRequest) -> None:
        self.reports.ask(client.identity, time.monotonic())

    def _trace(self, identity: bytes, message: messages.TraceRequest) -> None:
        """A live capture: log (to memory, if there is no log file) while it keeps asking."""
        if self.log is None:
            self._set_log(InstructionLog(None, self.started))
        self.log.listen(message.keep_s, time.monotonic())
        self.send(identity, self.log.lines_from(message.first))

    def _set_log(self, log: InstructionLog | None) -> None:
        self.log = self.router.log = log

    def _log_sent(self, identity: bytes, message, frames: list) -> None:
        role = self.peers.role_of(identity)
        if role in ("client", "worker"):
            self.log.sent(role, self.peers.name(identity, role), message, frames, time.time())

    # ---- sending ------------------------------------------------------------------------------

    def send(self, identity: bytes, message) -> None:
        frames = codec.encode(message)
        self.send_frames(identity, frames)
        if self.log is not None:
            self._log_sent(identity, message, frames)

    def send_frames(self, identity: bytes, frames: list) -> None:
        self.backlog.send(identity, frames, time.monotonic())

    def _drop_peers_not_reading(self) -> None:
        """Between messages (never in the middle of one): send what waits, and drop each peer
        whose backlog is over its bound or stuck, freeing what it holds."""
        if not self.backlog:
            return
        for identity, why in self.backlog.not_reading(time.monotonic()):
            client = self.peers.clients.get(identity)
            worker = self.peers.worker_ids.get(identity)
            if client is not None:
                self._drop_client(client, why, tell=False)
            elif worker is not None:
                self.lose_worker(worker.rank, why)
            else:
                self.peers.forget(identity)
