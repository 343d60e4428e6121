"""The frontend's errors, each raised where it belongs, and a dispatcher that serves on: shape
errors at the line that made them, worker errors at the next sync naming the operation, its
inputs, the worker and the line; foreign handles, unknown operations, malformed and oversized
messages; clients that leave or die have their tensors freed."""

import time

import numpy as np
import pytest

import paratrain.frontend as gt
from frontend_helpers import forked_program, raw_client, raw_sync, reply_to, wait_until
from paratrain.frontend.client.autostart import LocalServer
from paratrain.frontend.protocol import Instruction, codec, messages


def test_shape_errors_raise_at_the_line_that_made_them(client):
    a, b = gt.randn(4, 3), gt.randn(5, 6)
    session = gt.session()
    queued = len(session._batch)
    with pytest.raises(gt.ShapeError, match=r"matmul\(float32\[4, 3\], float32\[5, 6\]\)"):
        a @ b  # noqa: B018 - raises here, not at a later sync
    assert len(session._batch) == queued  # nothing was sent for it


def test_worker_errors_surface_at_the_next_sync_naming_op_inputs_worker_and_line(client):
    logits = gt.randn(4, 10, requires_grad=True)
    targets = gt.tensor([1, 2, 30, 4], dtype="int64")
    loss = gt.cross_entropy(logits, targets); line = _line()  # noqa: E702 - the line to name
    loss.backward()  # skipped quietly on the worker: its input failed
    with pytest.raises(gt.RemoteError) as caught:
        loss.item()
    message = str(caught.value)
    assert "cross_entropy(float32[4, 10], int64[4])" in message
    assert "worker 0" in message and f"test_frontend_errors.py:{line}" in message
    assert "out of bounds" in message
    assert (gt.ones(2) * 3).sum().item() == 6.0  # the session goes on


def _line():
    import inspect

    return inspect.currentframe().f_back.f_lineno


def test_tensors_of_another_session_are_refused(client, server):
    other = gt.Session(server.address)
    try:
        theirs = other.call("ones", [3], {"dtype": None})[0]
        with pytest.raises(ValueError, match="another client"):
            gt.ones(3) + theirs
    finally:
        other.close()


def test_a_client_can_neither_read_nor_free_another_clients_tensors(client, server):
    mine = gt.randn(8)
    expected = mine.numpy()
    with raw_client(server.address) as (sock, _):
        reply = raw_sync(sock, [Instruction(1, "free", [], [mine._handle], [], {})], fetch=[mine._handle])
        assert reply.fetched[0].dtype is None and "not a tensor of this client" in reply.fetched[0].error
        reply = raw_sync(sock, [Instruction(2, "relu", [5], [mine._handle], [0], {})], token=10_001)
        assert "not a tensor of this client" in reply.errors[0].message
    np.testing.assert_array_equal(mine.numpy(), expected)


@pytest.mark.parametrize("instruction, reason", [
    ([1, "os.system", [0], ["ls"], [], {}, False, False, None, None, None], "unknown operation 'os.system'"),
    ([1, "randn", [0], [2], [], {"device": "cuda"}, False, False, None, None, None], "no keyword argument 'device'"),
    (["x"], "an instruction is a list of 11 fields"),
])
def test_bad_instructions_get_an_error_and_the_dispatcher_serves_on(client, server, instruction, reason):
    with raw_client(server.address) as (sock, _):
        sock.send_multipart(codec.encode(messages.Run([instruction], 1, [])))
        reply = reply_to(sock)
        assert isinstance(reply, messages.Error) and reason in reply.message and "run.instructions[0]" in reply.message
        reply = raw_sync(sock, [Instruction(2, "ones", [0], [2], [], {})], fetch=[0])
        assert reply.errors == [] and reply.fetched[0].shape == [2]
    assert gt.ones(3).sum().item() == 3.0


@pytest.mark.parametrize("frame", [b"\x80\x04 not msgpack", b"\x93\x01\x02\x03"])
def test_malformed_messages_get_an_error_reply_and_nothing_breaks(client, server, frame):
    with raw_client(server.address) as (sock, _):
        sock.send(frame)
        reply = reply_to(sock, 10_000)
        assert isinstance(reply, messages.Error) and "malformed" in reply.message
        reply = raw_sync(sock, [Instruction(1, "ones", [0], [2], [], {})], fetch=[0])
        assert reply.errors == []
    assert gt.ones(3).sum().item() == 3.0


def _once_counted(held, baseline: int) -> int:
    """The worker's memory once it counts a new 4 MiB tensor: once the figure is 4 MiB above the
    baseline, or after two of the worker's heartbeats (0.5 s apart), whichever comes first: a
    tensor of an earlier test's departing client, freed meanwhile, can keep the figure under the
    baseline plus 4 MiB (a CI run saw that)."""
    two_heartbeats = time.monotonic() + 1.2

    def counted():
        memory = held()
        return memory if memory - baseline >= 4 * 1024 * 1024 or time.monotonic() >= two_heartbeats else None
    return wait_until(counted, 15, "the new 4 MiB counted")


