"""Messages that used to kill the dispatcher, one test each: an odd field before authentication,
bad instructions after it, a stranger's oversized header and a stranger's flood. Each costs its
sender an error or nothing, and the dispatcher serves on. (Mutated messages by the thousand:
test_frontend_fuzz.py; what a peer can make the dispatcher hold: test_frontend_peer_limits.py.)
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from frontend_helpers import TOKEN, client_hello, raw_client, reply_to, stranger, wait_until, well_behaved_check
from paratrain.frontend.protocol import Instruction, codec, messages


@pytest.mark.parametrize("header", [
    {"t": "alive", "secret": [1, 2]},  # a list where bytes belong: was TypeError, unhashable
    {"t": "hello", "role": ["client"], "version": 2, "pid": 1, "name": "", "host": "", "device": "", "rank": None},
    {"t": "auth", "mac": {"x": 1}},
    {"t": ["run"]},
])
def test_an_odd_field_before_authentication_costs_the_dispatcher_nothing(token_server, header):
    context, sock = stranger(token_server.address, TOKEN)
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


def test_a_strangers_message_over_64_kib_is_refused_before_it_is_decoded(saying_server):
    """Under the server's --max-message-mb (1 here) libzmq delivers it; the dispatcher's own
    bound for peers that have not joined refuses it unread, and says so."""
    said = saying_server.said
    packed = msgpack.packb({"t": "hello", "role": "client", "name": "x" * 500_000})
    context, sock = stranger(saying_server.address)
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

    context, sock = stranger(token_server.address, TOKEN)
    try:
        bye = codec.encode(messages.Bye())
        for _ in range(1000):
            sock.send_multipart(bye)
        sock.send_multipart(codec.encode(client_hello()))  # answered after every bye: one connection's order
        refusals = 0
        while isinstance(reply := reply_to(sock), messages.Refused):
            refusals += 1
        assert isinstance(reply, messages.Challenge) and refusals == REFUSALS_EACH, (reply, refusals)
    finally:
        sock.close(linger=0)
        context.term()
    well_behaved_check(token_server.address, 0)
