"""The torch.distributed transport: gloo for CPU tensors, NCCL for CUDA tensors.

Ranks are group-local everywhere in paratrain; this module is the one place that maps them
to the global ranks torch.distributed's p2p calls want. Where processes share a host, the
shared-memory transport (shm_transport.py) carries their messages instead and keeps one of
these for the backend's own collectives and for peers on other hosts.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from paratrain.comm.errors import TransportFailure, TransportTimeout
from paratrain.comm.flight import FlightRecords
from paratrain.comm.ops import combine_, part_sizes
from paratrain.comm.scratch import StagingPool
from paratrain.comm.transport.base import POST, P2POp, Schedule, Traffic

# torch 2.13 renamed the tensor collectives; keep working on releases before the rename.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@functools.lru_cache(maxsize=8)
def _delta(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)  # built once per timeout: every wait of every call uses one


def _wait(work, timeout: float, peer: int | None, own_timeout: float | None = None) -> None:
    """Wait for `work` at most `timeout` seconds. A process group already gives up after its
    own timeout: when that is the one asked for, the work is waited on without one, which
    spares converting a timedelta on every wait (about 5 us each, measured with gloo)."""
    try:
        if timeout == own_timeout:
            work.wait()
        else:
            work.wait(_delta(timeout))
    except RuntimeError as error:
        raise _wait_error(error, peer, timeout) from error


def _wait_error(error: RuntimeError, peer: int | None, timeout: float) -> Exception:
    """The transport error for a backend's error raised by a wait."""
    # gloo: "Timed out waiting ...ms for recv operation"; NCCL's watchdog: "...timed out".
    if "timed out" in str(error).lower():
        return TransportTimeout(peer, timeout, str(error))
    # gloo: "Connection closed by peer", "Connection reset by peer"; NCCL's errors
    return TransportFailure(peer, str(error))


def _native(collective):
    """Errors the backend raises as one of its collectives starts become a TransportFailure
    (those it raises while we wait already are)."""

    @functools.wraps(collective)
    def run(self, *args):
        try:
            return collective(self, *args)
        except RuntimeError as error:
            raise TransportFailure(self._only_peer, str(error)) from error

    return run


class _TorchWork:
    """One op's handle: gloo's own work for it, or with NCCL the batch's works (a batch
    completes as a whole)."""

    __slots__ = ("works", "op", "staging", "pool", "peer", "kind", "done", "own_timeout")

    def __init__(self, works, op: P2POp, staging: torch.Tensor | None, pool: StagingPool | None = None,
                 own_timeout: float | None = None):
        self.works, self.op, self.staging, self.peer = works, op, staging, op.peer
        self.pool, self.kind, self.own_timeout = pool, op.kind, own_timeout
        self.done = False

    def wait(self, timeout: float) -> None:
        if self.done:
            return
        for work in self.works:
            _wait(work, timeout, self.peer, self.own_timeout)
        if self.staging is not None:  # a receive that reduces: combine what arrived
            combine_(self.op.tensor, self.staging, self.op.reduce)
            self.pool.give_back(self.staging)
        self.done = True


