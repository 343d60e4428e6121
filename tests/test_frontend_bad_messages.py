"""The dispatcher survives any message a peer can send.

The fuzz test: recorded messages of a real client session, mutated field by field, sent before
and after authentication; after every 100, a well-behaved client still gets correct values, and
the dispatcher never dies. `--fuzz-cases N` (default 2,000) sets the cases on each side of
authentication; the figures of a run are printed (pytest -s shows them).

Then the messages that used to kill it, one test each: an odd field before authentication, bad
instructions after it, and strangers' hellos that used to hold memory forever.
"""

from __future__ import annotations

import math
import os
import random
import time

import msgpack
import numpy as np
import pytest
import zmq

import paratrain.frontend as gt
from frontend_helpers import client_hello, raw_client, reply_to, rss_bytes, start_serve, wait_until
from paratrain.frontend.client.autostart import LocalServer
from paratrain.frontend.client.connection import Connection
from paratrain.frontend.protocol import Instruction, codec, messages
from paratrain.frontend.protocol.auth import secure_connector
from paratrain.frontend.protocol.handshake import ACCEPTS

TOKEN = "fuzz-token"  # so that "before authentication" includes the challenge and its answer
HUGE = [2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**64 - 1, -1, -(2**31), -(2**63), 1e308, -1e308, 1e-320]
ODD = [None, True, False, 0, 1, 3.5, "", "x" * 300, "t", b"", b"\x00" * 40, [], {}, {"t": "run"}, [[1]], [None]]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf]


def _deep(levels: int, dict_like: bool):
    value = 0
    for _ in range(levels):
        value = {"k": value} if dict_like else [value]
    return value


def _paths(value, path=()):
    """Every position in a decoded header: (path to it, the value there)."""
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, path + (index,))


def _replace(value, path, make):
    """A copy of `value` with the item at `path` replaced by make(old) (or deleted if make
    returns _DELETE)."""
    if not path:
        return make(value)
    head, rest = path[0], path[1:]
    copy = dict(value) if isinstance(value, dict) else list(value)
    new = _replace(value[head], rest, make)
    if new is _DELETE:
        del copy[head]
    else:
        copy[head] = new
    return copy


_DELETE = object()


def mutations(rng: random.Random):
    """One way to break a field, chosen at random: (its name, the function that breaks it)."""
    kind = rng.choice(["type", "list", "huge", "nan", "missing", "extra", "deep", "string"])
    if kind == "type":
        odd = rng.choice(ODD)
        return kind, lambda old: odd
    if kind == "list":
        return kind, lambda old: rng.choice([[old], [[old]], [old, old], {"x": old}])
    if kind == "huge":
        huge = rng.choice(HUGE)
        return kind, lambda old: huge
    if kind == "nan":
        special = rng.choice(SPECIAL_FLOATS)
        return kind, lambda old: special
    if kind == "missing":
        return kind, lambda old: _DELETE
    if kind == "extra":
        return kind, lambda old: {**old, rng.choice(["zzz", "t", "", "sync"]): rng.choice(ODD + HUGE)} \
            if isinstance(old, dict) else old + [rng.choice(ODD + HUGE)] if isinstance(old, list) else [old, 1]
    if kind == "deep":
        levels, dict_like = rng.choice([50, 200, 2000]), rng.random() < 0.5
        return kind, lambda old: _deep(levels, dict_like)
    return kind, lambda old: rng.choice(["hello", "run", "x" * 70000, "é" * 10, "\x00"])


def mutate(frames: list, rng: random.Random) -> list:
    """`frames` (a recorded message) with one field broken; sometimes the raw bytes instead."""
    if rng.random() < 0.05:
        header = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        return [bytes(header), *frames[1:]]
    body = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    positions = list(_paths(body))
    path, _ = rng.choice(positions[1:] if len(positions) > 1 else positions)
    _, make = mutations(rng)
    broken = _replace(body, path, make)
    try:
        header = msgpack.packb(broken, use_bin_type=True)
    except (ValueError, OverflowError, TypeError):  # msgpack itself refuses (too deep, too big)
        header = msgpack.packb({"t": "run", "instructions": [[0] * 2000]}, use_bin_type=True)
    extra = rng.random()
    if extra < 0.05:
        return [header]  # the tensor frames lost
    if extra < 0.1:
        return [header, *frames[1:], b"\x01" * rng.randint(0, 64)]  # one frame too many
    return [header, *frames[1:]]


