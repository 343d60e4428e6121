"""gt.debug and GT's tools: the tape holds what the client issued; worker statistics count each
instruction on the worker that ran it; `paratrain serve -p`, `python -m paratrain.frontend.server`
and `python -m paratrain.frontend.worker` start and stop cleanly; the instruction log has GT's
columns (sequence numbers, sizes, send/receive events); `trace --png` draws a PNG and
`trace --live` captures a running dispatcher's events."""

import importlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

import paratrain.frontend as gt
from frontend_helpers import free_port, paratrain_command, stop, wait_until
from paratrain.cli import main as paratrain_cli
from paratrain.frontend.client.autostart import LocalServer, wait_until_ready
from paratrain.frontend.monitor import Monitor
from paratrain.lifetime import process_alive
from paratrain.frontend.protocol import MalformedMessage, codec, messages
from paratrain.frontend.protocol.handshake import receive
from paratrain.frontend.trace import parse_line, read_events, read_log

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Two workers, writing an instruction log."""
    log = tmp_path_factory.mktemp("debug") / "instructions.log"
    server = LocalServer.start(2, extra_args=("--instruction-log", str(log)))
    server.log = log
    yield server
    server.stop()


@pytest.fixture
def client(logged):
    gt.connect(logged.address)
    yield gt.session()
    gt.disconnect()


# ---- gt.debug ----------------------------------------------------------------------------------

def test_without_a_session_debug_says_so_and_starts_nothing():
    assert not gt.connected()
    assert gt.debug.get_tape() == []
    assert "error" in gt.debug.get_worker_stats()
    assert not gt.connected()


def test_the_tape_holds_each_issued_instruction_with_its_ids_op_and_shapes(client):
    a = gt.randn(4, 3, requires_grad=True)
    b = gt.from_numpy(np.ones((3, 5), np.float32))
    c = (a @ b).relu()
    tape = gt.debug.get_tape()[-4:]
    assert [entry["op"] for entry in tape] == ["randn", "upload", "matmul", "relu"]
    assert [entry["grad_fn"] for entry in tape] == [entry["op"] for entry in tape]
    assert tape[0]["output_id"] == a._handle and tape[0]["output_shape"] == (4, 3) and tape[0]["requires_grad"]
    assert tape[1]["output_id"] == b._handle and tape[1]["output_shape"] == (3, 5) and not tape[1]["requires_grad"]
    matmul, relu = tape[2], tape[3]
    assert matmul["input_ids"] == [a._handle, b._handle] and matmul["output_shape"] == (4, 5)
    assert relu["input_ids"] == [matmul["output_id"]] and relu["output_id"] == c._handle
    assert relu["requires_grad"] and relu["dtype"] == "float32"
    assert [entry["seq"] for entry in tape] == sorted(entry["seq"] for entry in tape)


def test_print_tape_shows_the_instructions(client, capsys):
    x = gt.randn(2, 2)
    y = x + x
    gt.debug.print_tape()
    out = capsys.readouterr().out
    assert f"Tensor[{y._handle}] = add(Tensor[{x._handle}], Tensor[{x._handle}])  shape=(2, 2)" in out


def test_worker_stats_count_each_operation_on_the_worker_that_ran_it(client):
    before = gt.debug.get_worker_stats()
    assert sorted(before) == ["worker_0", "worker_1"]
    with gt.worker(1):
        x = gt.randn(8, 8)
    for _ in range(5):
        x = x @ x
    x = x.tanh()
    after = gt.debug.get_worker_stats()  # no sleep: the answer waits for a heartbeat sent after the sync

    def ran(stats, worker, op):
        return stats[worker]["operations"]["by_op"].get(op, 0)

    assert ran(after, "worker_1", "matmul") - ran(before, "worker_1", "matmul") == 5
    assert ran(after, "worker_1", "tanh") - ran(before, "worker_1", "tanh") == 1
    assert ran(after, "worker_1", "randn") - ran(before, "worker_1", "randn") == 1
    assert after["worker_0"]["operations"]["total"] == before["worker_0"]["operations"]["total"]
    one = after["worker_1"]
    assert one["operations"]["total"] - before["worker_1"]["operations"]["total"] >= 7
    assert one["operations"]["total"] == sum(one["operations"]["by_op"].values()) == one["operations"]["eager"]
    assert one["alive"] and one["rank"] == 1 and one["device"] == "cpu" and one["busy_s"] > 0
    assert one["queue"] == 0 and process_alive(one["pid"])


def test_print_worker_stats_names_every_worker_and_its_operations(client, capsys):
    with gt.worker(0):
        gt.randn(3).sum().item()
    gt.debug.print_worker_stats()
    out = capsys.readouterr().out
    assert "2 worker(s)" in out and "worker_0:" in out and "worker_1:" in out and " randn" in out


def test_a_worker_stats_request_is_a_typed_message_a_monitor_may_not_send(logged):
    header = codec.encode(messages.WorkerStatsRequest())
    assert isinstance(codec.decode(header, codec.decoder(messages.TO_DISPATCHER)), messages.WorkerStatsRequest)
    bad = codec.encode(messages.WorkerStats([[0, "h", 1, "cpu", True, 3, 0.5, 0, 0, {"add": -1}]]))
    with pytest.raises(MalformedMessage, match=r"workers.*add"):
        codec.decode(bad, codec.decoder(messages.TO_CLIENT))
    with pytest.raises(MalformedMessage, match="keep_s"):
        codec.decode(codec.encode(messages.TraceRequest(0, 600.0)), codec.decoder(messages.TO_DISPATCHER))
    monitor = Monitor(logged.address)
    try:
        monitor.sock.send_multipart(codec.encode(messages.WorkerStatsRequest()))
        refusal = receive(monitor.sock, "monitor", 30, logged.address)
        assert isinstance(refusal, messages.Error) and "a monitor cannot send 'worker_stats_request'" in refusal.message
        assert len(monitor.stats().workers) == 2  # the dispatcher serves on
    finally:
        monitor.close()


# ---- the instruction log and its tools -------------------------------------------------------

def _logged_matmul(logged):
    """Run one upload and matmul on worker 0; -> (events of the log, the upload's bytes)."""
    gt.connect(logged.address)
    try:
        with gt.worker(0):
            a = gt.from_numpy(np.ones((16, 8), np.float32))
            (a @ gt.ones(8, 4)).numpy()
    finally:
        gt.disconnect()
    wait_until(lambda: "DISCONNECT" in logged.log.read_text(), 10, "the client's leaving is logged")
    return read_log(str(logged.log)), 16 * 8 * 4


def test_the_log_has_gt_columns_sequence_numbers_sizes_and_message_events(logged):
    _, upload_bytes = _logged_matmul(logged)
    text = logged.log.read_text().splitlines()  # one snapshot: the dispatcher may still append lines
    events = read_events(text)
    assert len(events) == sum(1 for line in text if not line.startswith("#"))  # every line parses
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert {"CONNECT", "RECV", "SEND", "WORKER_SEND", "WORKER_RECV", "OP", "DISCONNECT"} <= {e.event for e in events}
    matmul = [e for e in events if e.event == "OP" and e.op == "matmul" and "float32[16,8]" in e.details["in"]][-1]
    assert matmul.source == "WORKER 0" and matmul.size == 16 * 4 * 4 and float(matmul.details["dur_ms"]) >= 0
    assert matmul.details["out"].endswith(":float32[16,4]")
    upload_run = [e for e in events if e.event == "RECV" and e.command == "run" and e.size >= upload_bytes]
    assert upload_run, "the run carrying the upload is logged with its bytes"
    tasks = [e for e in events if e.event == "WORKER_SEND" and e.command == "tasks" and e.source == "WORKER 0"]
    assert tasks and all(e.size > 0 and int(e.details["instructions"]) >= 1 for e in tasks)
    # GT's recipes: its timeline script's pattern, and grep by event name.
    import re
    gt_pattern = re.compile(r"\s*(?P<t>[\d.]+)s\s*\|\s*#(?P<id>\d+)\s*\|\s*(?P<event>\S+)\s*\|\s*(?P<src>[^|]+?)\s*\|")
    assert all(gt_pattern.match(line) for line in text if not line.startswith("#"))
    assert any("WORKER_SEND" in line and "WORKER 0" in line for line in text)
    assert parse_line("# a comment") is None and parse_line("not a log line") is None


def test_trace_writes_a_chrome_trace_and_a_png_timeline(logged, tmp_path):
    _logged_matmul(logged)
    chrome, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    result = CliRunner().invoke(paratrain_cli, ["frontend", "trace", str(logged.log), "-o", str(chrome),
                                                "--png", str(png)])
    assert result.exit_code == 0, result.output
    slices = [e for e in json.loads(chrome.read_text())["traceEvents"] if e["ph"] == "X"]
    assert any(e["name"] == "matmul" and e["tid"] == 0 for e in slices)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 500
    assert len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 5  # something drawn, not a blank page


def test_trace_needs_a_log_or_live():
    result = CliRunner().invoke(paratrain_cli, ["frontend", "trace"])
    assert result.exit_code == 2 and "either a LOG file or --live" in result.output


def test_live_trace_captures_a_running_dispatcher_that_writes_no_log(tmp_path):
    server = LocalServer.start(1)  # no --instruction-log: the capture turns logging on
    capture = None
    try:
        saved, chrome = tmp_path / "live.log", tmp_path / "live.json"
        capture = paratrain_command("frontend", "trace", "--live", "2", "--server", server.address,
                                    "--save", str(saved), "-o", str(chrome), stdout=True, stderr=subprocess.STDOUT)
        gt.connect(server.address)
        try:
            deadline = time.monotonic() + 60
            while capture.poll() is None and time.monotonic() < deadline:  # work until the capture ends
                (gt.randn(4, 4) @ gt.randn(4, 4)).sum().item()
                time.sleep(0.05)
        finally:
            gt.disconnect()
        output = capture.communicate(timeout=30)[0]
        assert capture.returncode == 0, output
        events = read_log(str(saved))
        assert {"RECV", "SEND", "WORKER_SEND", "WORKER_RECV", "OP"} <= {e.event for e in events}, output
        assert any(e.event == "OP" and e.op == "matmul" for e in events)
        assert [e.seq for e in events] == list(range(events[0].seq, events[0].seq + len(events)))
        assert "captured" in output and json.loads(chrome.read_text())["traceEvents"]
    finally:
        if capture is not None:
            stop(capture)
        server.stop()


def test_live_trace_without_save_leaves_no_file_in_the_current_folder(logged, tmp_path, monkeypatch):
    cwd, chrome = tmp_path / "cwd", tmp_path / "out" / "live.json"
    cwd.mkdir()
    chrome.parent.mkdir()
    monkeypatch.chdir(cwd)
    result = CliRunner().invoke(paratrain_cli, ["frontend", "trace", "--live", "0.5", "--server", logged.address,
                                                "-o", str(chrome)])
    assert result.exit_code == 0, result.output
    assert "captured" in result.output and chrome.exists()
    assert list(cwd.iterdir()) == []


# ---- GT's entry points -------------------------------------------------------------------------

def _start(command: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, text=True, **kwargs)


def _use(address: str) -> None:
    gt.connect(address)
    try:
        assert gt.arange(4).sum().item() == 6
    finally:
        gt.disconnect()


def test_gt_server_module_with_p_and_spawned_workers_starts_and_stops_cleanly():
    port = free_port()
    server = _start(["-m", "paratrain.frontend.server", "-p", str(port), "--spawn_gpu_workers", "2",
                     "--exit-with-pid", str(os.getpid()), "--no-console-log"])
    try:
        address = wait_until_ready(server, 120)
        assert address == f"127.0.0.1:{port}"
        _use(address)
        monitor = Monitor(address)
        worker_pids = [w.pid for w in monitor.stats().workers]
        monitor.close()
        assert len(worker_pids) == 2
        server.terminate()
        assert server.wait(30) == 0
        wait_until(lambda: not any(process_alive(pid) for pid in worker_pids), 30, "the spawned workers exit")
    finally:
        stop(server)


def test_serve_p_with_a_gt_worker_module_starts_and_stops_cleanly(tmp_path):
    port = free_port()
    messages_file = open(tmp_path / "serve.err", "w")
    server = paratrain_command("serve", "-p", str(port), "--exit-with-pid", str(os.getpid()), stdout=True,
                               stderr=messages_file)
    worker = None
    try:
        worker = _start(["-m", "paratrain.frontend.worker", "--host", "127.0.0.1", "-p", str(port), "--backend",
                         "numpy", "--id", "gt-style-worker", "--exit-with-pid", str(os.getpid())])
        address = wait_until_ready(server, 120)
        _use(address)
        server.terminate()
        assert server.wait(30) == 0
        assert worker.wait(30) == 0  # told to exit by the dispatcher as it stopped
        assert "worker 0 (gt-style-worker) joined" in (tmp_path / "serve.err").read_text()
    finally:
        for process in (worker, server):
            if process is not None:
                stop(process)
        messages_file.close()


def test_spawn_gpu_workers_must_agree_with_workers():
    result = CliRunner().invoke(paratrain_cli, ["serve", "--spawn-gpu-workers", "2", "--workers", "3"])
    assert result.exit_code == 2 and "--spawn-gpu-workers 2 starts 2 workers" in result.output


def test_importing_the_worker_entry_module_leaves_gt_worker_the_placement_function():
    function = gt.worker
    assert importlib.import_module("paratrain.frontend.worker") is function
    assert gt.worker is function and callable(gt.worker)
