"""`Group`: what a rank talks through. Point-to-point (p2p_calls.py, a PointToPoint the Group
holds), and the collectives with a choice of algorithm (algorithms/, the backend's own among
them), over any transport. Every collective runs one way (`_run`): its arguments checked here,
its algorithm resolved, then numbered, recorded and run by the CollectiveCalls the Group holds
(collective_calls.py); a call made again on the same tensors goes straight to what the earlier
one worked out (CollectiveCalls.run_straight, from the Group's Replays, replays.py).

Every collective call gets a sequence number (the same on every rank, since all ranks make
the same calls in the same order); its messages carry a tag made from it, so they never match
another call's, and a timeout names it. With `debug=True` every collective first checks that
all ranks are making the same call. Every call is kept in the rank's flight recorder (see
`flight.py`), which a timeout, a lost peer or a mismatched call writes out.

A Group reads no environment: it is given the process's settings (paratrain/environment.py; the
launcher resolves them), which the layers above read from it too, and its algorithm table;
without them, the defaults (300 s, no checks, the algorithm defaults of choice.py).
"""

from __future__ import annotations

import functools
import operator
from collections import deque
from collections.abc import Callable

import torch

from paratrain.comm import checks
from paratrain.comm.algorithms import (
    ALGORITHMS, HIERARCHICAL, OPS, SHARED_ALGORITHMS, algorithms_for, check_takes_splits,
)
from paratrain.comm.choice import AlgorithmTable, uneven_all_to_all_choice
from paratrain.comm.collective_calls import CollectiveCalls
from paratrain.comm.errors import CollectiveMismatchError, CommTimeoutError, PeerLostError
from paratrain.comm.flight import Call
from paratrain.comm.handles import Done, P2PHandle
from paratrain.comm.hierarchy import Spread
from paratrain.comm.ops import check_reduce_op, part_size
from paratrain.comm.p2p_calls import PointToPoint
from paratrain.comm.replays import Replays
from paratrain.comm.scratch import ScratchPool
from paratrain.environment import Settings

_DUMPED = (CommTimeoutError, PeerLostError, CollectiveMismatchError)  # failures worth a flight record
# Built once; hier is valid by name everywhere, and refused with its reason where it cannot run.
_VALID = {kind: {op: frozenset(algorithms_for(op, kind, spans_hosts=True)) for op in OPS} for kind in (None, "shm")}