# ---- a real session's messages ----------------------------------------------------------------------

def record_session(address: str) -> list[list[bytes]]:
    """Run a small well-behaved program and keep every message its client sent."""
    recorded = []
    original = Connection.send

    def recording(self, message):
        recorded.append([bytes(frame) for frame in codec.encode(message)])
        return original(self, message)

    Connection.send = recording
    try:
        session = gt.Session(address, token=TOKEN)
        session.configure({"pair": {"workers": [0, 1]}, "split": {"shard": {"axis": 0, "workers": [0, 1]}}})
        x = session.upload(np.arange(12, dtype=np.float32).reshape(3, 4), requires_grad=True)
        w = session.call("randn", [4, 2], {"dtype": "float32"}, requires_grad=True)[0]
        loss = (x @ w).relu().sum()
        loss.backward()
        optimizer = gt.optim.SGD([w], lr=0.1)
        optimizer.step()
        moved = session.call("ones", [2, 3], {"dtype": None}, worker=1)[0]
        z = (moved * 2.0)[0, 1:] + session.call("full", [2], {"dtype": None, "value": 1.5})[0]
        session.sync([z._handle, loss._handle])
        optimizer.zero_grad()
        session.close()
    finally:
        Connection.send = original
    return recorded


# ---- the fuzz ---------------------------------------------------------------------------------------

