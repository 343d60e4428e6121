"""What a peer can make the dispatcher hold, and the bounds on it: memory (strangers' large
hellos, with and without the token; a client that never reads its replies), pending peers, file
descriptors (connections that never join, and a line near the limit). Each bound is checked from
outside, on a running dispatcher, with a well-behaved client served after.
"""

from __future__ import annotations

import os
import time

import msgpack
import pytest
import zmq

import paratrain.frontend as gt
from frontend_helpers import (
    TOKEN, client_hello, reply_to, rss_bytes, serve_saying, stranger, wait_until, well_behaved_check,
)
from paratrain.frontend.protocol import Instruction, codec, messages
from paratrain.frontend.protocol.auth import secure_connector


def test_strangers_cannot_make_the_dispatcher_hold_memory(token_server):
    """Hellos with a large map used to stay forever: three took a dispatcher from 315 MB to 1 GB.
    A peer that has not joined must authenticate within seconds, and nothing it sends is kept.
    The hellos are 3 MB, cut as a token's peers cut every part (codec.py), so libzmq delivers them.
    These peers hold the token, so they pass ZeroMQ's handshake; those without it never get that
    far (the test after this one); the 64 KiB refusal itself: test_frontend_bad_messages.py."""
    pid = token_server.process.pid
    well_behaved_check(token_server.address, 3)  # what serving costs anyway (warm-up, first clients) comes first
    before = rss_bytes(pid)
    big = {"t": "hello", "role": "client", "version": 2, "pid": 1, "host": "", "device": "", "rank": None,
           "name": "n", **{f"k{i}": "x" * 60_000 for i in range(50)}}  # 3 MB of header
    packed = msgpack.packb(big)
    assert 64 << 10 < len(packed) < 4 << 20
    strangers = [stranger(token_server.address, TOKEN) for _ in range(3)]
    try:
        for _ in range(10):  # 90 MB in all: kept, they would grow the dispatcher by as much
            for _, sock in strangers:
                sock.send_multipart(codec.pieces(packed))
        for _, sock in strangers:  # a bye's refusal comes once the hellos before it are read
            sock.send_multipart(codec.encode(messages.Bye()))
            assert isinstance(reply_to(sock), messages.Refused)
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
        for thread in strangers:
            thread.start()
        peak = before
        while any(thread.is_alive() for thread in strangers):
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.02)
        for thread in strangers:
            thread.join()
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
        three = session.call("ones", [3], {"dtype": None})[0]
        session.sync([three._handle])  # what serving costs anyway comes first
        before = rss_bytes(serve.pid)
        for token in range(2, 102):  # read nothing from here on
            sock.send_multipart(codec.encode(messages.Run([], token, [0])))
            # Each answered before the next (a new sync abandons a pending one): the one worker
            # answers in order, so a sync of ours sent after it comes back after it.
            session.sync([three._handle])
        wait_until(lambda: "does not read what is sent to it" in said.read_text(), 60, "the dispatcher drops it")
        grown = rss_bytes(serve.pid) - before
        text = said.read_text()
        assert f"client {welcome.client} left (it does not read what is sent to it" in text and "(the bound: 16 MiB" in text, text
        assert "tensors are freed" in text and "worker 0 is lost" not in text, text
        assert grown < 48 << 20, f"the dispatcher grew by {grown >> 20} MiB"  # 16 queued by ZeroMQ, 16 MiB here
        (value,) = session.sync([three._handle])
        assert float(value.sum()) == 3.0  # served on
        session.close()
    finally:
        sock.close(linger=0)
        context.term()


JOIN_TIMEOUT_S = 2  # quick_join_server's --join-timeout, which also bounds ZeroMQ's handshake


@pytest.fixture
def quick_join_server(tmp_path):
    """One worker behind a token, closing connections whose peer has not joined within
    JOIN_TIMEOUT_S (the default, 10 s, would be most of the test's time)."""
    srv = serve_saying(tmp_path / "serve.err", "--workers", "1", "--token", TOKEN,
                       "--join-timeout", str(JOIN_TIMEOUT_S))
    yield srv
    srv.stop()


def test_connections_that_never_finish_the_handshake_or_never_join_are_closed(quick_join_server):
    """Two ways a connection holds a descriptor of the dispatcher's without joining, checked
    together so that their deadlines run at once.

    Plain TCP connections that say nothing: each is closed by ZeroMQ's handshake deadline (5 s,
    or --join-timeout if shorter; libzmq's default is 30 s), if the join deadline has not come
    first (here both are 2 s).

    Issue 37 item 5: 10,000 connections that said nothing, or only hello, cost 290 MB and a
    descriptor each, forever. Now each is closed once --join-timeout passes without its peer
    joining (on a server with a token, hello is not joining: the challenge must be answered), with
    a line; a client that joined, and its heartbeat connection, are kept."""
    import socket

    from zmq.utils.monitor import recv_monitor_message

    pid, address = quick_join_server.process.pid, quick_join_server.address
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
        newcomer = gt.Session(address, token=TOKEN, timeout=60)  # the dispatcher still takes clients
        assert newcomer.call("ones", [2], {"dtype": None})[0].sum().item() == 2.0
        newcomer.close()

        for watch in watches:
            assert watch.poll(30_000), "the dispatcher kept a connection that never joined"
            assert recv_monitor_message(watch)["event"] == zmq.EVENT_DISCONNECTED
        assert time.monotonic() - started > JOIN_TIMEOUT_S - 1
        said = quick_join_server.said
        wait_until(lambda: f"did not join within {JOIN_TIMEOUT_S}s" in said.read_text(), 10, "the dispatcher says so")
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
