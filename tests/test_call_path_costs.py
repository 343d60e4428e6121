"""What one collective call costs, counted rather than timed: the messages it starts and waits
for, the scratch buffers it allocates, the records it leaves. A call path that grows a
per-call cost again (an extra message or synchronisation, a buffer allocated every call, a
receive no longer posted ahead) fails here, on any machine, however noisy.
"""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.bench.overhead import RecordingTransport
from paratrain.comm import Group

RUN_TIMEOUT_S = 60.0
COUNT = 1000  # float32: every part non-empty, every message one segment, on any transport

# Messages (sends + receives) one rank starts per call at world size n, rank r.
EXPECTED_MESSAGES = {
    ("all_reduce", "ring"): lambda n, r: 4 * (n - 1),
    ("all_reduce", "hd"): lambda n, r: 4 * (n.bit_length() - 1),  # n a power of two
    ("all_reduce", "direct"): lambda n, r: 2 * (n - 1) if r == 0 else 2,
    ("reduce_scatter", "ring"): lambda n, r: 2 * (n - 1),
    ("reduce_scatter", "hd"): lambda n, r: 2 * (n.bit_length() - 1),
    ("all_gather", "ring"): lambda n, r: 2 * (n - 1),
    ("all_to_all", "ring"): lambda n, r: 2 * (n - 1),
}


def _call(group: Group, op: str, algo: str, buffers: dict) -> None:
    if op == "all_reduce":
        group.all_reduce(buffers["full"], algo=algo)
    elif op == "reduce_scatter":
        group.reduce_scatter(buffers["part"], buffers["full"], algo=algo)
    elif op == "all_gather":
        group.all_gather(buffers["full"], buffers["part"], algo=algo)
    elif op == "all_to_all":
        group.all_to_all(buffers["full"], buffers["full_in"], algo=algo)
    else:
        raise ValueError(op)