class Fuzzer:
    def __init__(self, address: str, recorded: list, seed: int):
        self.address, self.recorded, self.rng = address, recorded, random.Random(seed)
        self.context = zmq.Context()
        self.hello = codec.encode(client_hello())
        self.replies = 0

    def stranger(self):
        """A peer that holds the token (so gets past ZeroMQ's handshake) but has not joined."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_connector(sock, TOKEN)
        sock.connect(f"tcp://{self.address}")
        return sock

    def send_cases(self, sock, count: int, pool: list) -> None:
        for _ in range(count):
            sock.send_multipart(mutate(self.rng.choice(pool), self.rng))
            self.drain(sock)

    def drain(self, sock) -> None:
        while sock.poll(0):
            sock.recv_multipart()
            self.replies += 1

    def close(self) -> None:
        self.context.term()


def well_behaved_check(address: str, round_number: int) -> None:
    """A client that plays by the rules gets correct values (on both workers)."""
    session = gt.Session(address, token=TOKEN, timeout=30)
    try:
        a = session.call("full", [4], {"dtype": None, "value": float(round_number)})[0]
        b = session.call("ones", [4], {"dtype": None}, worker=1)[0]
        total = ((a + b) * 2.0).sum()
        (value,) = session.sync([total._handle])
        assert float(value) == 8.0 * (round_number + 1)
    finally:
        session.close()


def _serve_saying(said, *args: str) -> LocalServer:
    """`paratrain serve --local-workers ARGS`, its stderr (what it says) in the file `said`."""
    with open(said, "w") as stderr:
        process, address = start_serve("--local-workers", *args, stderr=stderr)
    return LocalServer(process, address)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """Two workers behind a token; `.said`: the file of what the dispatcher says."""
    said = tmp_path_factory.mktemp("token-server") / "serve.err"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PARATRAIN_TIMEOUT", "20")  # a worker left waiting on a broken partner gives up soon
        srv = _serve_saying(said, "--workers", "2", "--token", TOKEN, "--max-tensor-mb", "16",
                            "--client-timeout", "20", "--threads", "1")
    srv.said = said
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def saying_server(tmp_path_factory):
    """One worker, no token, messages of at most 1 MiB; `.said`: the file of what the dispatcher
    says. Shared by the tests that read what it says of one peer (each looks for its own line)."""
    said = tmp_path_factory.mktemp("saying-server") / "serve.err"
    srv = _serve_saying(said, "--workers", "1", "--max-message-mb", "1")
    srv.said = said
    yield srv
    srv.stop()


def test_mutated_messages_never_kill_the_dispatcher(token_server, request):
    cases = request.config.getoption("--fuzz-cases")
    address = token_server.address
    recorded = record_session(address)
    assert len(recorded) >= 3 and any(len(frames) > 1 for frames in recorded)  # uploads carry frames
    joining = [codec.encode(client_hello()), codec.encode(messages.Auth("0" * 64)),
               codec.encode(messages.Alive(b"\x00" * 16))]
    fuzzer = Fuzzer(address, recorded, seed=1234)
    started, checks = time.monotonic(), 0
    try:
        for side in ("before authentication", "after authentication"):
            done = 0
            while done < cases:
                batch = min(100, cases - done)
                if side == "before authentication":
                    sock = fuzzer.stranger()
                    fuzzer.send_cases(sock, batch, joining + recorded)
                    sock.close(linger=0)
                else:
                    with raw_client(address, TOKEN) as (sock, _):
                        fuzzer.send_cases(sock, batch, recorded)
                done += batch
                assert token_server.process.poll() is None, f"the dispatcher died {side}, after {done} cases"
                well_behaved_check(address, checks)
                checks += 1
    finally:
        fuzzer.close()
    elapsed = time.monotonic() - started
    assert token_server.process.poll() is None
    print(f"\nfuzz: {2 * cases} mutated messages ({cases} before and {cases} after authentication), "
          f"{checks} well-behaved checks, 0 dispatcher deaths, {fuzzer.replies} replies, {elapsed:.1f}s")


# ---- the messages that used to kill it ------------------------------------------------------------------

def _stranger(address: str, token: str | None = None):
    """A peer that has not joined (with the token: past ZeroMQ's handshake, before the challenge)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_connector(sock, token)
    sock.connect(f"tcp://{address}")
    return context, sock


@pytest.mark.parametrize("header", [
    {"t": "alive", "secret": [1, 2]},  # a list where bytes belong: was TypeError, unhashable
    {"t": "hello", "role": ["client"], "version": 2, "pid": 1, "name": "", "host": "", "device": "", "rank": None},
    {"t": "auth", "mac": {"x": 1}},
    {"t": ["run"]},
])
def test_an_odd_field_before_authentication_costs_the_dispatcher_nothing(token_server, header):
    context, sock = _stranger(token_server.address, TOKEN)
    try:
        sock.send(msgpack.packb(header))
        assert not sock.poll(300)  # a stranger's malformed message is dropped (and logged), not answered
    finally:
        sock.close(linger=0)
        context.term()
    assert token_server.process.poll() is None
    well_behaved_check(token_server.address, 1)


def _wire(seq, op, outs, args, targs, kwargs=None, signal=None):
    return [seq, op, outs, args, targs, kwargs or {}, False, False, None, signal, None]


BAD_AFTER_AUTHENTICATION = {
    "a tensor argument holding a list": ([_wire(1, "relu", [5], [[1, 2]], [0])], [], "a tensor argument must be a handle"),
    "fetch of a list": ([], [[1]], "run.fetch[0]"),
    "a list as the signal": ([_wire(1, "ones", [5], [2], [], signal=[1])], [], "instructions[0].signal"),
    "grad without a tensor": ([_wire(1, "grad", [5], [0], [])], [], "grad takes 1 to 1 distinct tensor arguments"),
    "backward without a tensor": ([_wire(1, "backward", [], [], [])], [], "backward takes 1 to 2"),
    "optim_step on an unknown handle": ([_wire(1, "optim_step", [], [777], [0])], [], "not a tensor of this client"),
    "optim_step on a tensor": ([_wire(1, "ones", [6], [2], []), _wire(2, "optim_step", [], [6], [0])], [],
                               "is a tensor, not an optimizer"),
    "a creation without a result": ([_wire(1, "randn", [], [2], [])], [], "randn makes 1 result(s)"),
    "an upload whose shape is not its frame's": (
        [_wire(1, "upload", [5], [], [], {"dtype": "float32", "shape": [3], "frame": 0})], [],
        "frame 0 holds 8 bytes; a float32[3] tensor has 12"),
}


@pytest.mark.parametrize("case", BAD_AFTER_AUTHENTICATION)
def test_a_bad_instruction_costs_its_client_an_error_and_nothing_more(token_server, case):
    instructions, fetch, reason = BAD_AFTER_AUTHENTICATION[case]
    with raw_client(token_server.address, TOKEN) as (sock, _):
        frames = [np.zeros(2, np.float32).tobytes()] if "upload" in case else []
        sock.send_multipart(codec.encode(messages.Run(instructions, 7, fetch, frames)))
        reply = reply_to(sock)
        text = reply.message if isinstance(reply, messages.Error) else " ".join(e.message for e in reply.errors)
        assert reason in text, text
        sock.send_multipart(codec.encode(messages.Run([Instruction(9, "full", [0], [3], [], {"value": 2.0})], 8, [0])))
        reply = reply_to(sock)
        while not isinstance(reply, messages.Synced):
            reply = reply_to(sock)
        assert reply.errors == [] and np.frombuffer(reply.frames[0], np.float32).tolist() == [2.0, 2.0, 2.0]
    assert token_server.process.poll() is None
    well_behaved_check(token_server.address, 2)


def test_strangers_cannot_make_the_dispatcher_hold_memory(token_server):
    """Hellos with a large map used to stay forever: three took a dispatcher from 315 MB to 1 GB.
    A peer that has not joined must authenticate within seconds, and nothing it sends is kept.
    The hellos are 3 MB, cut as a token's peers cut every part (codec.py), so libzmq delivers them.
    These peers hold the token, so they pass ZeroMQ's handshake; those
    without it never get that far (the test after this one); the 64 KiB refusal itself: the test
    after that."""
    pid = token_server.process.pid
    well_behaved_check(token_server.address, 3)  # what serving costs anyway (warm-up, first clients) comes first
    before = rss_bytes(pid)
    big = {"t": "hello", "role": "client", "version": 2, "pid": 1, "host": "", "device": "", "rank": None,
           "name": "n", **{f"k{i}": "x" * 60_000 for i in range(50)}}  # 3 MB of header
    packed = msgpack.packb(big)
    assert 64 << 10 < len(packed) < 4 << 20
    strangers = [_stranger(token_server.address, TOKEN) for _ in range(3)]
    try:
        for _ in range(10):  # 90 MB in all: kept, they would grow the dispatcher by as much
            for _, sock in strangers:
                sock.send_multipart(codec.pieces(packed))
        time.sleep(1.0)
        well_behaved_check(token_server.address, 3)
        grown = rss_bytes(pid) - before
    finally:
        for context, sock in strangers:
            sock.close(linger=0)
            context.term()
    assert grown < 50 << 20, f"the dispatcher grew by {grown >> 20} MiB"


def _zmtp_stranger(address: str, mechanism: bytes, megabytes: int) -> None:
    """A peer without the token that speaks ZeroMQ's wire protocol by hand and sends `megabytes`
    that libzmq would have to hold whole before the program saw any of it: after a NULL greeting,
    one message of 60 KiB frames, each marked "more" (ZMQ_MAXMSGSIZE bounds one frame, not a
    message); after a CURVE greeting, one command frame that large."""
    import socket
    import struct

    host, port = address.rsplit(":", 1)
    connection = socket.create_connection((host, int(port)))
    try:
        connection.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.ljust(20, b"\0") + bytes(32))
        connection.recv(64)
        if mechanism == b"CURVE":
            connection.sendall(bytes([0x06]) + struct.pack(">Q", megabytes << 20))
            pieces = [bytes(1 << 20)] * megabytes
        else:
            ready = b"\x05READY" + bytes([11]) + b"Socket-Type" + struct.pack(">I", 6) + b"DEALER"
            connection.sendall(bytes([0x04, len(ready)]) + ready)
            frame = bytes(60 << 10)
            pieces = [bytes([0x03]) + struct.pack(">Q", len(frame)) + frame] * (megabytes * 17)
        for piece in pieces:
            connection.sendall(piece)
    except OSError:  # refused: the dispatcher closed the connection
        pass
    finally:
        connection.close()


