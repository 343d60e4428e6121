"""What the dispatcher knows of each peer: workers, clients, monitors, and those still proving
who they are, each found by the ZeroMQ identity its messages arrive with.

Peers that have not authenticated hold only their (checked, small) hello, expire after
`PENDING_S`, and are at most `MAX_PENDING` at a time: a stranger cannot make the dispatcher
keep anything for long.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from paratrain.frontend.dispatcher.table import ClientTable
from paratrain.frontend.protocol.messages import Heartbeat, Hello
from paratrain.frontend.protocol.records import ClientRow, WorkerReport, WorkerRow

PENDING_S = 10.0  # seconds a peer has to authenticate
MAX_PENDING = 256  # unauthenticated peers at a time; the oldest goes first
MONITOR_S = 60.0  # a monitor that asks nothing for this long is forgotten
REMEMBER_DROPPED = 1024  # clients whose drop is remembered, to tell them why when they come back
REFUSALS_EACH = 4  # refusals sent to one stranger; then silence (a flood's replies would queue unread)
REMEMBER_REFUSED = 4096  # strangers whose refusals are counted; the oldest is forgotten first


@dataclass
class WorkerState:
    identity: bytes
    rank: int
    hello: Hello
    last_seen: float
    beat: Heartbeat | None = None  # the last heartbeat
    beat_at: float = 0.0
    rates: tuple = (0.0, 0.0)  # operations per second, busy fraction: from two heartbeats
    lost: str | None = None  # why it is lost (None while alive)
    serving: bool = False  # it has joined the world and sent its first heartbeat

    @property
    def alive(self) -> bool:
        return self.lost is None

    def heartbeat(self, beat: Heartbeat, now: float) -> None:
        previous = self.beat
        if previous is not None:
            span = max(now - self.beat_at, 1e-6)
            self.rates = ((beat.ops - previous.ops) / span, min(1.0, max(0.0, (beat.busy_s - previous.busy_s) / span)))
        self.beat, self.beat_at = beat, now

    def row(self) -> WorkerRow:
        beat = self.beat or Heartbeat(0, 0.0, 0, 0, {})
        return WorkerRow(self.rank, self.hello.host, self.hello.pid, self.hello.device, self.alive, beat.ops,
                         beat.queue, beat.memory, *self.rates)

    def report(self) -> WorkerReport:
        beat = self.beat or Heartbeat(0, 0.0, 0, 0, {})
        return WorkerReport(self.rank, self.hello.host, self.hello.pid, self.hello.device, self.alive, beat.ops,
                            beat.busy_s, beat.queue, beat.memory, beat.by_op)


@dataclass
class ClientState:
    identity: bytes
    table: ClientTable
    hello: Hello
    secret: bytes  # what its heartbeat connection proves itself with
    last_seen: float
    instructions: int = 0
    dirty: set = field(default_factory=set)  # workers given work since the last sync
    errors: list = field(default_factory=list)  # ErrorReports since the last sync
    sync: object = None  # the PendingSync in progress

    def row(self) -> ClientRow:
        return ClientRow(self.table.slot, self.hello.name, self.hello.pid, self.instructions, len(self.table.where))


@dataclass
class Pending:
    """A peer that said hello and has not yet been admitted."""

    hello: Hello
    since: float
    nonce: bytes | None = None  # the challenge it must answer (with a token)
    authenticated: bool = False  # a client proven, waiting for the workers


class Peers:
    def __init__(self):
        self.workers: dict[int, WorkerState] = {}
        self.worker_ids: dict[bytes, WorkerState] = {}
        self.clients: dict[bytes, ClientState] = {}
        self.by_secret: dict[bytes, ClientState] = {}
        self.by_slot: dict[int, ClientState] = {}
        self.monitors: dict[bytes, float] = {}  # identity -> last seen
        self.pending: OrderedDict[bytes, Pending] = OrderedDict()
        self.dropped: OrderedDict[bytes, str] = OrderedDict()  # identity -> why it was dropped
        self.refused: OrderedDict[bytes, int] = OrderedDict()  # stranger -> refusals sent it

    def may_refuse(self, identity: bytes) -> bool:
        """Whether a stranger's message still gets a Refused (the first REFUSALS_EACH do)."""
        sent = self.refused.pop(identity, 0)
        self.refused[identity] = sent + 1
        while len(self.refused) > REMEMBER_REFUSED:
            self.refused.popitem(last=False)
        return sent < REFUSALS_EACH

    def role_of(self, identity: bytes) -> str | None:
        if identity in self.clients:
            return "client"
        if identity in self.worker_ids:
            return "worker"
        if identity in self.monitors:
            return "monitor"
        if identity in self.pending:
            return "pending"
        return None

    def name(self, identity: bytes, role: str | None) -> str:
        """A peer as lines name it: a client's slot, a worker's rank, else its identity."""
        if role == "client":
            return str(self.clients[identity].table.slot)
        if role == "worker":
            return str(self.worker_ids[identity].rank)
        return identity.hex()

    def rehome_clients_of(self, rank: int) -> None:
        """The clients whose home worker `rank` was lost go home to the live worker that is
        home to the fewest clients."""
        live = [r for r, w in self.workers.items() if w.alive]
        for client in self.clients.values():
            if client.table.home == rank and live:
                client.table.home = min(live, key=lambda r: sum(c.table.home == r for c in self.clients.values()))

    def forget(self, identity: bytes) -> None:
        """A peer not yet a client or worker (a stranger, a monitor) is forgotten."""
        self.pending.pop(identity, None)
        self.monitors.pop(identity, None)

    def is_alive(self, rank: int) -> bool:
        worker = self.workers.get(rank)
        return worker is not None and worker.lost is None

    def lost_reason(self, rank: int) -> str:
        worker = self.workers.get(rank)
        return "it never joined" if worker is None else worker.lost or "alive"

    def add_pending(self, identity: bytes, pending: Pending) -> None:
        self.pending.pop(identity, None)
        self.pending[identity] = pending
        strangers = [k for k, p in self.pending.items() if not p.authenticated]
        for oldest in strangers[:max(0, len(strangers) - MAX_PENDING)]:
            del self.pending[oldest]

    def expire(self, now: float) -> list[bytes]:
        """Forget peers that did not authenticate in time, and silent monitors; -> those dropped."""
        late = [k for k, p in self.pending.items() if not p.authenticated and now - p.since > PENDING_S]
        for identity in late:
            del self.pending[identity]
        for identity in [k for k, seen in self.monitors.items() if now - seen > MONITOR_S]:
            del self.monitors[identity]
        return late

    def excuse(self, seconds: float) -> None:
        """The dispatcher was stalled for `seconds`: no peer's silence in that time counts."""
        for peer in [*self.workers.values(), *self.clients.values()]:
            peer.last_seen += seconds

    def add_client(self, client: ClientState) -> None:
        self.clients[client.identity] = client
        self.by_secret[client.secret] = client
        self.by_slot[client.table.slot] = client

    def remove_client(self, client: ClientState, why: str) -> None:
        del self.clients[client.identity]
        self.by_secret.pop(client.secret, None)
        self.by_slot.pop(client.table.slot, None)
        self.dropped[client.identity] = why
        self.dropped[client.secret] = why
        while len(self.dropped) > 2 * REMEMBER_DROPPED:
            self.dropped.popitem(last=False)

    def add_worker(self, worker: WorkerState) -> None:
        self.workers[worker.rank] = worker
        self.worker_ids[worker.identity] = worker
