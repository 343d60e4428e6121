"""A frontend process survives its own trouble: a dispatcher held up in one handler keeps the
workers whose heartbeats wait; a worker message whose handling raises fails that message only,
and a worker whose executor thread ends says it is leaving; a dispatcher says when its file
descriptors run short, and shuts connections that never join."""

import threading
import time

import pytest
import torch
import zmq

from paratrain.frontend.dispatcher.dispatcher import Dispatcher
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.protocol import codec, messages
from paratrain.frontend.workers.executor import Executor

TO_DISPATCHER = codec.decoder(messages.TO_DISPATCHER)


def test_a_dispatcher_held_up_in_one_handler_does_not_lose_workers_whose_heartbeats_wait():
    """CI saw it: a handler blocked for seconds (the first meta op waited on the warm-up thread's
    import), then the tick found every worker silent though their heartbeats were queued. The
    dispatcher's own stall is excused and queued messages are read before anyone is judged."""
    from paratrain.frontend.dispatcher.peers import WorkerState

    dispatcher = Dispatcher(DispatcherSettings("127.0.0.1", 0, 2, worker_timeout=1.0, quiet=True))
    context = zmq.Context.instance()
    sockets = []
    for rank in range(2):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"fake-worker-%d" % rank)
        sock.connect(f"tcp://127.0.0.1:{dispatcher.port}")
        sockets.append(sock)
        hello = messages.Hello("worker", 1, 1, "fake", "localhost", "cpu", rank)
        dispatcher.peers.add_worker(WorkerState(b"fake-worker-%d" % rank, rank, hello, time.monotonic(),
                                                serving=True))
    real, held = dispatcher.handlers[("worker", messages.Heartbeat)], []

    def held_up_once(worker, beat):
        if not held:
            held.append(worker.rank)
            time.sleep(2.0)  # two worker timeouts
        real(worker, beat)

    dispatcher.handlers[("worker", messages.Heartbeat)] = held_up_once
    stop = threading.Event()
    loop = threading.Thread(target=dispatcher.serve, args=(stop.is_set,))
    loop.start()
    try:
        until = time.monotonic() + 4.0  # the stall, then two ticks that judge the workers
        while time.monotonic() < until:
            for sock in sockets:
                sock.send_multipart(codec.encode(messages.Heartbeat(0, 0.0, 0, 0, {})))
            time.sleep(0.2)
        assert held, "the held-up handler never ran"
        assert dispatcher.failure is None
        assert [w.lost for w in dispatcher.peers.workers.values()] == [None, None]
    finally:
        stop.set()
        loop.join(10)
        for sock in sockets:
            sock.close(linger=0)


# ---- the worker's two threads: an exception in a message fails that message, not the worker -------

class _Doomed(BaseException):
    """What no `except Exception` catches: it ends the executor thread."""


def _worker_loop(sock=None, context=None):
    from paratrain.frontend.workers.worker import _WorkerLoop

    return _WorkerLoop(sock, context or zmq.Context.instance(), Executor(None, torch.device("cpu")), None)


