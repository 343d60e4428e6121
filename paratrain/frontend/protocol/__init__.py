"""The frontend's protocol: every message between client, dispatcher and worker.

Three kinds of process talk over ZeroMQ (pyzmq): clients (the user's program), one dispatcher
(`paratrain serve`: a ROUTER socket every peer connects to) and workers (`paratrain worker`),
plus monitors (`paratrain top`). Each message is a class in `messages.py`; `codec.encode` and
`codec.decode` are the only code that packs or unpacks one, and decoding checks every field
(type, range, size) so that no code past it sees a malformed value.

    message         from -> to                what it says
    -------------   -----------------------   ---------------------------------------------------
    Hello           peer -> dispatcher        role (client/worker/monitor), protocol version, pid,
                                              program name, host, device, a launcher's rank
    Challenge       dispatcher -> peer        a nonce: answer HMAC(token, nonce || role) (token set)
    Auth            peer -> dispatcher        that answer
    Refused         dispatcher -> peer        not admitted, or a client dropped; the reason
    Waiting         dispatcher -> worker      admitted; the world forms when all have come
    WorkerWelcome   dispatcher -> worker      its rank and world size; the store to meet at
    ClientWelcome   dispatcher -> client      its number, home worker, heartbeat secret, limits
    MonitorWelcome  dispatcher -> monitor     admitted
    Run             client -> dispatcher      instructions (+ upload frames); a sync token, fetches
    Synced          dispatcher -> client      all up to the token ran: errors, fetched tensors
    Configure       client -> dispatcher      a signal configuration (GT's YAML schema)
    Configured      dispatcher -> client      its signal names (or Error, one problem a line)
    Error           dispatcher -> peer        a message it could not take, naming the field
    Bye             client -> dispatcher      leaving: free my tensors
    Alive           client -> dispatcher      heartbeat (its own connection), with the secret
    WorkerStatsRequest client -> dispatcher   each worker's statistics (gt.debug) ...
    WorkerStats     dispatcher -> client      ... as of a heartbeat sent after the request
    StatsRequest    monitor -> dispatcher     what `paratrain top` shows ...
    Stats           dispatcher -> monitor     ... per worker and per client
    TraceRequest    monitor -> dispatcher     instruction-log lines from a number on; keep recording
    TraceEvents     dispatcher -> monitor     those lines (`paratrain frontend trace --live`)
    Tasks           dispatcher -> worker      one client's instructions (+ upload frames); a sync after them
    Collect         dispatcher -> worker      report a client's errors and fetched values
    Collected       worker -> dispatcher      that report (+ tensor frames)
    Forget          dispatcher -> worker      a client left: free its tensors
    Ping            dispatcher -> worker      the dispatcher is alive
    Exit            dispatcher -> worker      stop serving
    Heartbeat       worker -> dispatcher      alive; operations run (in all, per operation), busy
                                              time, queue, memory
    Timings         worker -> dispatcher      when each logged instruction ran
    Leaving         worker -> dispatcher      it can serve no more (its executor ended): lose it now

An instruction (`instructions.py`) is one operation of the table in `ops.py`, on handles: the
same type from client to dispatcher and from dispatcher to worker. Tensor bytes never travel
inside a header; they follow it as raw frames (`tensors.py`). Authentication (`auth.py`)
proves a shared token without sending it; joining (`handshake.py`) is the peer's side of it.
"""

from paratrain.frontend.protocol import messages
from paratrain.frontend.protocol.codec import decode, decoder, encode
from paratrain.frontend.protocol.fields import MalformedMessage
from paratrain.frontend.protocol.instructions import CLIENT_HANDLES, Instruction
from paratrain.frontend.protocol.messages import VERSION

__all__ = ["CLIENT_HANDLES", "Instruction", "MalformedMessage", "VERSION", "decode", "decoder", "encode", "messages"]