def test_strangers_without_the_token_cannot_make_the_dispatcher_hold_memory(token_server):
    """Issue 37 item 3: three strangers each sending a 900 MiB message took a dispatcher with a
    token from 251 MB to 2,525 MB, since a message is received whole before its first check.
    With a token, ZeroMQ's CURVE handshake (keys from the token) ends a stranger's connection
    before any message is read, and no frame may exceed codec.PIECE_BYTES, the handshake's
    included. Here 3 strangers send 200 MiB each, as one message of small frames or as one
    handshake command: the dispatcher's peak grows by under 50 MiB (each way alone took it up by
    the whole 600 MiB: the first before CURVE, the second before the frame cap)."""
    import threading

    pid = token_server.process.pid
    well_behaved_check(token_server.address, 0)  # what serving costs anyway comes first
    before = rss_bytes(pid)
    for mechanism in (b"NULL", b"CURVE"):
        strangers = [threading.Thread(target=_zmtp_stranger, args=(token_server.address, mechanism, 200))
                     for _ in range(3)]
        for stranger in strangers:
            stranger.start()
        peak = before
        while any(stranger.is_alive() for stranger in strangers):
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.02)
        for stranger in strangers:
            stranger.join()
        grown = max(peak, rss_bytes(pid)) - before
        assert grown < 50 << 20, f"{mechanism.decode()} strangers took the dispatcher up by {grown >> 20} MiB"
    well_behaved_check(token_server.address, 1)
    assert token_server.process.poll() is None


