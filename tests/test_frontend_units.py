"""The frontend's parts without a server: the protocol, op table, shape inference, the worker's
executor and the dispatcher's router. Fast: no process is started."""

import pathlib
import time

import msgpack
import zmq
import numpy as np
import pytest
import torch

from paratrain.frontend.dispatcher.dispatcher import Dispatcher
from paratrain.frontend.dispatcher.router import ClientTable, Router
from paratrain.frontend.dispatcher.settings import DispatcherSettings
from paratrain.frontend.indexing import decode_index, encode_index
from paratrain.frontend.ops import validate_kwargs
from paratrain.frontend.protocol import CLIENT_HANDLES, Instruction, MalformedMessage, codec, messages
from paratrain.frontend.protocol.auth import auth_mac, auth_ok, new_nonce
from paratrain.frontend.protocol.tensors import array_from_frame
from paratrain.frontend.shapes import ShapeError, infer
from paratrain.frontend.workers.executor import Executor

TO_DISPATCHER = codec.decoder(messages.TO_DISPATCHER)


class FakeTensor:
    """What shape inference needs of a client tensor."""

    _handle = 0

    def __init__(self, shape, dtype="float32"):
        self.shape, self.dtype = tuple(shape), dtype


# ---- the protocol --------------------------------------------------------------------------

@pytest.mark.parametrize("tensor_bytes", [0, 5, codec.PIECE_BYTES - 1, codec.PIECE_BYTES, codec.PIECE_BYTES + 1,
                                          3 * codec.PIECE_BYTES, 3 * codec.PIECE_BYTES + 7])
def test_parts_travel_in_frames_no_larger_than_a_piece_and_arrive_whole(tensor_bytes):
    """A dispatcher with a token takes no frame over PIECE_BYTES (what a stranger can make it
    hold), so its peers cut a large part; a frame shorter than a piece (maybe empty) ends each."""
    data = np.random.default_rng(tensor_bytes).integers(0, 256, tensor_bytes, dtype=np.uint8)
    instruction = Instruction(1, "upload", [0], [], [], {"shape": [tensor_bytes], "dtype": "uint8", "frame": 0})
    message = messages.Run([instruction], 1, [], [data.tobytes()])
    frames = codec.encode(message, cut=True)
    assert all(memoryview(frame).nbytes <= codec.PIECE_BYTES for frame in frames)
    assert len(frames) == 2 + tensor_bytes // codec.PIECE_BYTES
    received = [bytes(frame) for frame in frames]  # as ZeroMQ delivers them
    decoded = codec.decode(received, TO_DISPATCHER, cut=True)
    assert bytes(decoded.frames[0]) == data.tobytes() and decoded.instructions == message.instructions
    assert len(codec.encode(message)) == 2  # uncut: what the dispatcher sends, and all without a token
    if tensor_bytes:
        with pytest.raises(MalformedMessage, match=f"a tensor of {tensor_bytes} bytes"):
            codec.decode(received, TO_DISPATCHER, max_part=tensor_bytes - 1, cut=True)
    if tensor_bytes >= codec.PIECE_BYTES:
        with pytest.raises(MalformedMessage, match="ends inside a part"):
            codec.decode(received[:2], TO_DISPATCHER, cut=True)  # the first piece, and no more


def test_decode_rejects_what_is_not_a_msgpack_map():
    for frame in (b"\x80\x04garbage", msgpack.packb([1, 2]), msgpack.packb({"no_type": 1}), b""):
        with pytest.raises(MalformedMessage):
            codec.decode([frame], TO_DISPATCHER)


def test_decode_never_unpickles():
    import pickle

    payload = pickle.dumps({"t": "run", "instructions": [], "sync": None, "fetch": []})
    with pytest.raises(MalformedMessage):
        codec.decode([payload], TO_DISPATCHER)


def test_decode_refuses_msgpack_extension_types():
    frame = msgpack.packb({"t": "run", "x": msgpack.ExtType(1, b"abc")})
    with pytest.raises(MalformedMessage):
        codec.decode([frame], TO_DISPATCHER)