def test_a_message_whose_handling_raises_fails_its_sync_and_the_executor_runs_on(monkeypatch):
    loop = _worker_loop()
    wake = loop.context.socket(zmq.PULL)
    wake.bind(f"inproc://wake-{id(loop)}")
    broken = {"on": True}

    def run_batch(*args):
        if broken["on"]:
            raise RuntimeError("a bug in the executor")
    monkeypatch.setattr(loop.executor, "run_batch", run_batch)
    runner = threading.Thread(target=loop._execute_forever, args=(f"inproc://wake-{id(loop)}",), daemon=True)
    runner.start()
    try:
        loop.inbox.put(codec.encode(messages.Tasks(3, [], False, 7, [5])))
        reply = codec.decode(loop.outbox.get(timeout=10), TO_DISPATCHER)
        assert isinstance(reply, messages.Collected) and (reply.slot, reply.token) == (3, 7)
        assert reply.errors[0].message == "worker 0 could not handle a tasks: RuntimeError: a bug in the executor"
        assert reply.fetched[0].dtype is None and "a bug in the executor" in reply.fetched[0].error
        broken["on"] = False
        loop.inbox.put(codec.encode(messages.Tasks(3, [], False, 8, [])))  # the next message runs
        reply = codec.decode(loop.outbox.get(timeout=10), TO_DISPATCHER)
        assert (reply.token, reply.errors) == (8, [])
        assert runner.is_alive()
    finally:
        loop.inbox.put(None)
        runner.join(10)
        wake.close(linger=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's end is the point
def test_a_worker_whose_executor_thread_ends_tells_the_dispatcher_it_is_leaving(monkeypatch):
    context = zmq.Context()
    dispatcher = context.socket(zmq.ROUTER)
    port = dispatcher.bind_to_random_port("tcp://127.0.0.1")
    sock = context.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    loop = _worker_loop(sock, context)

    def doomed(message):
        raise _Doomed("the thread's last words")
    monkeypatch.setattr(loop, "_execute", doomed)
    loop.inbox.put(codec.encode(messages.Tasks(3, [], False, None, [])))
    try:
        loop.run()  # returns: a worker without its executor serves no more
        kinds = []
        while dispatcher.poll(2000):
            kinds.append(reply := codec.decode(dispatcher.recv_multipart()[1:], TO_DISPATCHER))
            if isinstance(reply, messages.Leaving):
                break
        assert isinstance(kinds[-1], messages.Leaving)
        assert kinds[-1].reason == "its executor thread ended (_Doomed: the thread's last words)"
    finally:
        for socket in (sock, dispatcher):
            socket.close(linger=0)
        context.term()


def test_the_dispatcher_says_when_its_file_descriptors_run_short_once_a_minute():
    from paratrain.frontend.dispatcher.descriptors import Descriptors, in_use

    used, limit = in_use()  # this process's, as the dispatcher reads its own
    assert 0 < used < limit
    level = {"used": 10}
    watch = Descriptors(read=lambda: (level["used"], 100))
    assert watch.check(0.0) is None
    level["used"] = 85
    assert watch.check(1.0).startswith("85 of 100 file descriptors in use")
    assert watch.check(2.0) is None and watch.check(60.9) is None  # not every tick
    assert watch.check(61.5).startswith("85 of 100")
    level["used"] = 20
    assert watch.check(62.0) is None
    level["used"] = 90
    assert watch.check(63.0).startswith("90 of 100")  # a new crossing is said at once


def test_connections_that_never_join_are_shut_and_at_most_a_cap_kept(monkeypatch):
    """Issue 37 item 5: a connection that says nothing held a descriptor forever. Here: silent
    connections are shut after JOIN_S of the dispatcher's time, the oldest beyond the cap at
    once, and one whose peer joined is kept."""
    from zmq.utils.monitor import recv_monitor_message

    from paratrain.frontend.dispatcher import connections as module

    monkeypatch.setattr(module, "MAX_UNJOINED", 2)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tracked = module.Connections(router)
    peers, watches = [], []
    try:
        for _ in range(5):
            peer = context.socket(zmq.DEALER)
            watches.append(peer.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            peer.connect(f"tcp://127.0.0.1:{port}")
            peers.append(peer)
            time.sleep(0.1)  # accepted in this order
        peers[0].send(b"hello")  # the first one's peer joins
        assert router.poll(5000)
        frames = router.recv_multipart(copy=False)
        deadline = time.monotonic() + 5
        while len(tracked.unjoined) < 5 and time.monotonic() < deadline:
            tracked.read_events(0.0)
            time.sleep(0.05)
        assert len(tracked.unjoined) == 5
        tracked.joined(frames[0], 0.0)
        said = tracked.shut_unjoined(1.0)  # 4 unjoined, at most 2: the 2 oldest go
        assert [kind for kind, _ in said] == ["unjoined cap"] and "closed the 2 oldest" in said[0][1]
        said = tracked.shut_unjoined(module.JOIN_S + 1)  # the rest, late
        assert [kind for kind, _ in said] == ["unjoined"] and "closed 2 connection(s)" in said[0][1]

        def dropped(watch) -> bool:
            return watch.poll(3000) and recv_monitor_message(watch)["event"] == zmq.EVENT_DISCONNECTED
        assert [dropped(watch) for watch in watches[1:]] == [True] * 4
        assert not watches[0].poll(500), "the joined peer's connection was shut"
    finally:
        tracked.close()
        for peer in peers:
            peer.close(linger=0)
        for watch in watches:
            watch.close(linger=0)
        router.close(linger=0)
        context.term()
