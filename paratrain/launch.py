"""Start a world of ranks and run `fn(group, *args)` on each.

- `launcher="threads"`: an in-process Fabric, one thread per rank.
- `launcher="processes"`: PyTorch's elastic launcher (what `torchrun` runs), one process per
  rank, a gloo (CPU) or NCCL (CUDA) process group each.
- Under `torchrun` (its environment is set), `run` runs this process's own rank only, so the
  same script works unchanged on many machines.

`run` returns {rank: fn's return value} for the ranks this process launched.

Settings are resolved here, once (paratrain/environment.py: defaults, the environment, then the
arguments given), and handed to every rank: spawned processes receive them with their
arguments. The transport is chosen here too, and said by `expected_transport` before a world
starts: the fabric for threads; for processes a torch.distributed group, whose ranks on one host
talk through shared memory ("shm") unless PARATRAIN_SHM=0.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from datetime import timedelta

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from paratrain.comm import Fabric, Group, TorchTransport
from paratrain.comm.choice import AlgorithmTable
from paratrain.comm.errors import FabricAborted, PeerLostError, TransportFailure
from paratrain.comm.flight import FlightRecords
from paratrain.comm.transport import over_process_group, shm_setup
from paratrain import forking, lifetime
from paratrain.failure_report import RunStopped, failed_run_error
from paratrain.stores import loopback_server, store_for
from paratrain.environment import (
    Settings, child_environment, default_threads_for_children, launch_environment, torch_reads,
)

LAUNCHERS = ("threads", "processes")
PEER_DEATH_GRACE_S = 3.0  # the elastic agent checks its ranks every 0.1 s


def in_torchrun() -> bool:
    """Whether this process is a rank torchrun started (its environment says so)."""
    return launch_environment().in_torchrun


def transport_kind(launcher: str, nproc: int) -> str:
    """The backend a world started by `launcher` will have, known without starting it
    (NCCL only where every rank has a GPU of its own, as `gpus_for` decides)."""
    if launcher == "threads":
        return "fabric"
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "gloo"


def expected_transport(launcher: str, nproc: int, settings: Settings, simulate_hosts: int = 0) -> str:
    """The transport kind a world started by `launcher` will have (the algorithm table's key),
    known without starting it: "shm" for gloo processes that all share this host. Under torchrun
    the ranks are its processes, with a process group, whatever `launcher` says (the banner once
    said "fabric" there: --launcher's default). A world playing several hosts is "gloo"."""
    if settings.launch.in_torchrun:
        launcher, nproc = "processes", settings.launch.local_world_size or nproc  # the GPUs a host needs
    kind = transport_kind(launcher, nproc)
    if kind != "gloo" or not shm_setup.enabled(settings) or simulate_hosts > 1:
        return kind
    if settings.launch.in_torchrun:
        if settings.launch.local_world_size != settings.launch.world_size:
            return "gloo"  # some ranks run on other hosts
        nproc = settings.launch.world_size or nproc
    return "shm" if nproc > 1 else "gloo"


def hosts_of(nproc: int, settings: Settings, simulate_hosts: int = 0) -> int:
    """How many hosts a world of `nproc` ranks spans, known before it starts: those it simulates,
    or under torchrun its nodes (ranks per node from LOCAL_WORLD_SIZE)."""
    where = settings.launch
    if where.in_torchrun and where.world_size and where.local_world_size:
        return max(1, where.world_size // where.local_world_size)
    return simulate_hosts or 1


def describe_transport(launcher: str, nproc: int, settings: Settings, simulate_hosts: int = 0) -> str:
    """The transport as the training banner states it: the kind, and for a world of several hosts
    what carries messages inside and between them."""
    kind = expected_transport(launcher, nproc, settings, simulate_hosts)
    hosts = hosts_of(nproc, settings, simulate_hosts)
    if hosts < 2 or kind != "gloo":
        return kind
    inside = "shared memory" if shm_setup.enabled(settings) else "gloo"
    return f"gloo between {hosts} hosts, {inside} inside each (collectives across hosts: hier)"


def run(fn, nproc: int, *, launcher: str = "threads", args: tuple = (), devices=None,
        timeout: float | None = None, debug: bool | None = None, max_restarts: int = 0,
        settings: Settings | None = None, simulate_hosts: int = 0) -> dict[int, object]:
    """`max_restarts` (processes only): after a rank fails, the elastic agent stops the others
    and starts every rank again, up to this many times; `fn` sees TORCHELASTIC_RESTART_COUNT.
    `settings`: this process's (default: resolved now); `timeout` and `debug` override them.
    `simulate_hosts` (processes only): this machine plays that many hosts, each a block of
    consecutive ranks named by `simulated_host` (PARATRAIN_HOST, as each rank would be told)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if max_restarts and launcher != "processes":
        raise ValueError("max_restarts needs launcher='processes' (a thread that dies cannot be restarted alone)")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    check_simulated_hosts(simulate_hosts, nproc, launcher)
    settings = (settings or Settings.resolve()).with_flags(timeout=timeout, debug=debug)
    if settings.launch.in_torchrun:
        return _run_here(fn, args, settings)
    table = algorithm_table(settings, nproc)
    if launcher == "threads":
        return _run_threads(fn, nproc, args, devices, settings, table)
    return _run_processes(fn, nproc, args, settings, table, max_restarts, simulate_hosts)


def check_simulated_hosts(hosts: int, nproc: int, launcher: str) -> None:
    """Raise, in one line, where `--simulate-hosts` cannot be: threads share one process, and
    hosts hold equal blocks of ranks."""
    if not hosts:
        return
    if not isinstance(hosts, int) or hosts < 1:
        raise ValueError(f"simulate_hosts must be a positive integer, got {hosts!r}")
    if launcher != "processes":
        raise ValueError("simulating hosts needs the processes launcher (--launcher processes): a host's "
                         "name is a process's, and threads share one")
    if nproc % hosts:
        raise ValueError(f"simulating {hosts} hosts needs a number of ranks they share evenly, not {nproc}")


def simulated_host(rank: int, world_size: int, hosts: int) -> str:
    """The host name rank `rank` plays when `hosts` hosts share the world in consecutive blocks."""
    return f"host{rank // (world_size // hosts)}"


def algorithm_table(settings: Settings, world_size: int) -> AlgorithmTable:
    """The table `algo="auto"` consults in this world (choice.AlgorithmTable.in_use)."""
    return AlgorithmTable.in_use(settings.table_path, bool(settings.algo_table), world_size)


def _run_threads(fn, nproc, args, devices, settings: Settings, table: AlgorithmTable) -> dict[int, object]:
    fabric = Fabric(nproc, devices, settings.trace_dir)
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        group = None
        try:
            group = Group(fabric.endpoint(rank), table=table, settings=settings)
            results[rank] = fn(group, *args)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller below
            errors[rank] = error
            fabric.abort(f"rank {rank} failed: {type(error).__name__}: {error}", rank)
        finally:
            if group is not None:
                group.close()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(nproc)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        # The rank that failed first raised something other than FabricAborted (or the
        # PeerLostError it becomes in a call); the rest stopped because of it.
        first = min(errors, key=lambda r: (isinstance(errors[r], (FabricAborted, PeerLostError)), r))
        error = errors[first]
        error.add_note(f"(raised on rank {first} of {nproc}, launcher=threads)")
        raise error
    return dict(sorted(results.items()))


def _run_processes(fn, nproc, args, settings: Settings, table: AlgorithmTable, max_restarts=0,
                   simulate_hosts: int = 0) -> dict[int, object]:
    """Ranks as processes of PyTorch's elastic agent. What the run leaves goes with it: the
    agent's folder of per-rank logs and error files (else a torchelastic_* folder in the temp
    directory per run), the file torch.multiprocessing names for each rank's exception
    (pytorch-errorfile-*.pickle in the temp directory, never removed: so while the agent runs,
    this process's temp directory is our folder), and the shared-memory files of ranks killed
    while setting up."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    default_threads_for_children()
    start_method = forking.start_method()
    run_id = f"paratrain-{uuid.uuid4().hex[:8]}"
    _sweep_dead_runs()
    logs = tempfile.mkdtemp(prefix=lifetime.run_folder_prefix())
    rendezvous = loopback_server("127.0.0.1", 0, None, settings.timeout, multi_tenant=True)  # stores.py
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{rendezvous.port}", local_addr="127.0.0.1",
        max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )
    try:
        with _agent_logs_quiet(unless=settings.debug), _temp_dir(logs), _rendezvous_records_cheap(), \
                torch_reads("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"):  # no store of the agent's for the ranks
            return dict(sorted(elastic_launch(config, _process_main)(
                fn, args, settings, table, child_environment(PARATRAIN_LAUNCHER_PID=str(os.getpid())),
                forking.Stdio(), False, simulate_hosts).items()))
    except ChildFailedError as failed:
        raise failed_run_error(failed.failures, nproc, run_id, settings.trace_dir) from None
    except SignalException as stopped:  # the agent's handler for SIGTERM, SIGINT, SIGHUP, SIGQUIT
        raise RunStopped(stopped.sigval) from None
    finally:
        del rendezvous
        shutil.rmtree(logs, ignore_errors=True)
        shm_setup.remove_files_of_children(os.getpid(), settings.shm_dir)


def _sweep_dead_runs() -> None:
    """What runs killed whole left (see lifetime.sweep_dead_runs), removed and said in one line."""
    removed = lifetime.sweep_dead_runs(tempfile.gettempdir())
    if removed:
        shown = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        print(f"paratrain: removed what dead runs left: {shown}", file=sys.stderr, flush=True)


@contextmanager
def _temp_dir(folder: str):
    saved, tempfile.tempdir = tempfile.tempdir, folder
    try:
        yield
    finally:
        tempfile.tempdir = saved


@contextmanager
def _rendezvous_records_cheap():
    """The elastic agent's c10d rendezvous records each step it takes (about ten a launch) under
    the name of the method taking it, found by calling `inspect.stack()` twice: that reads the
    source lines of every frame on the stack, about 0.3 s of CPU per record under a deep caller
    (a test, a notebook), seconds per launch. While the agent runs, the same name is read from the
    frame itself; restored after."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    saved = getattr(dynamic_rendezvous, "get_method_name", None)
    if saved is None:  # a PyTorch that records otherwise: nothing to do
        yield
        return

    def method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # 0: this function, 1: _record, 2: the method
        except ValueError:  # a stack not that deep
            return "no_method_name"

    dynamic_rendezvous.get_method_name = method_name
    try:
        yield
    finally:
        dynamic_rendezvous.get_method_name = saved


@contextmanager
def _agent_logs_quiet(unless: bool):
    """Keep the elastic agent's own log lines (a failed rank's traceback as it saw it, each
    process it stops) off the terminal: the error raised for a failed run reports the same,
    root cause first. Shown in debug mode."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logger for name, logger in list(logging.Logger.manager.loggerDict.items())  # each: some set their own level
               if name.startswith(prefixes) and isinstance(logger, logging.Logger)]
    levels = [logger.level for logger in loggers]
    if not unless:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@record  # writes the rank's traceback where the elastic agent reports it