def test_hmac_answer_depends_on_token_nonce_and_role():
    nonce = new_nonce()
    mac = auth_mac("secret", nonce, "client")
    assert auth_ok("secret", nonce, "client", mac)
    assert not auth_ok("other", nonce, "client", mac)
    assert not auth_ok("secret", new_nonce(), "client", mac)
    assert not auth_ok("secret", nonce, "worker", mac)
    assert not auth_ok("secret", nonce, "client", None)
    assert not auth_ok("secret", nonce, "client", "\u00e9" * 64)  # found by the fuzz at 10,000: was a TypeError
    assert "secret" not in mac


def test_bfloat16_frames_widen_to_float32():
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().tobytes()
    np.testing.assert_array_equal(array_from_frame(raw, "bfloat16", [3]), [1.5, -2.0, 3.25])


def test_frame_whose_size_disagrees_with_its_header_is_malformed():
    with pytest.raises(MalformedMessage, match="holds 2 elements"):
        array_from_frame(np.zeros(2, np.float32).tobytes(), "float32", [3])


def test_dispatcher_refuses_a_public_address_without_a_token():
    with pytest.raises(ValueError, match="give a token"):
        Dispatcher(DispatcherSettings("0.0.0.0", 0, 1))


def test_a_dispatcher_held_up_in_one_handler_does_not_lose_workers_whose_heartbeats_wait():
    """CI saw it: a handler blocked for seconds (the first meta op waited on the warm-up thread's
    import), then the tick found every worker silent though their heartbeats were queued. The
    dispatcher's own stall is excused and queued messages are read before anyone is judged."""
    import threading
    import time

    import zmq

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


# ---- the op table -----------------------------------------------------------------------------

def test_kwargs_outside_an_ops_allowlist_are_refused():
    assert validate_kwargs("sum", {"dim": 1, "keepdim": True}) is None
    assert "unexpected" in validate_kwargs("sum", {"out": 3})
    nested = messages.Run([Instruction(1, "sum", [1], [0], [0], {"dim": {"nested": 1}})], None, [])
    with pytest.raises(MalformedMessage, match="kwargs.dim"):
        codec.decode(codec.encode(nested), TO_DISPATCHER)


def test_index_encoding_round_trips():
    index = (slice(1, None, 2), None, Ellipsis, 3)
    assert decode_index(encode_index(index)) == index


@pytest.mark.parametrize("case", [
    ("matmul", [(4, 3), (3, 5)], {}, [((4, 5), "float32")]),
    ("add", [(4, 1), (1, 5)], {}, [((4, 5), "float32")]),
    ("sum", [(4, 5)], {"dim": 1, "keepdim": True}, [((4, 1), "float32")]),
    ("max", [(4, 5), 1], {"keepdim": False}, [((4,), "float32"), ((4,), "int64")]),
    ("chunk", [(4, 6), 3], {"dim": 1}, [((4, 2), "float32")] * 3),
    ("cross_entropy", [(8, 10), ((8,), "int64")], {}, [((), "float32")]),
])
def test_shape_inference_matches_pytorch(case):
    name, inputs, kwargs, expected = case
    args = [FakeTensor(*spec) if isinstance(spec, tuple) and isinstance(spec[0], tuple)
            else FakeTensor(spec) if isinstance(spec, tuple) else spec for spec in inputs]
    targs = [i for i, arg in enumerate(args) if isinstance(arg, FakeTensor)]
    assert infer(name, args, targs, kwargs) == expected


def test_shape_error_names_the_op_and_its_inputs():
    with pytest.raises(ShapeError, match=r"matmul\(float32\[4, 3\], float32\[5, 6\]\)"):
        infer("matmul", [FakeTensor((4, 3)), FakeTensor((5, 6))], [0, 1], {})


# ---- the executor (a worker without its sockets) ----------------------------------------------

def _run(executor, *instructions, frames=()):
    executor.run_batch(1, [Instruction(*i) for i in instructions], list(frames), None)


def _fields(*instruction):
    """An instruction from its first six fields and the flags that matter here."""
    *head, flags = instruction
    return [*head, False, bool(flags and flags.get("rg"))]


