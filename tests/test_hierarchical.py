"""A world that knows its hosts, and the hierarchical collectives (`algo="hier"`).

One launch of 4 processes playing 2 hosts (`simulate_hosts=2`: ranks 0-1 on host0, 2-3 on host1)
serves most tests: every rank runs `_world_checks` and hands back what it saw, which the tests
then assert on. Inputs are small integers, so every reduction is exact and results compare
with ==. The interleaved case is a second group of the same 4 ranks whose ranks name their hosts
by rank parity, so its hosts are (0, 2) and (1, 3): parts must land by group rank, not by host.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.comm import Group, TorchTransport
from paratrain.comm.ops import part_size
from paratrain.comm.transport import over_process_group, shm_setup
from paratrain.environment import Settings
from paratrain.launch import run, simulated_host

S = 1 << 20  # bytes of the all-reduce whose traffic is counted
OPS_CHECKED = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "all_to_all_uneven")


def _ints(*shape, seed: int) -> torch.Tensor:
    return torch.randint(-50, 50, shape, generator=torch.Generator().manual_seed(seed)).float()


def _compare(group, numel: int) -> dict[str, bool]:
    """Each op through hier and through the flat `direct` (or ring): equal results?"""
    me, n = group.rank, group.size
    same = {}
    x = _ints(numel, seed=me)
    flat, hier = x.clone(), x.clone()
    group.all_reduce(flat, algo="ring")
    group.all_reduce(hier, algo="hier")
    same["all_reduce"] = torch.equal(flat, hier)
    outs = [torch.full((part_size(numel, n, me),), -7.0) for _ in range(2)]
    for out, algo in zip(outs, ("ring", "hier")):
        group.reduce_scatter(out, x, algo=algo)
    same["reduce_scatter"] = torch.equal(*outs)
    mine = _ints(part_size(numel, n, me), seed=10 + me)
    outs = [torch.full((numel,), -7.0) for _ in range(2)]
    for out, algo in zip(outs, ("ring", "hier")):
        group.all_gather(out, mine, algo=algo)
    same["all_gather"] = torch.equal(*outs)
    same["broadcast"] = True
    for root in range(n):
        outs = [x.clone(), x.clone()]
        for out, algo in zip(outs, ("ring", "hier")):
            group.broadcast(out, root, algo=algo)
        same["broadcast"] &= torch.equal(*outs)
    part = part_size(numel, n, me)
    outs = [torch.full((n * part,), -7.0) for _ in range(2)]
    for out, algo in zip(outs, ("direct", "hier")):
        group.all_to_all(out, x, algo=algo)
    same["all_to_all"] = torch.equal(*outs)
    counts = torch.randint(0, 4, (n, n), generator=torch.Generator().manual_seed(numel))  # empty parts too
    rows = _ints(int(counts[me].sum()), 3, seed=20 + me)
    outs = [torch.full((int(counts[:, me].sum()), 3), -7.0) for _ in range(2)]
    for out, algo in zip(outs, ("direct", "hier")):
        group.all_to_all(out, rows, algo=algo, output_split_sizes=counts[:, me].tolist(),
                         input_split_sizes=counts[me].tolist())
    same["all_to_all_uneven"] = torch.equal(*outs)
    return same


def _crossed(group, call) -> int:
    """Bytes this rank sent to other hosts during `call()`."""
    before = group.traffic.total
    call()
    return group.traffic.total - before


def _world_checks(group) -> dict:
    seen = {"hosts": group.hosts, "kind": group.kind}
    seen["equal"] = {numel: _compare(group, numel) for numel in (4096, 1003, 3)}  # even, uneven, under n
    settings = group.settings.with_flags(host=f"parity{group.rank % 2}")
    process_group = dist.new_group(list(range(group.size)))
    interleaved = Group(over_process_group(TorchTransport(process_group, group.transport.flight), settings),
                        settings=settings)
    seen["interleaved_hosts"] = interleaved.hosts
    seen["interleaved_equal"] = _compare(interleaved, 1003)
    seen["auto_large"] = group.resolve("all_reduce", "auto", S)
    seen["auto_small"] = group.resolve("all_reduce", "auto", 1024)
    seen["auto_barrier"] = group.resolve("barrier", "auto", 0)
    group.barrier()  # through that pick
    one_host = group.split([[0, 1], [2, 3]])
    seen["one_host_auto"] = one_host.resolve("all_reduce", "auto", S)
    seen["one_host_barrier"] = one_host.resolve("barrier", "auto", 0)
    try:
        one_host.resolve("all_reduce", "hier", S)
        seen["one_host_hier"] = None
    except ValueError as error:
        seen["one_host_hier"] = str(error)
    buffer = torch.ones(S // 4)
    seen["crossed_ring"] = _crossed(group, lambda: group.all_reduce(buffer, algo="ring"))
    seen["crossed_hier"] = _crossed(group, lambda: group.all_reduce(buffer, algo="hier"))
    seen["host_names"] = group.transport.host_names
    interleaved.close()
    one_host.close()
    return seen


@pytest.fixture(scope="module")
def world():
    return run(_world_checks, 4, launcher="processes", simulate_hosts=2)


def test_the_world_knows_its_hosts_from_the_names_each_rank_was_given(world):
    for rank, seen in world.items():
        assert seen["hosts"] == ((0, 1), (2, 3))
        assert seen["host_names"] == ("host0", "host0", "host1", "host1")
        assert seen["kind"] == "gloo"  # a group across hosts: not all of it shares memory
        assert seen["interleaved_hosts"] == ((0, 2), (1, 3))


@pytest.mark.parametrize("numel", [4096, 1003, 3])
def test_every_hierarchical_collective_gives_the_flat_algorithms_result(world, numel):
    for rank, seen in world.items():
        assert seen["equal"][numel] == dict.fromkeys(OPS_CHECKED, True), f"rank {rank}"


def test_parts_land_by_group_rank_when_hosts_interleave(world):
    for rank, seen in world.items():
        assert seen["interleaved_equal"] == dict.fromkeys(OPS_CHECKED, True), f"rank {rank}"


def test_auto_picks_hier_for_large_messages_of_a_group_that_spans_hosts_only(world):
    seen = world[0]
    assert seen["auto_large"] == "hier"
    assert seen["auto_small"] != "hier"
    assert seen["one_host_auto"] != "hier"
    assert "span hosts" in seen["one_host_hier"]


def test_auto_barrier_of_a_group_that_spans_hosts_hears_from_every_rank(world):
    # gloo's own barrier fails without naming the rank it lost; `direct` names it (a lost host's
    # ranks, in the survivors' error). Inside one host, the shared segment's step.
    assert world[0]["auto_barrier"] == "direct"
    assert world[0]["one_host_barrier"] == "oneshot"


def test_hier_sends_fewer_bytes_between_hosts_as_counted(world):
    # Flat ring 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send their whole share, 2(n-1)/n S, to the
    # other host; 0 and 2 send nothing across. hier: every rank sends its host's sum of S/L
    # through a ring of h = 2 ranks, 2(h-1)/h S/L = S/2. Across hosts 2S instead of 3S.
    flat = [world[r]["crossed_ring"] for r in range(4)]
    hier = [world[r]["crossed_hier"] for r in range(4)]
    assert flat == [0, 3 * S // 2, 0, 3 * S // 2]
    assert hier == [S // 2] * 4
    assert sum(hier) * 3 == sum(flat) * 2


def test_a_host_name_changes_the_host_key_so_named_hosts_never_share_memory():
    keys = {shm_setup._host_key(Settings(host=name)) for name in ("host0", "host1", "host0")}
    assert len(keys) == 2
    assert [simulated_host(rank, 6, 3) for rank in range(6)] == ["host0"] * 2 + ["host1"] * 2 + ["host2"] * 2


@pytest.mark.parametrize("launcher, nproc, hosts, words", [
    ("threads", 4, 2, "processes launcher"),
    ("processes", 4, 3, "share evenly"),
])
def test_hosts_that_cannot_be_simulated_are_refused_in_one_line(launcher, nproc, hosts, words):
    with pytest.raises(ValueError, match=words):
        run(lambda group: None, nproc, launcher=launcher, simulate_hosts=hosts)


def test_bench_refuses_hier_on_one_host():
    result = CliRunner().invoke(main, ["bench", "collectives", "--algos", "hier", "--nproc", "2"])
    assert result.exit_code == 2
    assert "--simulate-hosts" in result.output


def test_bench_collectives_on_simulated_hosts_prints_the_bytes_between_hosts(tmp_path):
    out = tmp_path / "hosts.json"
    result = CliRunner().invoke(main, [
        "bench", "collectives", "--nproc", "4", "--simulate-hosts", "2", "--ops", "all_reduce",
        "--algos", "ring,hier", "--min-bytes", "1M", "--max-bytes", "1M", "--warmup", "0", "--iters", "1",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "crossed" in result.output
    assert "hier, all_reduce from 1M" in result.output
    records = {record["algo"]: record for record in json.loads(out.read_text())}
    assert records["ring"]["crossed_bytes"] == 3 * S and records["ring"]["crossed_modelled"] == 0
    assert records["hier"]["crossed_bytes"] == 2 * S
    assert all(record["wrong"] == 0 for record in records.values())


def test_the_banner_says_whether_tp_fits_inside_a_host():
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--nproc", "4", "--tp", "4", "--launcher",
                                       "processes", "--simulate-hosts", "2", "--plan-only"])
    assert result.exit_code == 0, result.output
    assert "transport gloo between 2 hosts" in result.output
    assert "tp spans 4 ranks, which do not fit a host's 2" in result.output
    fits = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--nproc", "4", "--tp", "2", "--launcher",
                                     "processes", "--simulate-hosts", "2", "--plan-only"])
    assert "tp (2 ranks) inside each host" in fits.output


def test_simulated_hosts_on_threads_are_refused_before_any_rank_starts():
    result = CliRunner().invoke(main, ["train", "--model", "gpt-tiny", "--nproc", "4", "--simulate-hosts", "2"])
    assert result.exit_code != 0
    assert "processes launcher" in result.output


@pytest.mark.parametrize("args, said", [
    (["--nproc", "4", "--simulate-hosts", "3"], "share evenly"),
    (["--nproc", "4", "--simulate-hosts", "2", "--launcher", "threads"], "processes launcher"),
    (["--nproc", "4", "--simulate-hosts", "2", "--peer", "mpi"], "no --simulate-hosts"),
])
def test_bench_p2p_refuses_hosts_it_cannot_simulate_in_one_line(args, said):
    result = CliRunner().invoke(main, ["bench", "p2p", *args])
    assert result.exit_code == 2 and said in result.output, result.output


def test_bench_ddp_refuses_hosts_it_cannot_simulate_in_one_line():
    result = CliRunner().invoke(main, ["bench", "ddp", "--nproc", "4", "--simulate-hosts", "3", "--models", "mlp16"])
    assert result.exit_code == 2 and "share evenly" in result.output, result.output
