"""Expert parallelism's dispatch and combine (parallel/expert/dispatch.py): on 2 and 4 ranks the
output and every gradient (tokens, gates, experts) equal one process computing all experts on
every rank's tokens, in fp64 to 1e-12; each token is sent once per rank it needs, and dropped
choices (expert −1) are sent nowhere."""

import pytest
import torch

import paratrain
from paratrain.parallel.expert.dispatch import expert_parallel

E, D, N, K = 8, 6, 10, 2


def _routing(rank: int, drop: bool):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, D, dtype=torch.float64, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    if drop:
        experts[::3, 1] = -1  # a third of the tokens lost their second choice to a capacity
    weights = torch.rand(N, K, dtype=torch.float64, generator=g)
    return x, experts, weights


def _expert_weights():
    return torch.randn(E, D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))


def _reference(x, experts, weights, w_EDD):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(K):
            if experts[n, k] >= 0:
                out[n] = out[n] + weights[n, k] * (x[n] @ w_EDD[experts[n, k]])
    return out


def _rank(group, drop):
    ep, local = group.size, E // group.size
    x, experts, weights = _routing(group.rank, drop)
    x.requires_grad_(), weights.requires_grad_()
    mine = _expert_weights()[group.rank * local:(group.rank + 1) * local].clone().requires_grad_()

    def run_experts(rows, counts):
        parts = rows.split(counts.tolist())
        return torch.cat([part @ mine[e] for e, part in enumerate(parts)])

    out, counts = expert_parallel(x, experts, weights, group, local, run_experts)
    out.pow(2).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "w_grad": weights.grad, "experts_grad": mine.grad,
            "rows_to": counts.rows_to, "choices": counts.choices, "ep": ep}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("drop", [False, True])
def test_dispatch_and_combine_equal_every_expert_on_one_process(ranks, drop):
    results = paratrain.run(_rank, ranks, launcher="threads", args=(drop,))
    w_EDD = _expert_weights().requires_grad_()
    total = 0
    for rank in range(ranks):
        x, experts, weights = _routing(rank, drop)
        x.requires_grad_(), weights.requires_grad_()
        expected = _reference(x, experts, weights, w_EDD)
        expected.pow(2).sum().backward()
        got = results[rank]
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], x.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["w_grad"], weights.grad, rtol=1e-12, atol=1e-12)
        # once per rank a token needs, not once per choice
        local = E // ranks
        needs = [{int(e) // local for e in row if e >= 0} for row in experts]
        assert got["rows_to"] == tuple(sum(r in need for need in needs) for r in range(ranks))
        assert got["choices"] == int((experts >= 0).sum())
        total += sum(got["rows_to"])
    local = E // ranks
    whole = torch.cat([results[r]["experts_grad"] for r in range(ranks)])
    torch.testing.assert_close(whole, w_EDD.grad, rtol=1e-12, atol=1e-12)  # each expert's, from every rank's tokens
    assert total < sum(results[r]["choices"] for r in range(ranks)) or ranks == E  # two choices on one rank: one row


def test_the_mesh_takes_the_experts_ranks_from_the_data_axis():
    """dp 2 x cp 2 x tp 2 with ep 2: the ep groups are consecutive data ranks (within one tp
    and pp position), the edp groups hold the same experts."""
    from paratrain.mesh import Mesh, mesh_grid, expert_partitions

    parts = expert_partitions(mesh_grid(2, 1, 2, cp=2), 2)
    assert parts["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]  # (dp, cp) order: cp neighbours first
    assert parts["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]

    def ranks(group):
        mesh = Mesh(group, 2, 1, 1, cp=2, ep=4)
        return mesh.ep.size, mesh.ep.rank, mesh.edp.size

    assert paratrain.run(ranks, 4, launcher="threads") == {r: (4, r, 1) for r in range(4)}
    with pytest.raises(ValueError, match=r"ep \(3\) must divide dp x cp = 4"):
        paratrain.run(lambda group: Mesh(group, 4, ep=3), 4, launcher="threads")


def test_each_token_goes_once_to_each_rank_it_needs_fewer_rows_than_once_per_expert():
    """8 experts, top-2 distinct choices, ep 2 (4 experts a rank): a token needs both ranks
    unless both experts are on one, so 2·(1 − C(4,2)/C(8,2)) = 11/7 rows per token on average
    under uniform routing, 21% fewer than the 2 of once per expert (25% if the two choices could
    repeat). Counted from the dispatch's splits."""
    from paratrain.parallel.expert.dispatch import _rows_per_rank

    g = torch.Generator().manual_seed(0)
    tokens = 20_000
    experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    token_S, rank_S = _rows_per_rank(experts, 2, 4)
    assert len(token_S) / tokens == pytest.approx(11 / 7, rel=0.01)
    same_rank = (experts[:, 0] // 4 == experts[:, 1] // 4).sum().item()
    assert len(token_S) == 2 * tokens - same_rank  # exactly: one row less per token whose experts share a rank


def test_a_dispatchers_records_stay_bounded_over_a_long_run():
    from paratrain.parallel.expert.apply import RECORDS, ExpertParallelDispatcher
    from paratrain.parallel.expert.dispatch import DispatchCounts

    dispatcher = ExpertParallelDispatcher(group=None, local_experts=4)
    for step in range(RECORDS + 10):
        dispatcher.sent.append(DispatchCounts((step, 0), step))
    assert len(dispatcher.sent) == RECORDS and dispatcher.sent[-1].choices == RECORDS + 9