class _GlooReplay:
    """A recorded call compiled for gloo: its posts and waits as a flat list of the process
    group's own `send`/`recv` and `work.wait()`, with the receives that reduce combined as they
    complete. start() and _TorchWork do the same per call, plus a handle and a few checks per
    message; a replay has made those checks once, when it was compiled. This is what
    `bench collectives --overhead` calls bare, and what MPI calls a persistent request
    (MPI_Send_init / MPI_Start).

    Called with a call's tag and timeout; returns gloo's works, which the Group frees later
    (see Group._retired)."""

    __slots__ = ("steps", "staging", "own_timeout", "traffic", "across")

    def __init__(self, transport: TorchTransport, schedule: Schedule):
        self.staging, self.own_timeout = transport.staging, transport.own_timeout
        self.traffic, self.across = transport.traffic, 0  # bytes each call sends to other hosts
        messages: list[tuple] = []  # per message: (post, tensors, peer, target, reduce)
        self.steps: list[tuple[bool, list]] = []  # (True, messages to post) | (False, numbers to wait for)
        for what, arg in schedule:
            if what != POST:
                self.steps.append((False, [(number, messages[number]) for number in arg]))
                continue
            posts = []
            for op in arg:
                if not 0 <= op.peer < transport.size:
                    raise ValueError(f"peer rank {op.peer} out of range for world size {transport.size}")
                post = transport.pg.send if op.kind == "send" else transport.pg.recv
                if op.kind == "send" and transport.crosses[op.peer]:
                    self.across += _nbytes(op.tensor)
                reduce = op.reduce if op.kind == "recv" else None
                message = (post, [_plain(op.tensor)], op.peer, op.tensor, reduce)
                messages.append(message)
                posts.append(message)
            self.steps.append((True, posts))

    def __call__(self, tag: int, timeout: float) -> list:
        delta = None if timeout == self.own_timeout else _delta(timeout)
        self.traffic.counted += self.across
        works, stagings = [], {}
        for posting, arg in self.steps:
            if posting:
                for post, tensors, peer, target, reduce in arg:
                    if reduce:  # lands beside its target, combined when it completes
                        staging = stagings[len(works)] = self.staging.take(target)
                        tensors = [_plain(staging)]
                    try:
                        works.append(post(tensors, peer, tag))
                    except RuntimeError as error:  # gloo refuses a connection it knows is closed
                        raise TransportFailure(peer, str(error)) from error
                continue
            for number, (_, _, peer, target, reduce) in arg:
                try:
                    if delta is None:  # the group's own timeout applies (see _wait)
                        works[number].wait()
                    else:
                        works[number].wait(delta)
                except RuntimeError as error:
                    raise _wait_error(error, peer, timeout) from error
                if reduce:
                    staging = stagings.pop(number)
                    combine_(target, staging, reduce)
                    self.staging.give_back(staging)
        return works


