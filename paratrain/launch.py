"""Start a world of ranks and run `fn(group, *args)` on each.

- `launcher="threads"`: an in-process Fabric, one thread per rank.
- `launcher="processes"`: PyTorch's elastic launcher (what `torchrun` runs), one process per
  rank, a gloo (CPU) or NCCL (CUDA) process group each.
- Under `torchrun` (its environment is set), `run` runs this process's own rank only, so the
  same script works unchanged on many machines.

`run` returns {rank: fn's return value} for the ranks this process launched.
"""

from __future__ import annotations

import logging
import os
import shutil
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
from paratrain.comm.errors import FabricAborted, PeerLostError
from paratrain.comm.settings import env_flag, timeout_from_env
from paratrain.comm.transport import shm_setup
from paratrain.failure_report import RunStopped, failed_run_error

LAUNCHERS = ("threads", "processes")
PEER_DEATH_GRACE_S = 3.0  # the elastic agent checks its ranks every 0.1 s


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    )


def run(fn, nproc: int, *, launcher: str = "threads", args: tuple = (), devices=None,
        timeout: float | None = None, debug: bool | None = None, max_restarts: int = 0) -> dict[int, object]:
    """`max_restarts` (processes only): after a rank fails, the elastic agent stops the others
    and starts every rank again, up to this many times; `fn` sees TORCHELASTIC_RESTART_COUNT."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if max_restarts and launcher != "processes":
        raise ValueError("max_restarts needs launcher='processes' (a thread that dies cannot be restarted alone)")
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer, got {nproc!r}")
    options = {"timeout": timeout, "debug": debug}
    if in_torchrun():
        return _run_here(fn, args, options)
    if launcher == "threads":
        return _run_threads(fn, nproc, args, devices, options)
    return _run_processes(fn, nproc, args, options, max_restarts)


def _run_threads(fn, nproc, args, devices, options) -> dict[int, object]:
    fabric = Fabric(nproc, devices)
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        group = None
        try:
            group = Group(fabric.endpoint(rank), **options)
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


def _run_processes(fn, nproc, args, options, max_restarts=0) -> dict[int, object]:
    """Ranks as processes of PyTorch's elastic agent. What the run leaves goes with it: the
    agent's folder of per-rank logs and error files (else a torchelastic_* folder in the temp
    directory per run), the file torch.multiprocessing names for each rank's exception
    (pytorch-errorfile-*.pickle in the temp directory, never removed: so while the agent runs,
    this process's temp directory is our folder), and the shared-memory files of ranks killed
    while setting up."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default; also silences its warning
    run_id = f"paratrain-{uuid.uuid4().hex[:8]}"
    logs = tempfile.mkdtemp(prefix=f"{run_id}-logs-")
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )
    try:
        with _agent_logs_quiet(unless=bool(options["debug"]) or env_flag("PARATRAIN_DEBUG")), _temp_dir(logs):
            return dict(sorted(elastic_launch(config, _process_main)(fn, args, options).items()))
    except ChildFailedError as failed:
        raise failed_run_error(failed.failures, nproc, run_id) from None
    except SignalException as stopped:  # the agent's handler for SIGTERM, SIGINT, SIGHUP, SIGQUIT
        raise RunStopped(stopped.sigval) from None
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        shm_setup.remove_files_of_children(os.getpid())


@contextmanager
def _temp_dir(folder: str):
    saved, tempfile.tempdir = tempfile.tempdir, folder
    try:
        yield
    finally:
        tempfile.tempdir = saved


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
def _process_main(fn, args, options):
    """One rank of a process world: join the process group, run, leave."""
    import torch.distributed as dist
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing one, a named semaphore in /dev/shm: a rank killed
    # mid-run would leave it to the launcher's resource tracker, which warns of it at exit.
    # A rank's progress bar is its own, so a thread lock serves.
    tqdm.set_lock(threading.RLock())
    group = init_process_group_from_env(**options)
    try:
        return fn(group, *args)
    except PeerLostError:
        # The peer is dead or dying. Give the agent time to see that first, so the run is
        # reported by its root cause; this rank's error is in its flight record.
        time.sleep(PEER_DEATH_GRACE_S)
        raise
    finally:
        group.close()
        dist.destroy_process_group()


def _run_here(fn, args, options) -> dict[int, object]:
    rank = int(os.environ["RANK"])
    return {rank: _process_main(fn, args, options)}


def init_process_group_from_env(timeout: float | None = None, debug: bool | None = None) -> Group:
    """Join the world torchrun (or our launcher) describes in the environment."""
    import torch.distributed as dist

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus_for(local_ranks):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"  # CPU tensors still go through gloo
    else:
        backend = "gloo"
    group_timeout = timeout if timeout is not None else timeout_from_env()
    if not dist.is_initialized():
        store = _attempt_store(group_timeout)
        where = {} if store is None else {
            "store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend, timeout=timedelta(seconds=group_timeout), **where)
    return Group(TorchTransport(), timeout=group_timeout, debug=debug)


def _attempt_store(timeout: float):
    """After an elastic restart, the rendezvous store still holds the keys the failed attempt's
    ranks wrote (gloo's addresses among them), and the new ranks would try to connect to dead
    ones. A prefix per attempt keeps each attempt's keys apart. None: the default (env://)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or "MASTER_ADDR" not in os.environ:
        return None
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=not agent_hosts_it and os.environ["RANK"] == "0", timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"paratrain/attempt-{attempt}", store)


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
