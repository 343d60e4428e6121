"""MPI as the benchmarks' peer: the same sweeps run through mpi4py, in ranks of their own.

`bench collectives --peer mpi` and `bench p2p --peer mpi` alternate rounds: our ranks, then
`mpiexec -n N python -m paratrain.bench.mpi_peer ...`, then ours again, and so on. Why so:

- mpi4py over MPICH makes a world of several ranks only when MPI's own launcher (mpiexec, from
  the `mpich` wheel) starts them; the processes our launcher starts (torch's elastic agent)
  cannot join one. So the MPI side is a child process tree of its own.
- the two sides never run at once: MPI ranks spin while they wait, and on a host with no more
  cores than ranks a spinning peer takes the cores the other side needs. Each round starts
  after the other side's processes are gone; alternating whole rounds spreads the machine's
  noise over both sides, as the sweep's bursts spread it over algorithms.
- the MPI ranks run our very benchmark code (collectives.run_sweep, p2p.run_p2p) through
  MpiGroup, which answers the Group calls that code makes with mpi4py's: the same inputs,
  sizes, bursts, barrier before each burst, median, slowest rank and #wrong check. Only the
  calls being timed differ.

The parent and the MPI ranks exchange a JSON file each way: the sweep in, rank 0's results out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

from paratrain.bench.collectives import Measurement, Sweep, SweepResult, run_sweep
from paratrain.bench.p2p import P2PResult, P2PSweep, run_p2p
from paratrain import lifetime
from paratrain.errors import UserError
from paratrain.environment import child_environment

MISSING = "--peer mpi needs mpi4py and an MPI library: pip install -e '.[mpi]'"
DTYPES = ("float32", "int64")  # MPI has no standard type for float16 or bfloat16
ALGO = "mpi"  # what the MPI side's measurements are labelled in tables and JSON


class PeerFailed(UserError):
    """The MPI ranks did not finish (their own output, above, says why)."""


def mpiexec_command(nproc: int) -> list[str]:
    """The command line that starts `nproc` MPI ranks of this module; a UserError (MISSING)
    if mpi4py or an MPI launcher is absent. mpiexec must belong to the MPI library mpi4py
    loads: the one installed beside this Python (the `mpich` wheel's) comes first."""
    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec")
    if importlib.util.find_spec("mpi4py") is None or mpiexec is None:
        raise UserError(MISSING)
    return [mpiexec, "-n", str(nproc), sys.executable, "-m", "paratrain.bench.mpi_peer"]


def run_collectives(sweep: Sweep, nproc: int) -> tuple[SweepResult, str]:
    """One round of `sweep`'s ops through MPI; rank 0's result and the MPI library's name."""
    spec = {"plan": [[op, [ALGO]] for op, _ in sweep.plan], "counts": list(sweep.counts),
            "dtype": sweep.dtype, "warmup": sweep.warmup, "iters": sweep.iters}
    out = _run_ranks("collectives", spec, nproc)
    result = SweepResult(out["world_size"], out["transport"], out["device"],
                         [_measurement(m) for m in out["measurements"]])
    return result, out["library"]


def _measurement(fields: dict) -> Measurement:
    return Measurement(**dict(fields, bursts_us=tuple(fields["bursts_us"]), rounds_us=tuple(fields["rounds_us"])))


def run_p2p_peer(sweep: P2PSweep, nproc: int) -> tuple[P2PResult, str]:
    """One round of `bench p2p` through MPI; rank 0's result and the MPI library's name."""
    out = _run_ranks("p2p", dataclasses.asdict(sweep), nproc)
    return P2PResult(out["world_size"], out["transport"], out["device"], out["records"]), out["library"]


def thread_level(nproc: int) -> str:
    """The MPI thread level the peer's ranks ask for. "funneled" (one thread calls MPI) spares
    every call MPICH's locking, which the reference should not carry; but at that level MPICH
    waits without ever yielding the core, so where the host has fewer cores than ranks a
    waiting rank holds the core its peer needs (measured on 2 cores, 4 ranks: 15 ms per 16 KiB
    all-reduce, against 63 us at "multiple", whose waits release the lock and yield)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return "funneled" if nproc <= cores else "multiple"


def _run_ranks(job: str, spec: dict, nproc: int) -> dict:
    command = mpiexec_command(nproc) + ["--thread-level", thread_level(nproc)]
    env = child_environment()
    env.setdefault("OMP_NUM_THREADS", "1")  # as our launcher sets for its ranks
    with tempfile.TemporaryDirectory(prefix="paratrain-mpi-") as folder:
        spec_path, out_path = Path(folder, "sweep.json"), Path(folder, "result.json")
        spec_path.write_text(json.dumps(spec))
        # A session of its own: the terminal's Ctrl-C reaches this process only, which then
        # ends the whole tree (_end_tree).
        process = subprocess.Popen([*command, job, str(spec_path), str(out_path)], env=env, start_new_session=True)
        try:
            code = process.wait()
        finally:
            if process.poll() is None:
                _end_tree(process)
        if code != 0 or not out_path.exists():
            raise PeerFailed(f"the MPI peer's ranks failed: mpiexec exited with code {code} (its output is above)")
        return json.loads(out_path.read_text())


def _end_tree(process: subprocess.Popen) -> None:
    """End mpiexec, its proxy and the ranks. Each of those calls setsid, so no one signal
    reaches them all: mpiexec is asked to end its ranks (SIGTERM), and whatever of the tree it
    leaves is killed by pid (a pid still of the same process: its start time has not changed)."""
    tree = lifetime.descendants(process.pid)
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    for pid, started in tree:
        if lifetime.start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the MPI ranks' side ----------------------------------------------------------------


class MpiGroup:
    """The part of Group that the benchmarks call, answered by MPI_COMM_WORLD through mpi4py.

    `algo` is accepted and ignored: MPI chooses its own algorithm. As Group's, the calls that
    the benchmarks read a result from (all_reduce, all_gather, recv) return it. Buffers are CPU tensors,
    handed to MPI as NumPy views of the same memory."""

    kind = ALGO
    transport = None  # no device: the benchmarks run on the CPU
    table = None  # run_sweep sets it; nothing here reads it

    def __init__(self, comm, mpi):
        self.comm, self.mpi = comm, mpi
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.ops = {"sum": mpi.SUM, "max": mpi.MAX, "min": mpi.MIN}
        # NumPy views of the last few buffers: making one costs about a microsecond, which
        # a small message's time should not carry. Holding the tensor keeps its id unique.
        self._views: OrderedDict[int, tuple[torch.Tensor, object]] = OrderedDict()

    def _array(self, tensor: torch.Tensor):
        entry = self._views.get(id(tensor))
        if entry is None or entry[0] is not tensor:
            entry = self._views[id(tensor)] = (tensor, tensor.numpy())
            if len(self._views) > 4:
                self._views.popitem(last=False)
        return entry[1]

    def _even(self, count: int) -> bool:
        return count % self.size == 0

    def _counts(self, count: int) -> tuple[list[int], list[int]]:
        from paratrain.comm.ops import part_bounds

        bounds = part_bounds(count, self.size)
        return [end - start for start, end in bounds], [start for start, _ in bounds]

    def resolve(self, op: str, algo: str, nbytes: int) -> str:
        return ALGO

    def barrier(self, algo: str = ALGO) -> None:
        self.comm.Barrier()

    def all_reduce(self, buf, op: str = "sum", algo: str = ALGO):
        self.comm.Allreduce(self.mpi.IN_PLACE, self._array(buf), op=self.ops[op])
        return buf

    def reduce_scatter(self, out, inp, op: str = "sum", algo: str = ALGO) -> None:
        if self._even(inp.numel()):
            self.comm.Reduce_scatter_block(self._array(inp), self._array(out), op=self.ops[op])
        else:
            counts, _ = self._counts(inp.numel())
            self.comm.Reduce_scatter(self._array(inp), self._array(out), counts, op=self.ops[op])

    def all_gather(self, out, inp, algo: str = ALGO):
        if self._even(out.numel()):
            self.comm.Allgather(self._array(inp), self._array(out))
        else:
            self.comm.Allgatherv(self._array(inp), [self._array(out), self._counts(out.numel())])
        return out

    def broadcast(self, buf, root: int, algo: str = ALGO) -> None:
        self.comm.Bcast(self._array(buf), root=root)

    def reduce(self, buf, root: int, op: str = "sum", algo: str = ALGO) -> None:
        if self.rank == root:
            self.comm.Reduce(self.mpi.IN_PLACE, self._array(buf), op=self.ops[op], root=root)
        else:
            self.comm.Reduce(self._array(buf), None, op=self.ops[op], root=root)

    def all_to_all(self, out, inp, algo: str = ALGO, output_split_sizes=None, input_split_sizes=None) -> None:
        if input_split_sizes is not None:  # 1-D buffers in the benchmarks: a row is an element
            self.comm.Alltoallv([self._array(inp), (input_split_sizes, _starts(input_split_sizes))],
                                [self._array(out), (output_split_sizes, _starts(output_split_sizes))])
            return
        if self._even(inp.numel()):
            self.comm.Alltoall(self._array(inp), self._array(out))
            return
        mine = out.numel() // self.size
        self.comm.Alltoallv([self._array(inp), self._counts(inp.numel())],
                            [self._array(out), ([mine] * self.size, [mine * r for r in range(self.size)])])

    def send(self, tensor, dst: int, tag: int = 0) -> None:
        self.comm.Send(self._array(tensor), dest=dst, tag=tag)

    def recv(self, tensor, src: int, tag: int = 0):
        self.comm.Recv(self._array(tensor), source=src, tag=tag)
        return tensor

    def sendrecv(self, send, dst: int, recv, src: int, tag: int = 0):
        self.comm.Sendrecv(self._array(send), dest=dst, sendtag=tag, recvbuf=self._array(recv), source=src, recvtag=tag)
        return recv


def _starts(sizes: list[int]) -> list[int]:
    """Where each part starts: MPI's displacements."""
    return [sum(sizes[:j]) for j in range(len(sizes))]


def main(argv: list[str] | None = None) -> None:
    """One MPI rank: run the job the parent wrote; rank 0 writes what it measured."""
    parser = argparse.ArgumentParser(prog="python -m paratrain.bench.mpi_peer")
    parser.add_argument("job", choices=("collectives", "p2p"))
    parser.add_argument("spec", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--thread-level", choices=("funneled", "multiple"), default="funneled")
    args = parser.parse_args(argv)

    import mpi4py

    mpi4py.rc.thread_level = args.thread_level  # see thread_level()
    from mpi4py import MPI

    spec = json.loads(args.spec.read_text())
    group = MpiGroup(MPI.COMM_WORLD, MPI)
    if args.job == "collectives":
        plan = tuple((op, tuple(algos)) for op, algos in spec.pop("plan"))
        result = run_sweep(group, Sweep(plan, tuple(spec.pop("counts")), **spec))
    else:
        result = run_p2p(group, P2PSweep(sizes=tuple(spec["sizes"]), warmup=spec["warmup"], iters=spec["iters"]))
    if result is not None:  # rank 0
        body = dataclasses.asdict(result)
        library = MPI.Get_library_version().strip().splitlines()[0]
        body["library"] = (f"{' '.join(library.split())} via mpi4py {mpi4py.__version__}, "
                           f"MPI_THREAD_{args.thread_level.upper()}")
        args.out.write_text(json.dumps(body))


if __name__ == "__main__":
    main()