def test_executor_runs_autograd_and_an_optimizer_where_the_tensors_are():
    executor = Executor(None, torch.device("cpu"))
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    _run(executor,
         _fields(1, "upload", [0], [], [], {"dtype": "float32", "shape": [2, 3], "frame": 0}, {"rg": 1}),
         _fields(2, "sum", [1], [0], [0], {}, None),
         _fields(3, "backward", [], [1], [0], {}, None),
         _fields(4, "optim_create", [2], [0], [0], {"kind": "sgd", "lr": 0.5}, None),
         _fields(5, "optim_step", [], [2], [0], {}, None),
         frames=[memoryview(w).cast("B")])
    errors, fetched, frames = executor.collect(1, [0])
    assert errors == []
    np.testing.assert_array_equal(np.frombuffer(frames[0], np.float32).reshape(2, 3), w - 0.5)


def test_a_failed_instruction_poisons_its_results_and_reports_once():
    executor = Executor(None, torch.device("cpu"))
    _run(executor,
         _fields(1, "randn", [0], [2, 3], [], {}, None),
         _fields(2, "randint", [1], [4], [], {"low": 5, "high": 9, "dtype": None}, None),
         _fields(3, "embedding", [2], [1, 0], [0, 1], {}, None),  # indices 5..8 into 2 rows: fails
         _fields(4, "relu", [3], [2], [0], {}, None))
    errors, fetched, _ = executor.collect(1, [3])
    assert len(errors) == 1
    seq, name, shapes, worker, message = errors[0]
    assert (seq, name, shapes, worker) == (3, "embedding", ["int64[4]", "float32[2, 3]"], 0)
    assert "index out of range" in message.lower()
    assert fetched[0].dtype is None and "index out of range" in fetched[0].error.lower()


def test_drop_forgets_only_that_clients_tensors():
    executor = Executor(None, torch.device("cpu"))
    executor.run_batch(1, [Instruction(1, "ones", [0], [3], [], {})], [], None)
    executor.run_batch(2, [Instruction(1, "ones", [0], [3], [], {})], [], None)
    executor.forget(1)
    assert executor.collect(2, [0])[1][0].dtype == "float32"
    assert executor.collect(1, [0])[1][0].dtype is None


# ---- the router (the dispatcher's placement) ------------------------------------------------------

def _router(workers=2):
    return Router(workers, lambda w: True)


def _wire(seq, op, outs, args, targs, kwargs, flags=None):
    """An instruction's wire form, from the old seven fields (flags: w, rg)."""
    flags = flags or {}
    return [seq, op, outs, args, targs, kwargs, False, bool(flags.get("rg")), flags.get("w"), None, None]


def _route(router, table, *instructions):
    """Instructions as the dispatcher sees them: decoded (and checked) by the protocol, then
    routed; -> (streams, errors). A message the protocol refuses raises MalformedMessage."""
    raw = [_wire(*i) if isinstance(i, tuple) else i for i in instructions]
    run = codec.decode(codec.encode(messages.Run(raw, None, [])), TO_DISPATCHER)
    routed = router.route(table, run.instructions, run.frames)
    return routed.streams, routed.errors


def test_creation_follows_the_clients_placement_and_ops_follow_their_first_input():
    router, table = _router(), ClientTable(slot=1, home=0)
    streams, errors = _route(router, table,
                             (1, "randn", [0], [4], [], {}),
                             (2, "randn", [1], [4], [], {}, {"w": 1}),
                             (3, "add", [2], [1, 0], [0, 1], {}))  # runs on worker 1; handle 0 moves there
    assert errors == []
    assert [i.op for i in streams[0]] == ["randn", "send"]
    assert [i.op for i in streams[1]] == ["randn", "recv", "add", "free"]
    temp = streams[1][1].outs[0]
    assert temp >= CLIENT_HANDLES and streams[1][2].args == [1, temp]
    assert table.where[2].workers == (1,) and table.where[2].split is None