def test_unauthenticated_peers_expire_and_are_few():
    from paratrain.frontend.dispatcher.peers import MAX_PENDING, PENDING_S, Pending, Peers

    peers = Peers()
    hello = client_hello()
    for i in range(MAX_PENDING + 10):
        peers.add_pending(i.to_bytes(4, "big"), Pending(hello, since=100.0))
    assert len(peers.pending) == MAX_PENDING and b"\x00\x00\x00\x00" not in peers.pending  # the oldest went
    waiting = Pending(hello, since=100.0, authenticated=True)  # a client proven, waiting for workers
    peers.add_pending(b"waits", waiting)
    expired = peers.expire(100.0 + PENDING_S + 1)
    assert len(expired) == MAX_PENDING and list(peers.pending) == [b"waits"]


def test_a_strangers_message_over_64_kib_is_refused_before_it_is_decoded(saying_server):
    """Under the server's --max-message-mb (1 here) libzmq delivers it; the dispatcher's own
    bound for peers that have not joined refuses it unread, and says so."""
    said = saying_server.said
    packed = msgpack.packb({"t": "hello", "role": "client", "name": "x" * 500_000})
    context, sock = _stranger(saying_server.address)
    try:
        sock.send(packed)
        wait_until(lambda: f"a header of {len(packed)} bytes" in said.read_text(), 30, "the dispatcher complains")
    finally:
        sock.close(linger=0)
        context.term()
    assert "an unjoined peer" in said.read_text()
    assert f"a header of {len(packed)} bytes (at most 65536 here)" in said.read_text()
    assert saying_server.process.poll() is None


def test_a_stranger_flooding_the_dispatcher_gets_a_few_refusals_not_one_each(token_server):
    """3 million byes from a stranger used to queue 176 MB of refusals it never read."""
    from paratrain.frontend.dispatcher.peers import REFUSALS_EACH

    context, sock = _stranger(token_server.address, TOKEN)
    try:
        bye = codec.encode(messages.Bye())
        for _ in range(1000):
            sock.send_multipart(bye)
        replies = 0
        while sock.poll(2000):
            assert isinstance(codec.decode(sock.recv_multipart(), ACCEPTS["client"]), messages.Refused)
            replies += 1
        assert replies == REFUSALS_EACH
    finally:
        sock.close(linger=0)
        context.term()
    well_behaved_check(token_server.address, 0)


def test_a_dispatcher_near_its_descriptor_limit_says_so(saying_server):
    """Silent connections each hold one of the dispatcher's descriptors: near its limit it prints
    a line (before, 1,100 of them locked every real client out with nothing logged). The limit is
    lowered on the running dispatcher, which reads it on each tick, and put back after."""
    import resource
    import socket

    pid, said = saying_server.process.pid, saying_server.said
    limits = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    silent = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (256, limits[1]))
        host, port = saying_server.address.rsplit(":", 1)
        used = len(os.listdir(f"/proc/{pid}/fd"))
        silent = [socket.create_connection((host, int(port))) for _ in range(int(0.8 * 256) - used + 10)]
        wait_until(lambda: "file descriptors in use" in said.read_text(), 10, "the dispatcher warns")
        assert " of 256 file descriptors in use (one per connection)" in said.read_text()
    finally:
        for connection in silent:
            connection.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, limits)


