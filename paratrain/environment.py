"""Every setting paratrain takes from its environment, in one place, resolved once per process.

A process resolves its `Settings` where it starts: `launch.run` (so `paratrain train`, `check`,
`bench`), a frontend worker, a frontend program's first session. The result is handed down: a
`Group` holds its timeout, debug flag and algorithm table, a transport its shared-memory settings,
the flight recorder its folder. No other module reads `os.environ` (tests/test_environment.py checks;
the launchers only copy it to the processes they start). Flags typed on a command line win over
the environment: `Settings.resolve(timeout=...)`.

`paratrain env` prints each setting, its value and where it came from.

This module imports nothing of paratrain: it is the bottom layer, which every other may use.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Mapping

from paratrain.errors import UserError

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class SettingsError(UserError, ValueError):
    """An environment variable that does not hold what it must (one line, as a user's error)."""


def _seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0 or value == float("inf"):
        raise SettingsError(f"{name} must be positive and finite, got {raw!r}")
    return value


def _whole(least: int | None) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise SettingsError(f"{name} must be a whole number, got {raw!r}") from None
        if least is not None and value < least:
            raise SettingsError(f"{name} must be at least {least}, got {raw!r}")
        return value
    return parse


def _on(name: str, raw: str) -> bool:
    """Off unless the variable says on (1, true, yes, on)."""
    return raw.strip().lower() in _ON


def _not_off(name: str, raw: str) -> bool:
    """On unless the variable says off (0, false, no, off): GT's reading of its flags."""
    return raw.strip().lower() not in _OFF


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _folder(name: str, raw: str) -> str:
    """A folder that exists and this user may write in (where files are made, not where they
    would silently not be)."""
    path = os.path.abspath(os.path.expanduser(raw.strip()))
    if not os.path.isdir(path):
        raise SettingsError(f"{name} must be a folder, got {raw!r} (no such folder)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError(f"{name} must be a folder this user may write in, got {raw!r}")
    return path


@dataclass(frozen=True)
class Spec:
    """How one field of `Settings` is read: from the first of `variables` that is set (and not
    empty), parsed by `parse`; `meaning` is what `paratrain env` says of it."""

    name: str
    variables: tuple[str, ...]
    parse: Callable[[str, str], object]
    meaning: str
    secret: bool = False  # printed as "(set)", never its value


SPECS = (
    # communication (comm/)
    Spec("timeout", ("PARATRAIN_TIMEOUT",), _seconds, "seconds a blocking communication may wait before it fails"),
    Spec("debug", ("PARATRAIN_DEBUG",), _on,
         "check before every collective that all ranks make the same call; full tracebacks"),
    Spec("algo_table", ("PARATRAIN_ALGO_TABLE",), _text,
         "an algorithm table for algo='auto', used whatever host or world wrote it"),
    Spec("cache_dir", ("XDG_CACHE_HOME",), _text, "where the algorithm table `bench collectives --tune` writes lives"),
    Spec("trace_dir", ("PARATRAIN_TRACE_DIR",), _text,
         "where flight records are written (default: a temporary folder named after the run)"),
    # the shared-memory transport (comm/transport/shm*.py)
    Spec("shm", ("PARATRAIN_SHM",), _not_off, "processes of one host talk through shared memory (0: through gloo)"),
    Spec("shm_bytes", ("PARATRAIN_SHM_BYTES",), _whole(256),
         "bytes of each shared-memory ring (default 4 MiB, less beyond 16 peers on the host)"),
    Spec("shm_spin_us", ("PARATRAIN_SHM_SPIN_US",), _whole(0),
         "microseconds a wait polls before it sleeps (default 50000 with a core per rank, else 0)"),
    Spec("shm_dir", ("PARATRAIN_SHM_DIR",), _folder,
         "the folder of shared memory's rings, doorbells and segments (default /dev/shm): a tmpfs, e.g. a larger "
         "one where a container's /dev/shm is small; ranks of a host share memory only if they name the same"),
    Spec("host", ("PARATRAIN_HOST",), _text,
         "this rank's host name (default: the machine's); ranks with different names never share memory, so "
         "one machine can play several hosts"),
    Spec("native", ("PARATRAIN_NATIVE",), _not_off,
         "small shared-memory collectives in C, built with the host's compiler on first use (0: torch's ops)"),
    Spec("cc", ("CC",), _text, "the C compiler that builds them (default: cc, gcc or clang, the first found)"),
    # the frontend (frontend/)
    Spec("server", ("PARATRAIN_SERVER",), _text, "the dispatcher a frontend program connects to (default: start one)"),
    Spec("token", ("PARATRAIN_TOKEN",), _text, "the shared secret of dispatcher, workers and clients", secret=True),
    Spec("backend", ("PARATRAIN_BACKEND", "GT_BACKEND"), _text, "a frontend worker's device: cpu (or numpy) or cuda"),
    Spec("signal_config", ("PARATRAIN_CONFIG", "GT_CONFIG"), _text,
         "a YAML file of signals a frontend program loads at its first session"),
    Spec("auto_compile", ("PARATRAIN_AUTO_COMPILE", "GT_AUTO_COMPILE"), _not_off,
         "workers compile repeated operation sequences without markers"),
    Spec("hotpath_threshold", ("PARATRAIN_HOTPATH_THRESHOLD", "GT_HOTPATH_THRESHOLD"), _whole(None),
         "sightings of a sequence before it counts as hot"),
    Spec("hotpath_min_seq", ("PARATRAIN_HOTPATH_MIN_SEQ", "GT_HOTPATH_MIN_SEQ"), _whole(None),
         "the shortest sequence (in operations) considered"),
    Spec("hotpath_window", ("PARATRAIN_HOTPATH_WINDOW", "GT_HOTPATH_WINDOW"), _whole(None),
         "how many recent operations are searched for repeats"),
    Spec("hotpath_max_expand", ("PARATRAIN_HOTPATH_MAX_EXPAND", "GT_HOTPATH_MAX_EXPAND"), _whole(None),
         "repetitions of a hot sequence compiled together"),
    Spec("debug_compile", ("PARATRAIN_DEBUG_COMPILE", "GT_DEBUG_COMPILE"), _not_off,
         "one line per region compiled, run or given up on"),
    Spec("save_compiled_code", ("PARATRAIN_SAVE_COMPILED_CODE", "GT_SAVE_COMPILED_CODE"), _text,
         "a folder for the generated sources (1: one in the temporary directory; 0: none)"),
    Spec("compile_backend", ("PARATRAIN_COMPILE_BACKEND",), _text,
         "torch.compile's backend for `train --compile` and the frontend's compiled regions (default inductor; "
         "aot_eager needs no C++ compiler)"),
    Spec("wandb_mode", ("WANDB_MODE",), _text, "`--log wandb`'s mode: offline (default: nothing leaves the machine), "
                                                "online or disabled"),
)


@dataclass(frozen=True)
class LaunchEnvironment:
    """What torchrun (or torch's elastic agent under our processes launcher) tells each rank.
    Read in the rank's own process: every rank has its own."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int = 0
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None  # TORCHELASTIC_RUN_ID: "none" when torchrun was given no --rdzv-id
    restart_count: int = 0  # how many times the elastic agent has restarted the ranks
    agent_store: bool = False  # the agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)
    # The process that launched this rank: our launcher says (PARATRAIN_LAUNCHER_PID), since a
    # rank forked from a server (paratrain/forking.py) has the server as its parent. None: the parent.
    launcher_pid: int | None = None

    @property
    def in_torchrun(self) -> bool:
        return self.run_id is not None or None not in (self.rank, self.world_size, self.master_addr,
                                                         self.master_port)

    @property
    def run_name(self) -> str | None:
        """The run's id, where it has one worth naming a folder after."""
        return self.run_id if self.run_id and self.run_id != "none" else None


def compile_backend_problem(backend: str) -> str | None:
    """Why PARATRAIN_COMPILE_BACKEND's value is not one torch.compile takes (None: it is)."""
    import torch._dynamo  # a process that compiles has imported it, or will

    valid = torch._dynamo.list_backends(exclude_tags=())
    return None if backend in valid else \
        f"PARATRAIN_COMPILE_BACKEND {backend!r} is not a torch.compile backend; valid: {', '.join(valid)}"


def child_environment(**changes: str) -> dict[str, str]:
    """The environment for a child process we start (a server, a worker, a benchmark): this
    process's, with `changes`. The one place besides `resolve` that touches os.environ."""
    return {**os.environ, **changes}


# The environment this process had when it imported this module. In a forkserver (see
# paratrain/forking.py) that is the server's, so a child forked from it can tell the variables
# its starter set for it (those that differ) from the ones it merely inherited.
_ENVIRONMENT_AT_IMPORT = dict(os.environ)


def take_environment(environ: Mapping[str, str], *, keep_set_since_import: bool = False) -> None:
    """Make `environ` this process's environment (a child forked from a server takes its
    launcher's); with `keep_set_since_import`, what was set since this module was imported
    stays on top (the elastic agent's RANK, WORLD_SIZE, ... for the rank it forked)."""
    kept = {k: v for k, v in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(k) != v} if keep_set_since_import else {}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(kept)


def threads_from_environment() -> int | None:
    """OMP_NUM_THREADS as a number, where it is one."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def default_threads_for_children(threads: int = 1) -> None:
    """OMP_NUM_THREADS for the ranks the elastic launcher starts (they inherit this process's
    environment), unless the user set it: torchrun's default, which also silences its warning."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


@contextmanager
def torch_reads(name: str, value: str):
    """While the block runs, PyTorch finds `value` for the variable `name` in this process's
    environment (some of its choices have no other switch); restored after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    env = os.environ if environ is None else environ

    def number(name: str, default=None):
        raw = env.get(name)
        return default if raw in (None, "") else int(raw)

    return LaunchEnvironment(
        rank=number("RANK"), world_size=number("WORLD_SIZE"), local_rank=number("LOCAL_RANK", 0),
        local_world_size=number("LOCAL_WORLD_SIZE"), master_addr=env.get("MASTER_ADDR"),
        master_port=number("MASTER_PORT"), run_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=number("TORCHELASTIC_RESTART_COUNT", 0),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        launcher_pid=number("PARATRAIN_LAUNCHER_PID"),
    )


@dataclass(frozen=True)
class Settings:
    """One process's settings. Each field's default says why it is what it is; `sources` says
    where each value came from: "default", "environment (NAME)" or "flag"."""

    timeout: float = 300.0  # generous: a first NCCL call or a slow rank on a busy host is normal
    debug: bool = False  # the checks cost a round of messages per collective
    algo_table: str | None = None  # None: the cached table, and only where it was measured (see choice.py)
    cache_dir: str = "~/.cache"
    trace_dir: str | None = None
    shm: bool = True  # shared memory beat gloo's sockets at every size measured on one host
    shm_bytes: int | None = None  # None: shm_setup sizes the rings by the number of peers
    shm_spin_us: int | None = None  # None: shm_setup decides by the cores and ranks of the host
    shm_dir: str = "/dev/shm"  # Linux's tmpfs for POSIX shared memory, on every distribution
    host: str | None = None  # None: the machine's own name (socket.gethostname)
    native: bool = True  # a 16 KiB all-reduce took 7 us through torch's ops (comm/native)
    cc: str | None = None
    server: str | None = None
    token: str | None = None
    backend: str | None = None  # None: a GPU per worker where there are GPUs
    signal_config: str | None = None
    auto_compile: bool = False  # off, as in GT: compiling costs seconds before it pays
    hotpath_threshold: int = 5  # GT's documented default: a loop is hot after five iterations
    hotpath_min_seq: int = 3  # shorter sequences save too little launch overhead to pay for a compile
    hotpath_window: int = 20  # bounds the detector's work per operation (it counts every suffix)
    hotpath_max_expand: int = 4  # GT's default: four iterations per function cut calls by four
    debug_compile: bool = False
    save_compiled_code: str | None = None
    compile_backend: str = "inductor"  # torch.compile's own default
    wandb_mode: str = "offline"  # a run logs to W&B's servers only when asked to
    launch: LaunchEnvironment = field(default_factory=LaunchEnvironment)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **flags) -> Settings:
        """Defaults, then the environment (`environ`, default this process's), then `flags`
        (those not None). Raises SettingsError naming the variable whose value is wrong."""
        env = os.environ if environ is None else environ
        values, sources = {}, {}
        for spec in SPECS:
            for variable in spec.variables:
                raw = env.get(variable)
                if raw is not None and raw.strip() != "":
                    values[spec.name] = spec.parse(variable, raw)
                    sources[spec.name] = f"environment ({variable})"
                    break
            else:
                sources[spec.name] = "default"
        settings = cls(**values, launch=launch_environment(env), sources=sources)
        return settings.with_flags(**flags)

    def with_flags(self, **flags) -> Settings:
        """These settings with `flags` (those not None) put over them, as a command line does."""
        given = {name: value for name, value in flags.items() if value is not None}
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"no such setting: {', '.join(sorted(unknown))}")
        if not given:
            return self
        return replace(self, **given, sources={**self.sources, **{name: "flag" for name in given}})

    def in_this_process(self) -> Settings:
        """These settings, resolved in a parent, with this process's own launch environment
        (a spawned rank's RANK, LOCAL_RANK, ...)."""
        return replace(self, launch=launch_environment())

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")

    @property
    def host_name(self) -> str:
        """The name this process gives its host: PARATRAIN_HOST, else the machine's own."""
        return self.host or socket.gethostname()

    @property
    def table_path(self) -> Path:
        """The algorithm table: the one named, else the cache's."""
        if self.algo_table:
            return Path(self.algo_table).expanduser()
        return Path(self.cache_dir).expanduser() / "paratrain" / "algorithms.json"
