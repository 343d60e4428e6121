"""`--simulate-hosts N` on the bench commands that start their own ranks (pipeline, tp, cp,
moe --ep, scaling): each runs on 2 simulated hosts at its smallest settings, hands the hosts to
the launcher for every world of more than one rank, and says so in its header; what cannot be
played is refused in one line before any rank starts. That the launcher then names each block
of ranks its host is test_hierarchical.py's to prove."""

from __future__ import annotations

import inspect
import json

import pytest
from click.testing import CliRunner

from paratrain import launch
from paratrain.cli import main


@pytest.fixture
def launches(monkeypatch):
    """(ranks, simulated hosts) of every world the command starts, in order; the worlds still run."""
    started = []
    for name in ("_run_processes", "_run_threads"):
        original = getattr(launch, name)

        def spy(*args, _original=original, **kwargs):
            bound = inspect.signature(_original).bind(*args, **kwargs).arguments
            started.append((bound["nproc"], bound.get("simulate_hosts", 0)))
            return _original(*args, **kwargs)

        monkeypatch.setattr(launch, name, spy)
    return started


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_bench_pipeline_plays_two_hosts_one_stage_each(launches):
    result = bench("pipeline", "--nproc", 2, "--model", "gpt-tiny", "--schedules", "1f1b", "--microbatches", 2,
                   "--global-batch", 4, "--steps", 1, "--warmup", 0, "--simulate-hosts", 2)
    assert result.exit_code == 0, result.output
    assert "2 stages, one process each, on 2 simulated hosts" in result.output
    assert launches == [(2, 2)]


def test_bench_tp_trains_the_same_losses_as_pytorch_across_two_hosts(launches, tmp_path):
    out = tmp_path / "tp.json"
    result = bench("tp", "--nprocs", 2, "--n-layer", 1, "--global-batch", 4, "--steps", 2, "--warmup", 1,
                   "--rounds", 1, "--simulate-hosts", 2, "--json", out)
    assert result.exit_code == 0, result.output  # 1 where the two implementations' losses differ
    assert "gloo processes, on 2 simulated hosts" in result.output
    assert launches == [(2, 2)]
    [record] = json.loads(out.read_text())
    assert record["simulate_hosts"] == 2


def test_bench_cp_spreads_each_cp_over_two_hosts_and_runs_cp_1_alone(launches, tmp_path):
    out = tmp_path / "cp.json"
    result = bench("cp", "--cp", "1,2", "--seq", 32, "--methods", "ring", "--layouts", "zigzag", "--steps", 1,
                   "--warmup", 0, "--heads", 2, "--kv-heads", 1, "--head-dim", 8, "--no-torch",
                   "--simulate-hosts", 2, "--json", out)
    assert result.exit_code == 0, result.output
    assert "# cp 2: 2 process(es), on 2 simulated hosts" in result.output
    assert launches == [(1, 0), (2, 2)]
    assert json.loads(out.read_text())["args"]["simulate_hosts"] == 2


def test_bench_moe_ep_dispatches_across_two_hosts(launches, tmp_path):
    out = tmp_path / "moe.json"
    result = bench("moe", "--ep", 2, "--nproc", 2, "--steps", 2, "--global-batch", 4, "--simulate-hosts", 2,
                   "--json", out)
    assert result.exit_code == 0, result.output
    assert "on 2 ranks (processes, on 2 simulated hosts)" in result.output
    assert launches == [(2, 2)]
    record = json.loads(out.read_text())
    assert record["args"]["simulate_hosts"] == 2
    assert record["rows"][0]["rows_to_others_per_token"] > 0  # tokens did go to the other host's experts


def test_bench_scaling_plays_two_hosts_beside_a_one_rank_baseline(launches, tmp_path):
    out = tmp_path / "scaling.json"
    result = bench("scaling", "--nprocs", 2, "--mode", "weak", "--batch-size", 8, "--steps", 1, "--warmup", 0,
                   "--simulate-hosts", 2, "--json", out)
    assert result.exit_code == 0, result.output
    assert "processes, on 2 simulated hosts (world 1 alone)" in result.output
    assert launches == [(1, 0), (2, 2)]
    assert [(r["world_size"], r["simulate_hosts"]) for r in json.loads(out.read_text())] == [(1, 0), (2, 2)]


UNEVEN = "simulating 2 hosts needs a number of ranks they share evenly, not 3"
THREADS = "simulating hosts needs the processes launcher"


@pytest.mark.parametrize("args, said", [
    (["pipeline", "--nproc", "3"], UNEVEN),
    (["tp", "--nprocs", "2,3"], UNEVEN),  # size 2 could run: refused all the same, before it
    (["cp", "--cp", "1,2", "--launcher", "threads"], THREADS),
    (["cp", "--cp", "2,3", "--seq", "12"], UNEVEN),
    (["cp", "--cp", "1"], "no world of several ranks here to spread over hosts"),
    (["moe"], "--simulate-hosts is for --ep"),
    (["moe", "--ep", "1,2", "--nproc", "2", "--launcher", "threads"], THREADS),
    (["moe", "--ep", "1", "--nproc", "3"], UNEVEN),
    (["scaling", "--nprocs", "2,3"], UNEVEN),
    (["scaling", "--nprocs", "2", "--launcher", "threads"], THREADS),
])
def test_hosts_that_cannot_be_played_are_refused_in_one_line_before_any_rank(launches, args, said):
    result = bench(*args, "--simulate-hosts", 2)
    assert result.exit_code == 2, result.output
    assert said in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert launches == []
