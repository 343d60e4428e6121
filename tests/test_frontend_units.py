"""The frontend's parts without a server: the protocol, the op table and shape inference, the
worker's executor. Fast: no process is started. (The router: test_frontend_router.py; signal
configurations: test_frontend_signal_configs.py; a process's own trouble:
test_frontend_resilience.py.)"""

import pathlib

import msgpack
import numpy as np
import pytest
import torch

from paratrain.frontend.dispatcher.dispatcher import Dispatcher
from paratrain.frontend.dispatcher.serve_options import DispatcherSettings
from paratrain.frontend.indexing import decode_index, encode_index
from paratrain.frontend.ops import validate_kwargs
from paratrain.frontend.protocol import Instruction, MalformedMessage, codec, messages
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


# ---- compat/gt_tests.py ---------------------------------------------------------------------------

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