def test_backward_across_workers_exchanges_gradients_newest_crossing_first():
    router, table = _router(), ClientTable(slot=1, home=0)
    streams, _ = _route(router, table,
                        (1, "randn", [0], [4], [], {}, {"rg": 1}),
                        (2, "randn", [1], [4], [], {}, {"w": 1, "rg": 1}),
                        (3, "mul", [2], [1, 0], [0, 1], {}),  # on 1, crossing 0: worker 0 -> 1
                        (4, "relu", [3], [0], [0], {}),
                        (5, "add", [4], [3, 2], [0, 1], {}),  # on 0, crossing 1: worker 1 -> 0
                        (6, "sum", [5], [4], [0], {}),
                        (7, "backward", [], [5], [0], {}))
    ops0 = [(i.op, i.kwargs.get("crossing")) for i in streams[0]]
    ops1 = [(i.op, i.kwargs.get("crossing")) for i in streams[1]]
    assert ops0[-3:] == [("backward", None), ("bw_send", 1), ("bw_recv", 0)]
    assert ops1[-2:] == [("bw_recv", 1), ("bw_send", 0)]
    assert streams[0][-3].kwargs["retain_graph"] is True


def test_freeing_the_last_handle_of_a_graph_releases_its_crossings():
    router, table = _router(), ClientTable(slot=1, home=0)
    _route(router, table,
           (1, "randn", [0], [4], [], {}, {"rg": 1}),
           (2, "randn", [1], [4], [], {}, {"w": 1}),
           (3, "add", [2], [1, 0], [0, 1], {}))
    assert len(router.crossings) == 1
    streams, _ = _route(router, table, (4, "free", [], [2], [], {}))
    assert router.crossings == {}
    assert [i.op for i in streams[0]] == ["release"]
    assert sorted(i.op for i in streams[1]) == ["free", "release"]


@pytest.mark.parametrize("instruction, reason", [
    ((1, "os.system", [0], [], [], {}), "unknown operation"),
    ((1, "send", [], [0], [0], {}), "unknown operation"),  # dispatcher-only
    ((1, "relu", [1], [99], [0], {}), "not a tensor of this client"),
    ((1, "sum", [1], [0], [0], {"out": 1}), "no keyword argument 'out'"),
    ((1, "relu", [0], [0], [0], {}), "already in use"),
    ((1, "relu", [1], [0], [5], {}), "targs[0]"),
    ("not a list", "an instruction is a list"),
])
def test_bad_instructions_are_refused_with_a_reason(instruction, reason):
    """By the protocol when malformed (naming the field), by the router when they name handles
    this client does not have."""
    router, table = _router(), ClientTable(slot=1, home=0)
    _route(router, table, (0, "randn", [0], [2], [], {}))
    try:
        streams, errors = _route(router, table, instruction)
    except MalformedMessage as error:
        assert reason in str(error)
        return
    assert len(errors) == 1 and reason in errors[0].message
    assert not streams


def test_results_of_a_refused_instruction_are_skipped_without_a_second_error():
    router, table = _router(), ClientTable(slot=1, home=0)
    _, errors = _route(router, table,
                       (1, "relu", [1], [99], [0], {}),
                       (2, "exp", [2], [1], [0], {}))
    assert len(errors) == 1 and table.refused[2] == table.refused[1]


# ---- signal configurations ----------------------------------------------------------------------

def test_every_problem_of_a_configuration_gets_its_own_line():
    from paratrain.frontend.signals import ConfigError, parse

    config = {
        "good": {"shard": {"axis": 1, "workers": [0, 1]}, "backward": "also_good"},
        "also_good": {"workers": [0, 1]},
        "typo": {"wokers": [0]},
        "far": {"shard": {"axis": 0, "workers": [0, 9]}},
        "dangling": {"workers": [1], "backward": "missing"},
    }
    with pytest.raises(ConfigError) as refused:
        parse(config, n_workers=4)
    problems = refused.value.problems
    assert "typo: unknown key 'wokers' (valid: backward, compile, shard, workers)" in problems
    assert "far: worker(s) [9] do not exist: there are 4 (0..3)" in problems
    # a backward naming no signal is not a problem here: registration is order-free, and the
    # name is looked up when a tensor first crosses into the region
    assert len(problems) == 2