class Group:
    # Point-to-point, PointToPoint's own methods (p2p_calls.py), bound to each Group in __init__:
    # a straight send costs a few microseconds, and a wrapper's frame would add to every one.
    isend: Callable[..., P2PHandle | Done]
    irecv: Callable[..., P2PHandle]
    send: Callable[..., None]
    recv: Callable[..., torch.Tensor]
    sendrecv: Callable[..., torch.Tensor]

    def __init__(
        self,
        transport,
        *,
        timeout: float | None = None,
        debug: bool | None = None,
        table: AlgorithmTable | None = None,
        segment_bytes: int | None = None,
        settings: Settings | None = None,
    ):
        """`timeout` and `debug` default to the settings' (themselves defaulting to 300 s, off)."""
        self.transport = transport
        # kind: "fabric", "gloo", "nccl" or "shm"; also the algorithm table's key (choice.py)
        self.rank, self.size, self.kind = transport.rank, transport.size, transport.kind
        self.settings = settings if settings is not None else Settings()
        self.timeout = float(timeout) if timeout is not None else self.settings.timeout
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.debug = bool(debug) if debug is not None else self.settings.debug
        self.table = table if table is not None else AlgorithmTable()  # the defaults alone
        self._valid = _VALID["shm" if self.kind == "shm" else None]  # checked on every call
        # Ring steps are cut into segments of this size; each transport knows what suits it.
        self.segment_bytes = segment_bytes or transport.segment_bytes
        self.ranks = tuple(transport.global_ranks)  # this group's ranks, numbered in the world
        self.flight = transport.flight  # every recorder this process holds
        self._recorder = self.flight.recorders[self.ranks[self.rank]]
        self._key = self._recorder.group_key(self.ranks)
        self._scratch = ScratchPool()  # collectives run one at a time, so one pool serves all
        self.replays = Replays()  # recent calls' work, run again when their tensors come back
        self._token: torch.Tensor | None = None  # what a barrier reduces
        self._uneven_auto: str | None = None  # auto's pick for an uneven all_to_all, once made
        # Which ranks share a host (not known on the fabric), and the levels hier runs on (hierarchy.py).
        self.spread = Spread(getattr(transport, "hosts", None))
        # The works of the last calls, freed only once newer calls have finished. gloo frees a
        # finished message's buffer by spinning (sched_yield) until its I/O thread lets go of it;
        # freed the moment it finished, that thread has often just been preempted by ours, and
        # where cores are few the next message then waits a scheduler tick (4 ms) in most calls.
        # Kept a call longer, the same works are freed at no cost. (They hold their tensors for
        # as long.)
        self._retired: deque[list] = deque(maxlen=2)
        p2p = PointToPoint(transport, self._recorder, self._key, self.timeout, self.segment_bytes, self._scratch,
                           failed=self._failed, retire=self._retire)
        self.isend, self.irecv, self.send, self.recv, self.sendrecv = (
            p2p.isend, p2p.irecv, p2p.send, p2p.recv, p2p.sendrecv)
        self._calls = CollectiveCalls(transport, self._recorder, self._key, self.timeout, self.segment_bytes,
                                      self._scratch, self.debug, failed=self._failed, retire=self._retire)

    def __repr__(self) -> str:
        return f"Group(rank={self.rank}, size={self.size}, transport={self.kind})"

    def describe(self) -> str:
        """What carries this group's messages, in one line."""
        return self.transport.describe()

    def split(self, partition: list[list[int]]) -> Group:
        """Cut the group into disjoint subgroups; returns the one holding this rank.

        Every rank passes the same `partition` (lists of this group's ranks, covering each
        rank once). A subgroup numbers its ranks by their position in its list.
        """
        seen = sorted(r for ranks in partition for r in ranks)
        if seen != list(range(self.size)):
            raise ValueError(
                f"split: partition {partition} must list each rank of 0..{self.size - 1} exactly once"
            )
        mine = next(list(ranks) for ranks in partition if self.rank in ranks)
        return Group(
            self.transport.split(mine), timeout=self.timeout, debug=self.debug, table=self.table,
            settings=self.settings,
        )

    # ---- what point-to-point and the collectives share ---------------------------------

    def _retire(self, works: list) -> None:
        """Keep finished works until two newer batches have finished (see `_retired`)."""
        if works:
            self._retired.append(works)

    def _failed(self, call: Call, error: Exception) -> None:
        """Mark `call` failed; a timeout, a lost peer or a mismatch also writes the flight
        records (once per error, however many layers it passes through)."""
        call.fail()
        if self._recorder.error is None or isinstance(error, _DUMPED):
            self._recorder.error = f"{type(error).__name__}: {error}"
        if not isinstance(error, _DUMPED) or error.trace_dir is not None:
            return
        try:
            directory = self.flight.directory()
            self.flight.dump(directory, reason=self._recorder.error)
        except OSError as problem:  # the error itself matters more than its record
            error.add_note(f"(could not write the flight records: {problem})")
            return
        error.trace_dir = directory

    # ---- collectives: the whole path, and the straight one of a call made again ----------

    def _run(self, op_name: str, algo: str, nbytes: int, signature: checks.CallSignature, args: tuple, **how):
        """Resolve the algorithm, then run the call as CollectiveCalls.run does, with `how` (how
        it runs: its reduce op, whether it moves anything, what is written back, async or not)."""
        chosen = self.resolve(op_name, algo, nbytes)
        hierarchy = self.spread.levels(self) if chosen in HIERARCHICAL else None  # made here, not on the comm thread
        return self._calls.run(op_name, chosen, signature, args, hierarchy, **how)

    def _goes_straight(self, entry, op_name: str, algo: str) -> bool:
        """Whether a call that found `entry` (a replay, replays.py, or None) runs it."""
        return entry is not None and (entry.asked == (algo, self.table, self.table.version)
                                      or self._confirms(entry, op_name, algo))

    def _confirms(self, entry, op_name: str, algo: str) -> bool:
        """Whether `algo` (the caller's argument) resolves to the algorithm `entry` runs;
        remembered on the entry, with the table and its version, when it does: until the table
        changes or is replaced, the same argument resolves the same way."""
        if self.resolve(op_name, algo, entry.nbytes) != entry.algo:
            return False
        entry.asked = (algo, self.table, self.table.version)
        return True

    @property
    def straight_calls(self) -> int:
        """Collectives so far that ran straight from a replay (replays.py, `replays`), skipping
        the checks and the call's description: in a loop on the same tensors, all but the first two."""
        return self._calls.seq - self._calls.whole

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...] | None:
        """The group's ranks on each host (None: not known, as on the fabric)."""
        return self.spread.hosts

    @property
    def traffic(self):
        """The bytes this process has sent to other hosts (transport/base.py's Traffic); None
        where the transport keeps no count (the fabric: one host)."""
        return getattr(self.transport, "traffic", None)

    def close(self) -> None:
        """Stop the communication thread (if async calls started one) and free the finished
        works still held (see `_retired`) while their process group is still alive."""
        self._calls.close()
        self.spread.close()
        self._retired.clear()
        self.replays.clear()

    def resolve(self, op_name: str, algo: str, nbytes: int) -> str:
        """The algorithm that will run: `algo` itself, or the table's pick for `auto`."""
        if algo not in self._valid[op_name]:
            valid = ", ".join(algorithms_for(op_name, self.kind, self.spread.problem is None))
            if algo in SHARED_ALGORITHMS and algo in ALGORITHMS[op_name]:
                raise ValueError(f"{op_name}: algorithm {algo!r} works through a segment of shared memory, only "
                                 f"where every rank of the group is a process of this host (transport 'shm'); "
                                 f"this group's transport is '{self.kind}'. Valid here: {valid}")
            raise ValueError(f"{op_name}: unknown algorithm {algo!r}; valid: {valid}")
        if algo in HIERARCHICAL and self.spread.problem is not None:
            raise ValueError(f"{op_name}: algorithm {algo!r} {self.spread.problem}")
        if algo != "auto":
            return algo
        return self.choose(op_name, nbytes).algo

    def choose(self, op_name: str, nbytes: int | None):
        """`auto`'s pick (a choice.Choice, with its reason): in a group that spans hosts the
        hierarchical algorithm where it pays, else the table's. `nbytes` None: an uneven all_to_all."""
        spread = self.spread.choice(op_name, nbytes)
        if spread is not None:
            return spread
        if nbytes is None:
            return uneven_all_to_all_choice(self.size, self.kind)
        return self.table.choose(op_name, nbytes, self.size, self.kind)

    # ---- the collectives: each checks its arguments, then runs as _run says -------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algo: str = "auto", async_op: bool = False):
        """Reduce `tensor` over all ranks, in place; every rank gets the result."""
        if not (async_op or self.debug or self._calls.executor is not None):  # see run_straight
            replay = self.replays.all_reduces.ready(tensor, op)
            if self._goes_straight(replay, "all_reduce", algo):
                return self._calls.run_straight("all_reduce", replay, tensor, op)
        checks.tensor_arg("all_reduce", "tensor", tensor)
        check_reduce_op(op)
        buf = checks.flat_buffer(tensor)
        signature = checks.CallSignature.of("all_reduce", tensor, reduce_op=op)
        return self._run("all_reduce", algo, _nbytes(tensor), signature, (buf,), reduce_op=op,
                         moves=buf.numel() > 0, averaged=buf, written=(tensor, buf), async_op=async_op,
                         replay=functools.partial(self.replays.all_reduces.run, tensor, signature))

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", algo: str = "auto",
        async_op: bool = False,
    ):
        """Reduce `input` over all ranks; rank r gets part r (torch.tensor_split's parts)."""
        straight = not (async_op or self.debug or self._calls.executor is not None)  # see run_straight
        if straight:
            repeat = self.replays.repeats.ready("reduce_scatter", output, input, op)
            if self._goes_straight(repeat, "reduce_scatter", algo):
                return self._calls.run_straight("reduce_scatter", repeat, output, op)
        checks.tensor_arg("reduce_scatter", "output", output)
        checks.tensor_arg("reduce_scatter", "input", input)
        check_reduce_op(op)
        checks.same_dtype("reduce_scatter", output, input)
        expected = part_size(input.numel(), self.size, self.rank)
        checks.numel("reduce_scatter", "output", output, expected, f"part {self.rank} of {input.numel()}")
        flat_in, flat_out = checks.flat_view(input), checks.flat_buffer(output)
        signature = checks.CallSignature.of("reduce_scatter", input, reduce_op=op)
        nbytes = _nbytes(input)
        # made again on these tensors, it will run straight
        repeat = functools.partial(self.replays.repeats.run, output, input, op, nbytes, signature) if straight else None
        return self._run("reduce_scatter", algo, nbytes, signature, (flat_in, flat_out), reduce_op=op,
                         moves=flat_in.numel() > 0, averaged=flat_out, written=(output, flat_out),
                         replay=repeat, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algo: str = "auto", async_op: bool = False):
        """Concatenate every rank's `input` into `output` (rank r's input is part r)."""
        straight = not (async_op or self.debug or self._calls.executor is not None)  # see run_straight
        if straight:
            repeat = self.replays.repeats.ready("all_gather", output, input, "")
            if self._goes_straight(repeat, "all_gather", algo):
                return self._calls.run_straight("all_gather", repeat, output)
        checks.tensor_arg("all_gather", "output", output)
        checks.tensor_arg("all_gather", "input", input)
        checks.same_dtype("all_gather", output, input)
        expected = part_size(output.numel(), self.size, self.rank)
        checks.numel("all_gather", "input", input, expected, f"part {self.rank} of the output's {output.numel()}")
        flat_in, flat_out = checks.flat_view(input), checks.flat_buffer(output)
        signature = checks.CallSignature.of("all_gather", output)
        nbytes = _nbytes(output)
        # made again on these tensors, it will run straight
        repeat = functools.partial(self.replays.repeats.run, output, input, "", nbytes, signature) if straight else None
        return self._run("all_gather", algo, nbytes, signature, (flat_in, flat_out), moves=flat_out.numel() > 0,
                         written=(output, flat_out), replay=repeat, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, algo: str = "auto", async_op: bool = False):
        """Copy root's `tensor` into every rank's `tensor`."""
        checks.tensor_arg("broadcast", "tensor", tensor)
        checks.root("broadcast", root, self.size)
        buf = checks.flat_buffer(tensor)
        signature = checks.CallSignature.of("broadcast", tensor, root=root)
        return self._run("broadcast", algo, _nbytes(tensor), signature, (buf, root), moves=buf.numel() > 0,
                         written=(tensor, buf), async_op=async_op)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str = "sum", algo: str = "auto", async_op: bool = False):
        """Reduce `tensor` over all ranks into root's `tensor`; the others' are left unchanged."""
        checks.tensor_arg("reduce", "tensor", tensor)
        checks.root("reduce", root, self.size)
        check_reduce_op(op)
        buf = checks.flat_buffer(tensor)
        signature = checks.CallSignature.of("reduce", tensor, reduce_op=op, root=root)
        return self._run("reduce", algo, _nbytes(tensor), signature, (buf, root), reduce_op=op,
                         moves=buf.numel() > 0, averaged=buf if self.rank == root else None,
                         written=(tensor, buf), async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, algo: str = "auto", async_op: bool = False, *,
                   output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None):
        """Part j of rank i's `input` becomes part i of rank j's `output`.

        With split sizes (rows of dimension 0, one per rank, as all_to_all_single takes them; one
        left out means equal rows) the parts are as long as they say. Without, parts follow
        torch.tensor_split of the flat buffers: rank r receives `size` pieces of
        part_sizes(input.numel(), size)[r] elements each.
        """
        checks.tensor_arg("all_to_all", "output", output)
        checks.tensor_arg("all_to_all", "input", input)
        checks.same_dtype("all_to_all", output, input)
        if output_split_sizes is not None or input_split_sizes is not None:
            return self._all_to_all_uneven(output, input, algo, async_op, output_split_sizes, input_split_sizes)
        straight = not (async_op or self.debug or self._calls.executor is not None)  # see run_straight
        if straight:
            repeat = self.replays.repeats.ready("all_to_all", output, input, "")
            if self._goes_straight(repeat, "all_to_all", algo):
                return self._calls.run_straight("all_to_all", repeat, output)
        expected = self.size * part_size(input.numel(), self.size, self.rank)
        checks.numel("all_to_all", "output", output, expected, f"{self.size} pieces of rank {self.rank}'s part")
        flat_in, flat_out = checks.flat_view(input), checks.flat_buffer(output)
        signature = checks.CallSignature.of("all_to_all", input)
        nbytes = _nbytes(input)
        # made again on these tensors, it will run straight
        repeat = functools.partial(self.replays.repeats.run, output, input, "", nbytes, signature) if straight else None
        return self._run("all_to_all", algo, nbytes, signature, (flat_in, flat_out),
                         moves=flat_in.numel() > 0, written=(output, flat_out), replay=repeat, async_op=async_op)

    def _all_to_all_uneven(self, output: torch.Tensor, input: torch.Tensor, algo: str, async_op: bool,
                           output_split_sizes, input_split_sizes):
        """all_to_all with split sizes. Made again on the same tensors with the same sizes, it runs
        straight (as reduce-scatters and all-gathers do): its checks hold already."""
        straight = not (async_op or self.debug or self._calls.executor is not None)  # see run_straight
        key = _splits_key(output_split_sizes, input_split_sizes) if straight else None
        if key is not None:
            repeat = self.replays.repeats.ready("all_to_all", output, input, key)
            if repeat is not None and repeat.algo == (self._uneven_auto if algo == "auto" else algo):
                return self._calls.run_straight("all_to_all", repeat, output)
        splits = checks.row_splits("all_to_all", output, input, output_split_sizes, input_split_sizes, self.size)
        if algo == "auto" and self._uneven_auto is None:  # by transport and hosts alone: the same every call
            self._uneven_auto = self.choose("all_to_all", None).algo
        chosen = self._uneven_auto if algo == "auto" else algo
        check_takes_splits(chosen, self.kind)
        flat_in, flat_out = checks.flat_view(input), checks.flat_buffer(output)
        signature, nbytes = checks.CallSignature.of_rows("all_to_all", input), _nbytes(input)
        repeat = None if key is None else functools.partial(self.replays.repeats.run, output, input, key, nbytes, signature)
        # every rank takes part, whatever it sends: its peers may send it something
        return self._run("all_to_all", chosen, nbytes, signature, (flat_in, flat_out, splits),
                         written=(output, flat_out), replay=repeat, async_op=async_op)

    def barrier(self, algo: str = "auto", async_op: bool = False):
        """Return only when every rank has entered the barrier."""
        if self._token is None:  # all zeros, so summing it leaves it as it was: one serves every call
            self._token = torch.zeros(1, device=getattr(self.transport, "device", None) or "cpu")
        signature = checks.CallSignature.of("barrier", None)
        return self._run("barrier", algo, 0, signature, (self._token,), reduce_op="sum", async_op=async_op)


def _splits_key(output_split_sizes, input_split_sizes) -> tuple | None:
    """An uneven all_to_all's split sizes as part of its call's key (replays.RepeatedCalls); None
    where they are not integers (the checks then say so)."""
    try:
        return tuple(None if sizes is None else tuple(map(operator.index, sizes))
                     for sizes in (output_split_sizes, input_split_sizes))
    except TypeError:
        return None


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