class TorchTransport:
    """A torch.distributed process group seen as a transport. `flight`: the flight records of
    this process (made here when none is given: a new world's first group). `regroup`: what
    each subgroup's transport is made into (shm_transport.over_process_group, set by it, so that
    all ranks of a subgroup set up shared memory together); None: nothing. `traffic`: the
    bytes sent to other hosts, shared with the world's other groups (made here when none is given).

    Which ranks share a host is known once shared memory was set up (`know_hosts`, from
    shm_setup.connect); until then, and with NCCL, `hosts` is None: not known."""

    def __init__(self, process_group=None, flight: FlightRecords | None = None, regroup=None,
                 traffic: Traffic | None = None):
        self.pg = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)
        self._global = [dist.get_global_rank(self.pg, r) for r in range(self.size)]
        self.global_ranks = tuple(self._global)
        # A collective does not say which peer failed it; in a world of two only one can have.
        self._only_peer = 1 - self.rank if self.size == 2 else None
        self.flight = flight if flight is not None else FlightRecords([dist.get_rank()])
        self.regroup = regroup
        self.traffic = traffic if traffic is not None else Traffic()
        self.hosts: tuple[tuple[int, ...], ...] | None = None  # the ranks of each host
        self.host_names: tuple[str, ...] | None = None  # each rank's host, as it names it
        self.crosses = (False,) * self.size  # per rank: on another host than this one
        self.spans = False  # any of them is: only then is there traffic between hosts to count
        backend = str(dist.get_backend(self.pg)).lower()
        self.kind = "nccl" if "nccl" in backend and _cuda_available() else "gloo"
        # gloo moves bytes on its own threads: while one segment is reduced the next arrives.
        self.segment_bytes = 1 << 20
        # gloo matches each receive on its own, so an algorithm may post the next step's
        # receives early; NCCL must pair each step's sends and receives in one batch.
        self.posts_ahead = self.kind == "gloo"
        self.staging = StagingPool()
        self.own_timeout = _group_timeout(self.pg)  # seconds after which the group itself gives up
        # Where tensors the transport makes for itself (a barrier's token) should live.
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.kind == "nccl" else torch.device("cpu")

    def describe(self) -> str:
        spread = f" on {len(self.hosts)} hosts" if self.hosts and len(self.hosts) > 1 else ""
        return f"{self.kind}: a torch.distributed process group of {self.size} ranks{spread}"

    def know_hosts(self, hosts: tuple[tuple[int, ...], ...], names: tuple[str, ...]) -> None:
        """Learn which ranks share a host (`hosts`, group ranks) and what each calls its host."""
        self.hosts, self.host_names = hosts, names
        mine = next(ranks for ranks in hosts if self.rank in ranks)
        self.crosses = tuple(rank not in mine for rank in range(self.size))
        self.spans = any(self.crosses)

    def _model(self, nbytes: float, successor_gets: bool = True) -> None:
        """Count what one of the backend's own collectives sends to other hosts, as the ring gloo
        runs it: `nbytes` to the next rank, where that rank is on another host."""
        if self.spans and successor_gets and self.crosses[(self.rank + 1) % self.size]:
            self.traffic.modelled += int(nbytes)

    def start(self, ops: list[P2POp]) -> list:
        """Post `ops` (what Link and Group's point-to-point call) on the process group."""
        if ops and ops[0].tensor.is_cuda:
            return self._start_batched(ops)
        # gloo: each op goes straight to the process group (what dist.isend/irecv end in, less
        # their per-call argument checks, which `Group` has already made), with group ranks.
        handles = []
        send, recv, crosses = self.pg.send, self.pg.recv, self.crosses
        for op in ops:
            if not 0 <= op.peer < self.size:
                raise ValueError(f"peer rank {op.peer} out of range for world size {self.size}")
            staging = None
            try:  # gloo refuses to post on a connection it already knows is closed
                if op.kind == "send":
                    if crosses[op.peer]:
                        self.traffic.counted += _nbytes(op.tensor)
                    work = send([_plain(op.tensor)], op.peer, op.tag)
                elif op.reduce:  # lands beside its target, combined when waited for
                    staging = self.staging.take(op.tensor)
                    work = recv([_plain(staging)], op.peer, op.tag)
                else:
                    work = recv([_plain(op.tensor)], op.peer, op.tag)
            except RuntimeError as error:
                raise TransportFailure(op.peer, str(error)) from error
            handles.append(_TorchWork((work,), op, staging, self.staging, self.own_timeout))
        return handles

    def _start_batched(self, ops: list[P2POp]) -> list:
        # NCCL deadlocks on paired blocking sends; batch_isend_irecv posts them as a group.
        stagings = [self.staging.take(op.tensor) if op.kind == "recv" and op.reduce else None for op in ops]
        p2p = []
        for op, staging in zip(ops, stagings):
            if not 0 <= op.peer < self.size:
                raise ValueError(f"peer rank {op.peer} out of range for world size {self.size}")
            if op.kind == "send" and self.crosses[op.peer]:
                self.traffic.counted += _nbytes(op.tensor)
            p2p.append(dist.P2POp(
                dist.isend if op.kind == "send" else dist.irecv,
                op.tensor if staging is None else staging,
                self._global[op.peer],
                self.pg,
                op.tag,
            ))
        works = dist.batch_isend_irecv(p2p)
        return [_TorchWork(works, op, s, self.staging, self.own_timeout) for op, s in zip(ops, stagings)]

    def compile(self, schedule: Schedule) -> _GlooReplay | None:
        """A recorded call's schedule (see link.Schedule) as gloo calls and nothing else: what a
        replayed all-reduce runs (replays.py). None with NCCL or CUDA tensors, whose steps must be
        batched (see start)."""
        if self.kind != "gloo" or any(op.tensor.is_cuda for what, ops in schedule if what == POST for op in ops):
            return None
        return _GlooReplay(self, schedule)

    def torch_process_group(self, timeout: float):
        return self.pg

    def split(self, ranks: list[int]) -> TorchTransport:
        """This rank's transport in the subgroup of `ranks` (which must include it). Only the
        members create it (local synchronisation), so other subgroups need not take part."""
        members = [self._global[r] for r in ranks]
        timeout = None if self.own_timeout is None else _delta(self.own_timeout)
        made = TorchTransport(dist.new_group(members, timeout=timeout, use_local_synchronization=True),
                              self.flight, self.regroup, self.traffic)
        return made if self.regroup is None else self.regroup(made)

    def split_with_everyone(self, ranks: list[int]) -> TorchTransport | None:
        """The subgroup of `ranks`, made by every rank of this group in the same order (None on
        the ranks outside it). For groups made as they are needed, in an order no rank can
        predict: in torch 2.13 a rank that made a different number of locally synchronised
        groups than its peers hangs creating a gloo group with them (see test_frontend_gt)."""
        members = [self._global[r] for r in ranks]
        timeout = None if self.own_timeout is None else _delta(self.own_timeout)
        made = dist.new_group(members, timeout=timeout, group_desc=f"frontend {members}"[:64])
        if self.rank not in ranks:
            return None
        transport = TorchTransport(made, self.flight, self.regroup, self.traffic)
        return transport if self.regroup is None else self.regroup(transport)

    # The backend's own collectives. Parts may be uneven (see ops.part_sizes): torch's
    # tensor collectives want equal parts, so uneven ones are padded to the largest part.

    def _run(self, work, timeout: float) -> None:
        _wait(work, timeout, self._only_peer, self.own_timeout)

    @_native
    def native_all_reduce(self, tensor, op, timeout):
        self._model(2 * (self.size - 1) / self.size * _nbytes(tensor))
        self._run(dist.all_reduce(tensor, _TORCH_OPS[op], group=self.pg, async_op=True), timeout)

    @_native
    def native_reduce_scatter(self, output, input, op, timeout):
        self._model(2 * (self.size - 1) / self.size * _nbytes(input))  # gloo's: an all-reduce, then a copy
        sizes = part_sizes(input.numel(), self.size)
        width = sizes[0]
        padded = input if len(set(sizes)) == 1 else _pad_parts(input, sizes, width)
        result = output if len(set(sizes)) == 1 else output.new_empty(width)
        work = _reduce_scatter(
            result, padded, _TORCH_OPS[op], group=self.pg, async_op=True
        )
        self._run(work, timeout)
        if result is not output:
            output.copy_(result[: output.numel()])

    @_native
    def native_all_gather(self, output, input, timeout):
        self._model((self.size - 1) / self.size * _nbytes(output))
        sizes = part_sizes(output.numel(), self.size)
        if len(set(sizes)) == 1:
            work = _all_gather(output, input, group=self.pg, async_op=True)
            self._run(work, timeout)
            return
        width = sizes[0]
        padded_in = input.new_zeros(width)
        padded_in[: input.numel()] = input
        gathered = input.new_empty(width * self.size)
        self._run(_all_gather(gathered, padded_in, group=self.pg, async_op=True), timeout)
        output.copy_(torch.cat([gathered[r * width : r * width + s] for r, s in enumerate(sizes)]))

    @_native
    def native_broadcast(self, tensor, root, timeout):
        self._model(_nbytes(tensor), successor_gets=(self.rank + 1) % self.size != root)
        work = dist.broadcast(tensor, self._global[root], group=self.pg, async_op=True)
        self._run(work, timeout)

    @_native
    def native_reduce(self, tensor, root, op, timeout):
        self._model(_nbytes(tensor), successor_gets=self.rank != root)
        # torch may overwrite non-root buffers with partial sums; ours leaves them as they were.
        buffer = tensor if self.rank == root else tensor.clone()
        work = dist.reduce(buffer, self._global[root], _TORCH_OPS[op], group=self.pg, async_op=True)
        self._run(work, timeout)

    @_native
    def native_all_to_all(self, output, input, timeout, splits=None):
        if splits is None:
            send_sizes = part_sizes(input.numel(), self.size)
            receive_sizes = [send_sizes[self.rank]] * self.size
        else:
            send_sizes, receive_sizes = list(splits.send), list(splits.receive)
        if self.spans:  # a loop over the peers: not on every all-to-all of one host
            self.traffic.modelled += sum(size for peer, size in enumerate(send_sizes) if self.crosses[peer]) \
                * input.element_size()
        work = dist.all_to_all_single(
            output,
            input,
            output_split_sizes=receive_sizes,
            input_split_sizes=send_sizes,
            group=self.pg,
            async_op=True,
        )
        self._run(work, timeout)

    @_native
    def native_barrier(self, timeout):
        self._run(dist.barrier(group=self.pg, async_op=True), timeout)


def _group_timeout(pg) -> float | None:
    """The timeout `pg`'s gloo backend was made with (None where it cannot be read: NCCL, or
    a torch without the attribute), in seconds."""
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """gloo moves real numbers: a complex tensor travels as its (real, imaginary) pairs."""
    return torch.view_as_real(tensor) if tensor.dtype.is_complex else tensor


def _pad_parts(flat: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    padded = flat.new_zeros(width * len(sizes))
    start = 0
    for i, size in enumerate(sizes):
        padded[i * width : i * width + size] = flat[start : start + size]
        start += size
    return padded


def _cuda_available() -> bool:
    return hasattr(torch, "cuda") and torch.cuda.is_available()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