def test_gt_keys_every_worker_replicated_and_compile():
    from paratrain.frontend.signals import parse

    parsed = parse({"all": {"shard": {"axis": 0, "workers": None}},
                    "copies": {"shard": {"axis": 0, "workers": None, "replicated": True}},
                    "compiled": {"compile": True},
                    "default_axis": {"shard": {"workers": [1]}}}, n_workers=3)
    assert parsed["all"].workers == (0, 1, 2) and parsed["all"].axis == 0
    assert parsed["copies"].workers == (0, 1, 2) and parsed["copies"].axis is None
    assert parsed["compiled"].workers == () and parsed["compiled"].compile  # places nothing
    assert parsed["default_axis"].axis == 0 and parsed["default_axis"].workers == (1,)


def test_the_seeds_schema_parses_with_replicated_and_split_signals():
    from paratrain.frontend.signals import parse

    parsed = parse({"pp_stage0": {"workers": [0, 1]},
                    "pp_stage0_colpar": {"shard": {"axis": 1, "workers": [0, 1]}}}, n_workers=2)
    assert parsed["pp_stage0"].axis is None and parsed["pp_stage0_colpar"].axis == 1


def test_explain_draws_the_seed_demo_as_four_stages_of_two():
    from click.testing import CliRunner

    from paratrain.cli import main

    config = pathlib.Path(__file__).parent.parent / "examples" / "tuning_demo" / "sharding_config.yaml"
    result = CliRunner().invoke(main, ["frontend", "explain", str(config)])
    assert result.exit_code == 0, result.output
    assert "pp_stage0_colpar  [0, 1]" in result.output and "split along axis -1, 2 parts" in result.output
    assert "4 pipeline stage(s) x 2-way tensor parallelism = 8 workers" in result.output
    assert "stage 3         w6      w7" in result.output


def test_explain_refuses_a_bad_file_with_its_lines(tmp_path):
    from click.testing import CliRunner

    from paratrain.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("a: {workers: [0], shard: {axis: 12}}\n")
    result = CliRunner().invoke(main, ["frontend", "explain", str(bad)])
    assert result.exit_code == 2 and "a: shard.axis must be an integer in [-8, 8), got 12" in result.output


def test_explain_says_where_a_regions_backward_runs():
    from paratrain.frontend.explain import describe
    from paratrain.frontend.signals import parse

    lines = "\n".join(describe(parse({
        "fwd": {"workers": [0, 1], "backward": "bwd"}, "bwd": {"workers": [2, 3]},
        "into": {"workers": [2, 3], "backward": "split"}, "split": {"shard": {"axis": 0, "workers": [2, 3]}},
    }, n_workers=4)))
    assert "backward on [2, 3] (bwd)" in lines  # the region's backward runs elsewhere (twins)
    assert "gradients back as split" in lines  # same workers: how moved tensors' gradients travel


# ---- the worker's two threads: an exception in a message fails that message, not the worker -------

class _Doomed(BaseException):
    """What no `except Exception` catches: it ends the executor thread."""


def _worker_loop(sock=None, context=None):
    from paratrain.frontend.workers.worker import _WorkerLoop

    return _WorkerLoop(sock, context or zmq.Context.instance(), Executor(None, torch.device("cpu")), None)


def test_a_message_whose_handling_raises_fails_its_sync_and_the_executor_runs_on(monkeypatch):
    import threading

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


def test_the_gt_comparison_exits_1_when_a_test_passing_on_gt_does_not_pass_here():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gt_tests", pathlib.Path(__file__).resolve().parent.parent / "compat" / "gt_tests.py")
    gt_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gt_tests)
    both = ("test_a.py", {"t1": "PASSED", "t2": "FAILED"}, {"t1": "PASSED", "t2": "FAILED"})
    assert gt_tests.exit_status([both]) == 0  # failing on GT too says nothing of us
    assert gt_tests.exit_status([both, ("test_b.py", {"t3": "PASSED"}, {"t3": "FAILED"})]) == 1
    assert gt_tests.exit_status([("test_c.py", {"t4": "PASSED"}, {})]) == 1  # did not run here at all


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
    import zmq
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