def test_a_client_that_does_not_read_its_replies_is_dropped_and_its_queue_bounded(saying_server):
    """Issue 37 item 4: replies to a client that never reads used to queue without limit (64 MiB
    fetches 38 times: 2.5 GB). This one reads nothing after joining, its ZeroMQ takes one message
    into a 64 KiB socket buffer, and it asks for 100 reads of 800 KB (80 MB): the dispatcher
    holds a bounded few (backlog.py), drops it with a line, and serves on; the burst of 100 tasks
    to the worker, which reads, waits its turn and loses no worker."""
    from paratrain.frontend.protocol.handshake import handshake

    serve, address, said = saying_server.process, saying_server.address, saying_server.said
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 64 << 10)
        sock.connect(f"tcp://{address}")
        welcome = handshake(sock, client_hello(), None, 30.0, address)
        count = 200_000  # float32: 800 KB, under the 1 MiB a message may carry
        sock.send_multipart(codec.encode(messages.Run([Instruction(1, "ones", [0], [count], [], {})], 1, [])))
        assert isinstance(reply_to(sock), messages.Synced)
        session = gt.Session(address, timeout=60)
        session.call("ones", [3], {"dtype": None})  # what serving costs anyway comes first
        before = rss_bytes(serve.pid)
        for token in range(2, 102):  # read nothing from here on
            sock.send_multipart(codec.encode(messages.Run([], token, [0])))
            time.sleep(0.05)  # each sync answered before the next (a new one abandons a pending one)
        wait_until(lambda: "does not read what is sent to it" in said.read_text(), 60, "the dispatcher drops it")
        grown = rss_bytes(serve.pid) - before
        text = said.read_text()
        assert f"client {welcome.client} left (it does not read what is sent to it" in text and "(the bound: 16 MiB" in text, text
        assert "tensors are freed" in text and "worker 0 is lost" not in text, text
        assert grown < 48 << 20, f"the dispatcher grew by {grown >> 20} MiB"  # 16 queued by ZeroMQ, 16 MiB here
        three = session.call("ones", [3], {"dtype": None})[0]
        (value,) = session.sync([three._handle])
        assert float(value.sum()) == 3.0  # served on
        session.close()
    finally:
        sock.close(linger=0)
        context.term()


def test_connections_that_never_finish_the_handshake_or_never_join_are_closed(token_server):
    """Two ways a connection holds a descriptor of the dispatcher's without joining, checked
    together so that their deadlines run at once.

    Plain TCP connections that say nothing: each is closed by ZeroMQ's handshake deadline (5 s;
    libzmq's default is 30 s).

    Issue 37 item 5: 10,000 connections that said nothing, or only hello, cost 290 MB and a
    descriptor each, forever. Now each is closed once JOIN_S passes without its peer joining
    (on a server with a token, hello is not joining: the challenge must be answered), with a
    line; a client that joined, and its heartbeat connection, are kept."""
    import socket

    from zmq.utils.monitor import recv_monitor_message

    from paratrain.frontend.dispatcher.connections import JOIN_S

    pid, address = token_server.process.pid, token_server.address
    context = zmq.Context()
    silent, hello_only = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    watches, plain = [], []
    try:
        session = gt.Session(address, token=TOKEN, timeout=60)
        for sock in (silent, hello_only):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 600_000)  # once closed, it stays closed
            secure_connector(sock, TOKEN)  # past ZeroMQ's handshake: what ends them is not joining
            watches.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.connect(f"tcp://{address}")
        hello_only.send_multipart(codec.encode(client_hello()))  # and never answers the challenge
        started = time.monotonic()

        # (these two may still be on their way in: they add at most 2 to the counts below)
        before = len(os.listdir(f"/proc/{pid}/fd"))
        host, port = address.rsplit(":", 1)
        plain = [socket.create_connection((host, int(port))) for _ in range(100)]
        wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) >= before + 100, 10, "the dispatcher accepts them")
        wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= before + 5, 10, "the silent connections are closed")
        well_behaved_check(address, 0)

        for watch in watches:
            assert watch.poll(int((JOIN_S + 10) * 1000)), "the dispatcher kept a connection that never joined"
            assert recv_monitor_message(watch)["event"] == zmq.EVENT_DISCONNECTED
        assert time.monotonic() - started > JOIN_S - 1
        wait_until(lambda: "did not join within" in token_server.said.read_text(), 10, "the dispatcher says so")
        two = session.call("full", [2], {"dtype": None, "value": 1.0})[0]
        (value,) = session.sync([two._handle])
        assert float(value.sum()) == 2.0  # the client that joined was kept
        session.close()
    finally:
        for connection in plain:
            connection.close()
        for watch in watches:
            watch.close(linger=0)
        silent.close(linger=0)
        hello_only.close(linger=0)
        context.term()