def _process_main(fn, args, settings: Settings, table: AlgorithmTable, parent_environ=None, _stdio=None,
                  keep_world: bool = False, simulate_hosts: int = 0):
    """One rank of a process world: join the process group, run, leave. `settings` were
    resolved by the launching process; the rank's place in the world is its own. A rank
    forked from the server (paratrain/forking.py) takes `parent_environ` first; the unpickled
    `_stdio` has already pointed its output at the launcher's. `keep_world`: the process group
    stays for the next run in this process (torchrun's rank; see _run_here). `simulate_hosts`:
    the rank plays its block's host (see simulated_host)."""
    import torch.distributed as dist
    from tqdm import tqdm

    if parent_environ is not None:
        forking.adopt_environment(parent_environ)
    where = settings.in_this_process().launch
    if where.launcher_pid is not None:  # forked from a server, this rank would outlive a killed launcher
        lifetime.end_with(where.launcher_pid, f"paratrain rank {where.rank}")

    # tqdm's default lock is a multiprocessing one, a named semaphore in /dev/shm: a rank killed
    # mid-run would leave it to the launcher's resource tracker, which warns of it at exit.
    # A rank's progress bar is its own, so a thread lock serves.
    tqdm.set_lock(threading.RLock())
    settings = settings.in_this_process()
    if simulate_hosts:
        settings = settings.with_flags(host=simulated_host(where.rank, where.world_size, simulate_hosts))
    group = init_process_group_from_env(settings, table)
    try:
        return fn(group, *args)
    except (PeerLostError, TransportFailure) as error:  # in a call, or in setting a transport up
        # In a world of several hosts, said at once on this one: the root cause is reported by
        # the lost peer's agent, on its host, and ours may stop this rank before anything is
        # raised (an elastic agent restarts its ranks when another node's rejoin the rendezvous).
        # On one host the launcher reports the run in one line, root cause first: nothing here.
        if group.hosts is not None and len(group.hosts) > 1:
            print(f"paratrain: rank {where.rank} on host {settings.host_name}: {error}", file=sys.stderr, flush=True)
        # The peer is dead or dying. Give the agent time to see that first, so the run is
        # reported by its root cause; this rank's error is in its flight record.
        time.sleep(PEER_DEATH_GRACE_S)
        raise
    finally:
        group.close()
        if not keep_world:
            dist.destroy_process_group()


