"""The dispatcher survives any message a peer can send: recorded messages of a real client
session, mutated field by field, sent before and after authentication; after every 100, a
well-behaved client still gets correct values, and the dispatcher never dies. `--fuzz-cases N`
(default 2,000) sets the cases on each side of authentication; the figures of a run are printed
(pytest -s shows them). (The messages that used to kill it, one test each:
test_frontend_bad_messages.py; what a peer can make it hold: test_frontend_peer_limits.py.)
"""

from __future__ import annotations

import math
import random
import time

import msgpack
import numpy as np
import zmq

import paratrain.frontend as gt
from frontend_helpers import TOKEN, client_hello, raw_client, well_behaved_check
from paratrain.frontend.client.connection import Connection
from paratrain.frontend.protocol import codec, messages
from paratrain.frontend.protocol.auth import secure_connector

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
