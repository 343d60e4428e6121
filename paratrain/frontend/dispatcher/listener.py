"""The dispatcher's listening socket: one ZeroMQ ROUTER that clients, workers and monitors all
connect to, set up so that neither a stranger nor a peer that does not read can make the
dispatcher hold much."""

from __future__ import annotations

import errno

import zmq

from paratrain.frontend.dispatcher.backlog import SEND_QUEUE
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.protocol import codec
from paratrain.frontend.protocol.auth import secure_listener

HANDSHAKE_S = 5.0  # for a connection to finish ZeroMQ's handshake (a local one takes milliseconds)


class CannotServe(RuntimeError):
    """The dispatcher cannot listen where it was asked to (a port in use, no such interface)."""


def listen(context: zmq.Context, settings: DispatcherSettings) -> tuple[zmq.Socket, int]:
    """(the socket, the port it listens on); CannotServe (the context ended) if it cannot."""
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises instead of dropping
    sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)  # beyond: the Backlog, bounded (backlog.py)
    # With a token, parts come cut into frames of at most a piece (codec.py): a piece is then all
    # a stranger can make the dispatcher hold; --max-message-mb bounds whole tensors (_receive).
    # (CURVE wraps each frame in a MESSAGE command: 33 bytes more on the wire, where libzmq checks.)
    sock.setsockopt(zmq.MAXMSGSIZE, codec.PIECE_BYTES + 1024 if codec.cuts(settings.token)
                    else settings.max_message_mb << 20)
    # A connection that has not finished ZeroMQ's handshake in this time is closed (libzmq's
    # default, 30 s, let a stranger hold thousands of silent sockets, one descriptor each); the
    # handshake is the first step of joining, so it never gets longer than joining does.
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(min(HANDSHAKE_S, settings.join_timeout) * 1000))
    secure_listener(sock, settings.token)  # with a token, strangers end in the handshake
    host, port = settings.host, settings.port
    try:
        if port == 0:
            return sock, sock.bind_to_random_port(f"tcp://{host}")
        sock.bind(f"tcp://{host}:{port}")
        return sock, port
    except zmq.ZMQError as error:
        sock.close(linger=0)
        context.term()
        if error.errno == errno.EADDRINUSE:
            raise CannotServe(f"port {port} on {host} is in use (another `paratrain serve`? try --port 0)") from None
        raise CannotServe(f"cannot listen on {host}:{port}: {error.strerror}") from None
