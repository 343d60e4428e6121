"""The experts' grouped multiplies in chunks on threads (models/moe_grouped.py): the output and
every gradient equal grouped_mm's own autograd on the same rows (to rounding where chunks run on
threads: a multiply on one thread may round its last bit unlike the same one on two; bit for bit
in one chunk), the chunks cover the experts in order with about equal rows, and the intra-op
thread count is what it was after every call, an error too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from paratrain.models import moe_grouped
from paratrain.models.moe_grouped import chunks_of, grouped_swiglu

D, FF = 16, 12


def _weights(e: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 0.3 for shape in ((e, D, FF), (e, D, FF), (e, FF, D))]


def _grouped_mm_autograd(x, w1, w3, w2, counts: list[int]):
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return F.grouped_mm(F.silu(F.grouped_mm(x, w1, offs=offsets)) * F.grouped_mm(x, w3, offs=offsets), w2,
                        offs=offsets)


def _output_and_grads(function, counts: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed + 1)
    leaves = [torch.randn(sum(counts), D, generator=generator), *_weights(len(counts), seed)]
    leaves = [leaf.requires_grad_() for leaf in leaves]
    out = function(*leaves, counts)
    out.backward(torch.randn(out.shape, generator=generator))
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("counts", [
    [40, 3, 0, 17, 25, 9, 0, 31, 12, 8, 22, 5, 14, 0, 19, 11],  # 16 experts, some empty: chunks
    [0] * 8 + [10] * 8,  # the first chunk's experts hold nothing at first
], ids=["uneven", "empty-first-half"])
def test_chunks_on_threads_give_grouped_mms_output_and_gradients(counts, monkeypatch):
    monkeypatch.setattr(moe_grouped, "chunks_of", lambda counts_e, threads: chunks_of(counts_e, 2))  # any host
    assert len(chunks_of(counts, 2)) == 2
    ours, theirs = _output_and_grads(grouped_swiglu, counts), _output_and_grads(_grouped_mm_autograd, counts)
    for name, mine, reference in zip(("output", "x", "w1", "w3", "w2"), ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6, msg=name)


def test_one_chunk_is_grouped_mms_autograd_bit_for_bit():
    counts = [300, 2, 1, 0]  # the busiest expert holds more than half a chunk's share: one chunk
    assert chunks_of(counts, 2) == [(0, 4)]
    ours, theirs = _output_and_grads(grouped_swiglu, counts), _output_and_grads(_grouped_mm_autograd, counts)
    assert all(torch.equal(mine, reference) for mine, reference in zip(ours, theirs))


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=40), threads=st.integers(1, 8))
def test_chunks_cover_the_experts_in_order_with_about_equal_rows(counts, threads):
    chunks = chunks_of(counts, threads)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(counts) and len(chunks) <= max(1, threads)
    assert all(first < end for first, end in chunks) and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    total, parts = sum(counts), len(chunks)
    if parts > 1:  # each chunk within the busiest expert's rows of its share
        assert max(counts) * 2 * parts <= total
        assert all(abs(sum(counts[first:end]) - total / parts) <= max(counts) for first, end in chunks)


def test_the_intra_op_thread_count_is_restored_after_a_call_and_after_an_error(monkeypatch):
    before = torch.get_num_threads()
    counts = [10] * 8
    seen = []
    forward = moe_grouped._forward

    def watching(*args):
        seen.append(torch.get_num_threads())
        return forward(*args)

    monkeypatch.setattr(moe_grouped, "_forward", watching)
    monkeypatch.setattr(moe_grouped, "chunks_of", lambda counts_e, threads: [(0, 4), (4, 8)])
    _output_and_grads(grouped_swiglu, counts)
    assert seen == [1, 1] and torch.get_num_threads() == before  # one thread each inside, as before after

    def failing(*args):
        raise RuntimeError("a chunk failed")

    monkeypatch.setattr(moe_grouped, "_forward", failing)
    with pytest.raises(RuntimeError, match="a chunk failed"):
        _output_and_grads(grouped_swiglu, counts)
    assert torch.get_num_threads() == before


def test_a_call_from_another_thread_leaves_the_thread_count_alone(monkeypatch):
    # Ranks run as threads of one process share its intra-op thread count: only the main thread
    # may set it, so another thread's call is one chunk, with grouped_mm's own bits.
    import threading

    monkeypatch.setattr(torch, "set_num_threads", lambda count: pytest.fail("set_num_threads from a rank thread"))
    counts, results = [10] * 8, {}
    worker = threading.Thread(target=lambda: results.update(
        ours=_output_and_grads(grouped_swiglu, counts), theirs=_output_and_grads(_grouped_mm_autograd, counts)))
    worker.start()
    worker.join()
    assert all(torch.equal(mine, reference) for mine, reference in zip(results["ours"], results["theirs"]))
