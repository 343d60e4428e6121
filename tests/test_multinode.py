"""Two machines played on one: two torchrun agents (`--nnodes 2`, the c10d rendezvous on
loopback), each with its own host name (PARATRAIN_HOST), train the same model as one node of the
same world size, and survive losing one node's ranks.

The agents run as docs/cluster.md says, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the ranks'
store is served by rank 0, a fresh one each rendezvous round, so a restarted round never reads
the keys of the one before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from frontend_helpers import free_port

TRAIN = ["train", "--model", "gpt-tiny", "--tp", "2", "--steps", "20", "--metrics-out", "metrics.json"]
AGENT_TIMEOUT_S = 240
REPORT_WITHIN_S = 30.0


def _start_agents(folder: Path, run_id: str, extra: list[str] = (), agent_args: list[str] = ()) -> list:
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    agents = []
    for node in (0, 1):
        env = {**os.environ, "PARATRAIN_HOST": f"node{node}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "2", *agent_args, "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "-m", "paratrain", *TRAIN, *extra]
        log = open(folder / f"node{node}.log", "w")
        agents.append((subprocess.Popen(command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True), log))
    return agents


def _finish(agents) -> list[int]:
    """Wait for the agents (killing what is left after AGENT_TIMEOUT_S); their exit codes."""
    codes = []
    for process, log in agents:
        try:
            codes.append(process.wait(timeout=AGENT_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            codes.append(None)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the agent's ranks too, whatever happened
            except ProcessLookupError:
                pass
            process.wait()
            log.close()
    return codes


def _losses(path: Path) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in json.loads(path.read_text())["log"]}


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    folder = tmp_path_factory.mktemp("one-node")
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--tp", "2", "--nproc", "4", "--steps", "20",
                                       "--metrics-out", str(folder / "metrics.json")])
    assert result.exit_code == 0, result.output
    return _losses(folder / "metrics.json")


def _ranks_of(agent_pid: int) -> list[int]:
    """The processes the agent started (its ranks)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == agent_pid:
                children.append(int(entry.name))
    return children


def test_two_agents_train_like_one_node_and_resume_to_the_same_losses_after_losing_a_node(tmp_path, one_node):
    """One run of two agents (each start costs a fresh interpreter per agent and rank, seconds
    on two cores): it reports its world across the two hosts, survives losing node1's ranks
    after step 8's checkpoint, and its every step from there has one node's loss, which it
    could not have unless steps 0 to 7, which wrote that checkpoint, had them too."""
    agents = _start_agents(tmp_path, "lose-a-node", ["--save-dir", "ck", "--save-every", "4"], ["--max-restarts", "1"])
    try:
        deadline = time.monotonic() + AGENT_TIMEOUT_S
        while not (tmp_path / "ck" / "step-000008" / "manifest.json").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in agents), "no checkpoint at step 8"
            time.sleep(0.1)
        killed_at = time.monotonic()
        for rank in _ranks_of(agents[1][0].pid):  # node1's ranks, as a machine that dies
            os.kill(rank, signal.SIGKILL)
        survivor_log = tmp_path / "node0.log"
        while "on host node1)" not in survivor_log.read_text():
            assert time.monotonic() - killed_at < REPORT_WITHIN_S, survivor_log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        codes = _finish(agents)
    output = "".join((tmp_path / f"node{node}.log").read_text() for node in (0, 1))
    assert codes == [0, 0], output[-3000:]
    lost = [line for line in (tmp_path / "node0.log").read_text().splitlines() if "on host node1)" in line]
    assert all(line.startswith("paratrain: rank ") and "on host node0: " in line and "lost rank" in line
               for line in lost), lost
    assert "world 4 = dp 2 x pp 1 x tp 2 (torchrun)" in output
    assert "gloo between 2 hosts, shared memory inside each" in output
    assert "2 ranks per host: tp (2 ranks) inside each host" in output
    assert "resumed from ck/step-000008 at step 8" in output
    losses = _losses(tmp_path / "metrics.json")
    assert sorted(losses) == list(range(8, 20))  # the last attempt started from the checkpoint
    for step, loss in losses.items():
        assert abs(loss - one_node[step]) <= 1e-6 * abs(one_node[step]), (step, loss, one_node[step])