def count_per_call(group: Group, cases=tuple(EXPECTED_MESSAGES), calls: int = 3) -> list[str]:
    """On every rank: warm up each case, then count what each of `calls` calls does."""
    recorder = RecordingTransport(group.transport)
    counted = Group(recorder, timeout=group.timeout, table=group.table)
    n, r = counted.size, counted.rank
    buffers = {"full": torch.ones(COUNT), "full_in": torch.ones(COUNT), "part": torch.ones(COUNT // n)}
    failures = []
    for op, algo in cases:
        for _ in range(2):  # the first calls may size the pools
            _call(counted, op, algo, buffers)
        scratch_before = counted._scratch.allocations
        staging = getattr(group.transport, "staging", None)
        staging_before = staging.allocations if staging is not None else 0
        for _ in range(calls):
            recorder.events.clear()
            records_before = len(counted._recorder.calls)
            _call(counted, op, algo, buffers)
            started = sum(len(e[1]) for e in recorder.events if e[0] == "start")
            waited = sorted(e[1] for e in recorder.events if e[0] == "wait")
            expected = EXPECTED_MESSAGES[(op, algo)](n, r)
            if started != expected:
                failures.append(f"rank {r} {op}/{algo}: {started} messages per call, expected {expected}")
            if len(waited) != started or len(set(waited)) != started:
                failures.append(f"rank {r} {op}/{algo}: {len(waited)} waits for {started} messages")
            new_records = len(counted._recorder.calls) - records_before
            if new_records != 1 and len(counted._recorder.calls) < counted._recorder.calls.maxlen:
                failures.append(f"rank {r} {op}/{algo}: {new_records} flight records for one call")
        if counted._scratch.allocations != scratch_before:
            failures.append(f"rank {r} {op}/{algo}: scratch buffers allocated in a steady state")
        if staging is not None and staging.allocations != staging_before:
            failures.append(f"rank {r} {op}/{algo}: staging buffers allocated in a steady state")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_call_starts_the_algorithms_messages_and_allocates_nothing_on_threads(world_size):
    results = paratrain.run(count_per_call, world_size, timeout=RUN_TIMEOUT_S)
    failures = [line for rank in sorted(results) for line in results[rank]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_each_call_starts_the_algorithms_messages_and_allocates_nothing_on_gloo(shared_memory, monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM", shared_memory)  # the messages through /dev/shm, or gloo's sockets
    results = paratrain.run(count_per_call, 2, launcher="processes", timeout=RUN_TIMEOUT_S)
    failures = [line for rank in sorted(results) for line in results[rank]]
    assert not failures, "\n".join(failures)


class _CountingProcessGroup:
    """A process group that counts the sends and receives posted on it and the waits on them."""

    def __init__(self, pg):
        self.pg, self.posted, self.waited = pg, 0, 0

    def __getattr__(self, name):  # the barrier's collective, the backend, ...
        return getattr(self.pg, name)

    def send(self, tensors, peer, tag):
        self.posted += 1
        return _CountedWork(self, self.pg.send(tensors, peer, tag))

    def recv(self, tensors, peer, tag):
        self.posted += 1
        return _CountedWork(self, self.pg.recv(tensors, peer, tag))


class _CountedWork:
    def __init__(self, counter, work):
        self.counter, self.work = counter, work

    def wait(self, *timeout):
        self.counter.waited += 1
        return self.work.wait(*timeout)


def count_compiled_replays(group: Group, calls: int = 3) -> list[str]:
    """gloo's compiled replays (TorchTransport.compile) post what the algorithm posts, wait for
    each message once, and take staging buffers without allocating: counted on the process
    group itself, below everything paratrain does."""
    counter = _CountingProcessGroup(group.transport.pg)
    group.transport.pg = counter  # before any replay is compiled: replays bind its send and recv
    n, r, failures = group.size, group.rank, []
    for algo in ("ring", "hd"):
        if algo == "hd" and n & (n - 1):
            continue
        tensor = torch.ones(COUNT)
        for _ in range(2):  # noted, then recorded and compiled
            group.all_reduce(tensor, algo=algo)
        if group.replays.kind_of(tensor) != "compiled":
            failures.append(f"rank {r} {algo}: no compiled replay after two calls")
            continue
        staging_before = group.transport.staging.allocations
        for _ in range(calls):
            counter.posted = counter.waited = 0
            group.all_reduce(tensor, algo=algo)
            expected = EXPECTED_MESSAGES[("all_reduce", algo)](n, r)
            if (counter.posted, counter.waited) != (expected, expected):
                failures.append(f"rank {r} {algo}: {counter.posted} posted, {counter.waited} waited; "
                                f"expected {expected} of each")
        if group.transport.staging.allocations != staging_before:
            failures.append(f"rank {r} {algo}: staging buffers allocated by replays")
        if not torch.equal(tensor, torch.full((COUNT,), float(n) ** (2 + calls))):
            failures.append(f"rank {r} {algo}: wrong sums")
    group.transport.pg = counter.pg
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_compiled_replay_on_gloo_posts_the_algorithms_messages_and_allocates_nothing(world_size, monkeypatch):
    monkeypatch.setenv("PARATRAIN_SHM", "0")  # gloo compiles replays only where it carries every message
    results = paratrain.run(count_compiled_replays, world_size, launcher="processes", timeout=RUN_TIMEOUT_S)
    failures = [line for rank in sorted(results) for line in results[rank]]
    assert not failures, "\n".join(failures)


def ring_event_order(group: Group, posts_ahead: bool) -> list[tuple[str, ...]]:
    """The kinds of the batches one ring all-reduce starts, in order."""
    recorder = RecordingTransport(group.transport)
    recorder.posts_ahead = posts_ahead  # as NCCL's transport says, when False
    counted = Group(recorder, timeout=group.timeout, table=group.table)
    counted.all_reduce(torch.ones(COUNT), algo="ring")
    return [tuple(kind for kind, *_ in e[1]) for e in recorder.events if e[0] == "start"]


def test_ring_posts_each_steps_receive_before_the_step_before_sends():
    batches = paratrain.run(ring_event_order, 2, args=(True,), timeout=RUN_TIMEOUT_S)[0]
    # two steps (reduce-scatter, all-gather): both receives are out before the first send
    assert batches == [("recv",), ("recv",), ("send",), ("send",)]


def test_without_posting_ahead_each_step_is_one_batch_of_its_receive_and_send():
    batches = paratrain.run(ring_event_order, 2, args=(False,), timeout=RUN_TIMEOUT_S)[0]
    assert batches == [("recv", "send"), ("recv", "send")]


def ring_messages_with_tiny_segments(group: Group) -> int:
    """Messages one ring all-reduce starts when every step is far larger than a segment."""
    recorder = RecordingTransport(group.transport)
    counted = Group(recorder, timeout=group.timeout, table=group.table, segment_bytes=16)
    tensor = torch.ones(COUNT)
    counted.all_reduce(tensor, algo="ring")
    assert torch.equal(tensor, torch.full((COUNT,), float(group.size)))
    return sum(len(e[1]) for e in recorder.events if e[0] == "start")


def test_a_large_message_is_cut_into_a_bounded_number_of_segments():
    """Each message costs the same Python whatever its size: a 2-rank step of 2000 bytes in
    16-byte segments would be 125 messages each way; it is MAX_SEGMENTS."""
    from paratrain.comm.link import MAX_SEGMENTS

    results = paratrain.run(ring_messages_with_tiny_segments, 2, timeout=RUN_TIMEOUT_S)
    assert results == {r: 4 * MAX_SEGMENTS for r in range(2)}  # 2 steps x (send + receive) x pieces


def tiny_segment_all_reduce(group: Group, algo: str) -> None:
    counted = Group(group.transport, timeout=group.timeout, table=group.table, segment_bytes=16)
    tensor = torch.ones(COUNT)
    counted.all_reduce(tensor, algo=algo)
    assert torch.equal(tensor, torch.full((COUNT,), float(group.size)))


@pytest.mark.parametrize("algo", ["ring", "hd"])
def test_each_range_a_call_moves_is_cut_into_segments_once(monkeypatch, algo):
    """Cutting a tensor into segments costs a few microseconds of views, so a range that
    several steps move is cut once per call: the ring's 4 parts at 4 ranks, and hd's 4 ranges
    (the doubling moves the very ranges the halving moved)."""
    from paratrain.comm.link import Link

    cuts = []
    original = Link.segments

    def counted(self, flat):
        pieces = original(self, flat)
        if len(pieces) > 1:
            cuts.append(self.rank)
        return pieces

    monkeypatch.setattr(Link, "segments", counted)
    paratrain.run(tiny_segment_all_reduce, 4, args=(algo,), timeout=RUN_TIMEOUT_S)
    assert sorted(cuts) == sorted(list(range(4)) * 4), cuts
