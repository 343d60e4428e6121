"""What `auto` picks when nothing was measured, and what `bench collectives --explain` says of
it without launching anything: for a process group whose ranks all share one host, where every
message goes through shared memory (the table's key "shm", comm/choice.py), our algorithms and
never gloo's own; over gloo's sockets, gloo's own, with why it can win."""

from __future__ import annotations

from paratrain.bench import collectives_cli
from paratrain.comm.algorithms import OPS, algorithms_for
from paratrain.comm.choice import default_choice

from test_bench_collectives import bench


def test_explain_on_one_host_names_shared_memory_and_picks_our_algorithms(monkeypatch):
    monkeypatch.setattr(collectives_cli.torch.cuda, "is_available", lambda: False)
    result = bench("--explain", "--launcher", "processes", "--ops", "all_reduce", "--min-bytes", "16K",
                   "--max-bytes", "64M", "--factor", "64")
    assert result.exit_code == 0, result.output
    assert "transport shm (gloo's processes, every message through shared memory)" in result.output
    picks = [line.split()[2] for line in result.output.splitlines() if line.startswith("  all_reduce")]
    assert picks == ["oneshot", "oneshot", "oneshot"]  # 16 KiB, 1 MiB, 64 MiB on 2 ranks: the defaults on one host
    result = bench("--explain", "--launcher", "processes", "--nproc", "4", "--ops", "all_reduce", "--min-bytes", "16K",
                   "--max-bytes", "64M", "--factor", "64")
    picks = [line.split()[2] for line in result.output.splitlines() if line.startswith("  all_reduce")]
    assert picks == ["oneshot", "twoshot", "twoshot"]  # on 4 ranks, each reduces a quarter from 1 MiB
    assert "why it can win" not in result.output


def test_the_defaults_on_one_host_never_pick_native():
    for op in OPS:
        for nbytes in (0, 1 << 10, 1 << 14, 1 << 20, 1 << 24, 1 << 28):
            choice = default_choice(op, nbytes, 4, "shm")
            assert choice.algo in algorithms_for(op, "shm") and choice.algo not in ("native", "auto"), (op, nbytes)
            assert "shared segment" in choice.reason


def test_explain_says_why_gloo_wins_where_it_is_kept(monkeypatch):
    monkeypatch.setattr(collectives_cli.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PARATRAIN_SHM", "0")  # over gloo's sockets its own all-reduce is the default
    result = bench("--explain", "--launcher", "processes", "--ops", "all_reduce", "--min-bytes", "1M",
                   "--max-bytes", "1M")
    assert result.exit_code == 0, result.output
    assert "where gloo's own is kept, this is why it can win" in result.output
    assert "scheduler tick" in result.output and "memory bandwidth" in result.output
