"""Context-parallel attention alone (paratrain/parallel/context/): ring and all-gather, zigzag and
contiguous, causal or not, with grouped-query heads, against full attention on the whole sequence;
the layouts' arithmetic; the work each rank does; the bytes the ring sends.

Tolerances: fp64 1e-12 (the sharded and full computations add the same terms in another order:
round-off of a few ulps, ~1e-15); fp32 2e-6 relative (the same, at fp32's 1e-7 ulp, over the
dozens of terms a score and its gradient sum)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import paratrain
from paratrain.parallel.context import LAYOUTS, METHODS, attention_work, context_attention, positions, shard, unshard
from paratrain.parallel.context.layout import chunk_ids, length_problem

B, H, S, D = 2, 4, 16, 8


def _problem(kv_heads: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, kv_heads, S, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(B, H, S, D, generator=g, dtype=dtype)


def _full_attention(q, k, v, dout, causal):
    """The reference: PyTorch's attention on the whole sequence, one process."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def _context_attention(q, k, v, dout, cp, method, layout, causal):
    """The same on cp ranks (threads), each holding its part of the sequence; -> the parts of
    out, dQ, dK, dV put back together."""
    def rank(group):
        mine = [shard(t, 2, group.rank, cp, layout).requires_grad_() for t in (q, k, v)]
        out = context_attention(*mine, group, causal=causal, layout=layout, method=method)
        out.backward(shard(dout, 2, group.rank, cp, layout))
        return [out.detach()] + [t.grad for t in mine]

    parts = paratrain.run(rank, cp, launcher="threads")
    return [unshard([parts[r][i] for r in range(cp)], 2, layout) for i in range(4)]


def _relative_error(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


CASES = list(itertools.product((2, 4), METHODS, LAYOUTS, (True, False), (H, H // 2)))


@pytest.mark.parametrize("cp, method, layout, causal, kv_heads", CASES,
                         ids=[f"cp{c}-{m}-{l}-{'causal' if a else 'full'}-kv{k}" for c, m, l, a, k in CASES])
def test_context_attention_matches_full_attention_in_fp64(cp, method, layout, causal, kv_heads):
    q, k, v, dout = _problem(kv_heads, torch.float64)
    want = _full_attention(q, k, v, dout, causal)
    got = _context_attention(q, k, v, dout, cp, method, layout, causal)
    for name, g, w in zip(("out", "dQ", "dK", "dV"), got, want):
        assert _relative_error(g, w) < 1e-12, name


@pytest.mark.parametrize("method, layout", [("ring", "zigzag"), ("allgather", "contiguous")])
def test_context_attention_matches_full_attention_in_fp32(method, layout):
    q, k, v, dout = _problem(H // 2, torch.float32, seed=1)
    want = _full_attention(*(t.double() for t in (q, k, v, dout)), causal=True)
    got = _context_attention(q, k, v, dout, 4, method, layout, causal=True)
    for name, g, w in zip(("out", "dQ", "dK", "dV"), got, want):
        assert g.dtype == torch.float32
        assert _relative_error(g.double(), w) < 2e-6, name


def test_bf16_inputs_accumulate_in_fp32_and_come_back_bf16():
    q, k, v, dout = _problem(H, torch.float64, seed=2)
    want = _full_attention(q, k, v, dout, causal=True)
    got = _context_attention(*(t.bfloat16() for t in (q, k, v, dout)), 2, "ring", "zigzag", causal=True)
    for name, g, w in zip(("out", "dQ", "dK", "dV"), got, want):
        assert g.dtype == torch.bfloat16
        assert _relative_error(g.double(), w) < 3e-2, name  # bf16's 8 bits of inputs and outputs


# ---- the layouts ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 6), layout=st.sampled_from(LAYOUTS), chunk=st.integers(1, 4))
def test_shard_then_unshard_gives_the_sequence_back_and_positions_say_where_each_token_was(cp, layout, chunk):
    seq_len = cp * (2 if layout == "zigzag" else 1) * chunk
    x = torch.arange(seq_len) * 10
    parts = [shard(x, 0, r, cp, layout) for r in range(cp)]
    assert torch.equal(unshard(parts, 0, layout), x)
    for r, part in enumerate(parts):
        assert torch.equal(part, positions(r, cp, seq_len, layout) * 10)


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    assert [chunk_ids(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0,), (1,), (2,), (3,)]


def test_a_sequence_that_does_not_divide_is_refused_in_one_line():
    assert length_problem(12, 4, "zigzag") == (
        "the sequence length 12 must divide by 8 (2·cp for zigzag context parallelism over cp 4)")
    assert length_problem(12, 4, "contiguous") is None and length_problem(7, 1, "zigzag") is None
    with pytest.raises(ValueError, match="must divide by 8"):
        shard(torch.zeros(12), 0, 0, 4, "zigzag")


@pytest.mark.parametrize("seq_len", [64, 4096])
def test_zigzag_balances_causal_work_exactly_and_contiguous_gives_the_last_rank_175_percent(seq_len):
    def largest_over_mean(layout):
        work = [attention_work(r, 4, seq_len, layout) for r in range(4)]
        return max(work) / (sum(work) / 4), sum(work)

    zigzag, zigzag_total = largest_over_mean("zigzag")
    contiguous, contiguous_total = largest_over_mean("contiguous")
    assert zigzag == 1.0
    assert zigzag_total == contiguous_total == seq_len * (seq_len + 1) // 2  # every causal pair once
    assert abs(contiguous - 1.75) < 0.05  # (3.5 chunks² of 2 on average, as c grows: 1.75 exactly)


# ---- what travels ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_sends_the_bytes_its_docstring_says(cp):
    """Forward (cp−1) K/V blocks; backward the same plus cp dK/dV blocks (fp32 here, as the input)."""
    q, k, v, dout = _problem(H // 2, torch.float32)

    def rank(group):
        mine = [shard(t, 2, group.rank, cp, "zigzag").requires_grad_() for t in (q, k, v)]
        recorder = group.flight.recorders[group.ranks[group.rank]]
        before = len(recorder.calls)
        out = context_attention(*mine, group)
        forward = list(recorder.calls)[before:]
        out.backward(shard(dout, 2, group.rank, cp, "zigzag"))
        backward = list(recorder.calls)[before + len(forward):]

        def sent(calls):
            return sum(torch.Size(c.tensor[0]).numel() * c.tensor[1].itemsize for c in calls if c.op == "send")
        return sent(forward), sent(backward)

    block = 2 * B * (H // 2) * (S // cp) * D * 4  # K and V of one rank, fp32
    for forward, backward in paratrain.run(rank, cp, launcher="threads").values():
        assert forward == (cp - 1) * block
        assert backward == (cp - 1) * block + cp * block


def test_fp32_and_fp64_blocks_on_cpu_run_through_pytorchs_fused_kernel_and_bf16_through_the_plain_one():
    """The fused kernel is what makes long sequences fast on CPU; the tests above prove both paths
    (fp64, fp32: fused; bf16: plain) against full attention."""
    from paratrain.parallel.context.blocks import fused_kernel_for

    assert fused_kernel_for(torch.zeros(1)) and fused_kernel_for(torch.zeros(1, dtype=torch.float64))
    assert not fused_kernel_for(torch.zeros(1, dtype=torch.bfloat16))