def _run_here(fn, args, settings: Settings) -> dict[int, object]:
    """Under torchrun: this process is one rank, and runs `fn` as that rank. Its process group
    is made once and kept for every later `run` in the script, and destroyed at exit: a second
    group made in the same torchrun store finds the first one's addresses under the same keys,
    and gloo waited on those for minutes."""
    import torch.distributed as dist

    if not dist.is_initialized():
        atexit.register(_leave_world)
    table = algorithm_table(settings, settings.launch.world_size)
    return {settings.launch.rank: _process_main(fn, args, settings, table, keep_world=True)}


def _leave_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def init_process_group_from_env(settings: Settings | None = None, table: AlgorithmTable | None = None) -> Group:
    """Join the world torchrun (or our launcher) describes in the environment (`settings.launch`;
    default: this process's settings, resolved now), with the transport chosen for it."""
    import torch.distributed as dist

    settings = settings or Settings.resolve()
    where = settings.launch
    if table is None:
        table = algorithm_table(settings, where.world_size)
    if gpus_for(where.local_world_size or 1):
        torch.cuda.set_device(where.local_rank)
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors still go through gloo
    else:
        backend = "gloo"
    if not dist.is_initialized():
        store = store_for(settings)
        joining = {} if store is None else {"store": store, "rank": where.rank, "world_size": where.world_size}
        dist.init_process_group(backend, timeout=timedelta(seconds=settings.timeout), **joining)
    flight = FlightRecords([dist.get_rank()], settings.trace_dir, where.run_name)
    transport = over_process_group(TorchTransport(flight=flight), settings)
    return Group(transport, table=table, settings=settings)


def gpus_for(local_ranks: int) -> bool:
    """Whether each of this machine's `local_ranks` ranks can have a GPU of its own. NCCL
    refuses two ranks on one GPU, so a machine with fewer GPUs than ranks runs on the CPU
    (gloo) instead, with a warning, rather than failing in `set_device`."""
    if not (hasattr(torch, "cuda") and torch.cuda.is_available()):
        return False
    if torch.cuda.device_count() >= local_ranks:
        return True
    warnings.warn(
        f"{local_ranks} ranks on a machine with {torch.cuda.device_count()} GPU(s): running on the CPU (gloo); "
        "NCCL needs a GPU per rank", stacklevel=2)
    return False