def test_a_departed_client_has_its_tensors_freed(client, server):
    from paratrain.frontend.top import Monitor

    monitor = Monitor(server.address)
    try:
        def held():
            return monitor.stats().workers[0].memory

        baseline = held()
        other = gt.Session(server.address)
        big = other.call("zeros", [1024, 1024], {"dtype": None})[0]
        other.sync()
        before = _once_counted(held, baseline)
        other.close()
        del big
        wait_until(lambda: before - held() >= 4 * 1024 * 1024, 15, "the departed client's 4 MiB freed")
    finally:
        monitor.close()


@pytest.fixture(scope="module")
def quick_drop_server():
    """A dispatcher that drops a client after 2 s without a heartbeat (two of its heartbeats): a
    killed client is dropped soon. Only the killed client's test uses it, so no healthy client of
    a loaded host risks being dropped."""
    srv = LocalServer.start(1, extra_args=("--client-timeout", "2"))
    yield srv
    srv.stop()


def _client_holding_4_mib(address: str, channel) -> None:
    """A client program: makes a 4 MiB tensor, says so, and waits to be killed."""
    import time

    session = gt.Session(address)
    x = session.call("zeros", [1024, 1024], {"dtype": None})[0]
    x.sum().item()
    channel.send("ready")
    time.sleep(60)


def test_a_killed_client_has_its_tensors_freed_after_its_heartbeats_stop(quick_drop_server):
    import multiprocessing

    from paratrain.frontend.top import Monitor

    server = quick_drop_server
    monitor = Monitor(server.address)
    baseline = monitor.stats().workers[0].memory
    ours, theirs = multiprocessing.Pipe()
    child = forked_program(_client_holding_4_mib, server.address, theirs)
    try:
        assert ours.poll(60) and ours.recv() == "ready"
        assert any(c.tensors >= 1 for c in monitor.stats().clients)
        held = _once_counted(lambda: monitor.stats().workers[0].memory, baseline)
        child.kill()  # SIGKILL
        child.join(10)
        # The server's --client-timeout is 2 s; then a heartbeat reports the memory.
        wait_until(lambda: held - monitor.stats().workers[0].memory >= 4 * 1024 * 1024, 30,
                   "the killed client's 4 MiB freed")
    finally:
        monitor.close()
        child.kill()
        child.join(10)


def test_uploads_over_the_message_limit_fail_at_the_client_and_oversized_messages_are_dropped(client, server):
    with pytest.raises(ValueError, match="over the server's message limit of 1 MiB"):
        gt.from_numpy(np.zeros((600, 600), np.float32))  # 1.4 MiB
    with raw_client(server.address) as (sock, _):
        sock.send(b"x" * (2 << 20))  # ZeroMQ drops the connection that sent it
        assert not sock.poll(1500)
    assert gt.from_numpy(np.ones((10, 10), np.float32)).sum().item() == 100.0


def test_bench_frontend_reports_both_times_and_writes_records(server, tmp_path):
    import json

    from click.testing import CliRunner

    from paratrain.cli import main as paratrain_cli

    out = tmp_path / "frontend.json"
    result = CliRunner().invoke(paratrain_cli, ["bench", "frontend", "--server", server.address, "--sizes", "8x16,4x8",
                                                "--repeats", "1", "--steps", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "one streamed instruction" in result.output and "ratio" in result.output
    records = json.loads(out.read_text())
    assert [(r["batch"], r["hidden"]) for r in records] == [(8, 16), (4, 8)]
    for record in records:
        assert {"workers", "frontend_ms", "torch_ms", "ratio"} <= set(record)
        assert record["frontend_ms"] > 0 and record["torch_ms"] > 0
        assert record["ratio"] == pytest.approx(record["frontend_ms"] / record["torch_ms"])


@pytest.mark.parametrize("make", [
    lambda: gt.from_numpy(np.arange(32, dtype=np.float32).reshape(8, 4))[8:],
    lambda: gt.zeros((0, 4)),
    lambda: gt.zeros((4, 0)),
    lambda: gt.ones((0,), dtype="int64"),
    lambda: gt.zeros((2, 0, 3), dtype="bfloat16"),
], ids=["a slice past the end", "(0, 4)", "(4, 0)", "int64 (0,)", "bfloat16 (2, 0, 3)"])
def test_empty_tensors_round_trip_and_the_worker_serves_on(client, make):
    value = make()
    assert value.numpy().shape == tuple(value.shape) and value.numpy().size == 0
    assert (gt.ones(3) * 2).sum().item() == 6.0


def test_an_empty_shape_numpy_cannot_hold_is_one_error_and_the_worker_serves_on(client):
    with pytest.raises(ValueError, match=r"numpy cannot hold a float32 array of shape \[0, 9223372036854775807\]"):
        gt.zeros((0, 2**63 - 1)).numpy()
    assert (gt.ones(3) * 2).sum().item() == 6.0


def test_reading_more_than_one_message_carries_is_one_error_and_the_worker_serves_on(client, server):
    big = gt.ones((600, 600))  # 1.4 MiB; the test server takes messages of at most 1 MiB
    with pytest.raises(gt.FrontendError, match=r"it is 1.4 MiB and one message carries at most 1 MiB"):
        big.numpy()
    assert big[:100].numpy().sum() == 60_000.0  # the same tensor, read in slices
    assert server.process.poll() is None
    assert (gt.ones(3) * 2).sum().item() == 6.0
