"""Signal configurations: how each named region of a program places its tensors.

The schema is the GT seed's (`sharding_config.yaml`):

    pp_stage0_colpar:          # a signal name, used as `with gt.signal.context("pp_stage0_colpar"):`
      shard:
        axis: 1                # tensors created in the region are split along this axis ...
        workers: [0, 1]        # ... over these workers (part r on the r-th of them)
      backward: grads0         # optional: how gradients crossing back into the region travel
      compile: true            # optional: each worker runs its part of the region compiled
    pp_stage0:
      workers: [0, 1]          # no shard: tensors created here are replicated on these workers

GT's keys work too: `shard.workers` (or `workers`) left out or null means every worker,
`shard.replicated: true` copies tensors whole instead of splitting them, and `compile: true`
marks the region for compilation on the workers.

What a signal means (see docs/frontend.md for the whole story): tensors *created* in its
region are laid out as it says, and operations issued in it run on its workers (inputs that
live elsewhere are moved there first). A result takes the layout its operation produces: a
matmul with a weight split on its output axis gives a result split on its last axis, without
communication. `gt.signal.tensor(x, name)` moves or re-splits a tensor explicitly.

`backward: T` names a signal with the same workers as a region's *sources*: the gradient of a
tensor moved into the region travels back split as T says, and is gathered there (Megatron's
scatter-gather of pipeline messages: each link carries a part instead of the whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.errors import Problems, UnreadableYaml, read_yaml

MAX_RANK = 8  # axes are checked against [-8, 8) when loaded, against the tensor when used
_SIGNAL_KEYS = {"shard", "workers", "backward", "compile"}
_SHARD_KEYS = {"axis", "workers", "replicated"}


class ConfigError(Problems, ValueError):
    """A signal configuration with problems; the message has one line per problem."""


@dataclass(frozen=True)
class Signal:
    name: str
    workers: tuple[int, ...]  # () : the signal places nothing (its region runs where its inputs live)
    axis: int | None  # None: replicated on every worker
    backward: str | None = None
    compile: bool = False  # run the region compiled on its workers (GT's `compile: true`)

    @property
    def places(self) -> bool:
        """Whether the region's tensors and operations go to the signal's workers."""
        return bool(self.workers)

    def describe(self) -> str:
        where = ",".join(map(str, self.workers))
        return f"split {self.axis} over [{where}]" if self.axis is not None else f"replicated on [{where}]"


def parse(config, n_workers: int | None = None) -> dict[str, Signal]:
    """{name: Signal} from a mapping (a loaded YAML file or a dict); ConfigError lists every
    problem found. With `n_workers`, workers are checked to exist and "every worker" (workers
    left out or null) is resolved; without it, such a signal's workers are () (unresolved).
    A `backward` naming no signal here is not a problem yet: signals may be registered in any
    order, and the name is looked up when a tensor first crosses into the region."""
    if not isinstance(config, dict):
        raise ConfigError([f"a signal configuration must be a mapping of names to settings, got {type(config).__name__}"])
    problems, signals = [], {}
    for name, settings in config.items():
        signal = _parse_one(str(name), settings, n_workers, problems)
        if signal is not None:
            signals[str(name)] = signal
    if problems:
        raise ConfigError(problems)
    return signals


def _parse_one(name: str, settings, n_workers, problems: list[str]) -> Signal | None:
    if not isinstance(settings, dict):
        problems.append(f"{name}: settings must be a mapping (shard / workers / backward), got {settings!r}")
        return None
    for key in sorted(set(settings) - _SIGNAL_KEYS):
        problems.append(f"{name}: unknown key {key!r} (valid: {', '.join(sorted(_SIGNAL_KEYS))})")
    shard = settings.get("shard")
    axis, workers = None, settings.get("workers")
    if shard is not None:
        if not isinstance(shard, dict):
            problems.append(f"{name}: shard must be a mapping with axis and workers, got {shard!r}")
            return None
        for key in sorted(set(shard) - _SHARD_KEYS):
            problems.append(f"{name}: unknown key shard.{key} (valid: {', '.join(sorted(_SHARD_KEYS))})")
        axis = shard.get("axis", 0)
        if not isinstance(axis, int) or isinstance(axis, bool) or not -MAX_RANK <= axis < MAX_RANK:
            problems.append(f"{name}: shard.axis must be an integer in [{-MAX_RANK}, {MAX_RANK}), got {axis!r}")
        replicated = shard.get("replicated", False)
        if not isinstance(replicated, bool):
            problems.append(f"{name}: shard.replicated must be true or false, got {replicated!r}")
        elif replicated:
            axis = None
        if workers is not None and shard.get("workers") is not None and workers != shard.get("workers"):
            problems.append(f"{name}: workers and shard.workers disagree ({workers} vs {shard.get('workers')})")
        workers = shard.get("workers") if shard.get("workers") is not None else workers
    compiled = settings.get("compile", False)
    if not isinstance(compiled, bool):
        problems.append(f"{name}: compile must be true or false, got {compiled!r}")
    if shard is None and workers is None:  # e.g. only `compile: true`: the region places nothing
        return Signal(name, (), None, _backward(name, settings, problems), compiled is True)
    if workers is None:  # GT's default: every worker
        workers = list(range(n_workers)) if n_workers is not None else None
    if workers is None:
        workers_checked: tuple = ()
    elif not isinstance(workers, list) or not workers or not all(isinstance(w, int) and not isinstance(w, bool) for w in workers):
        problems.append(f"{name}: workers must be a non-empty list of worker numbers, got {workers!r}")
        return None
    else:
        workers_checked = tuple(workers)
        if len(set(workers)) != len(workers):
            problems.append(f"{name}: workers {workers} lists a worker twice")
        missing = [w for w in workers if w < 0 or (n_workers is not None and w >= n_workers)]
        if missing:
            have = f"there are {n_workers} (0..{n_workers - 1})" if n_workers is not None else "numbers start at 0"
            problems.append(f"{name}: worker(s) {missing} do not exist: {have}")
    return Signal(name, workers_checked, axis if isinstance(axis, int) and not isinstance(axis, bool) else None,
                  _backward(name, settings, problems), compiled is True)


def _backward(name: str, settings: dict, problems: list[str]) -> str | None:
    backward = settings.get("backward")
    if backward is not None and not isinstance(backward, str):
        problems.append(f"{name}: backward must name another signal, got {backward!r}")
        return None
    return backward


def check(config) -> None:
    """ConfigError if any signal of `config` is malformed on its own (before the number of
    workers is known: that and `backward` names are checked where they can be)."""
    parse(config)


def named_workers(settings) -> list[int]:
    """The worker numbers one signal's settings name (none if it means every worker)."""
    if not isinstance(settings, dict):
        return []
    shard = settings.get("shard") if isinstance(settings.get("shard"), dict) else {}
    workers = shard.get("workers") if shard.get("workers") is not None else settings.get("workers")
    return [w for w in workers if isinstance(w, int)] if isinstance(workers, list) else []


def load(source) -> dict:
    """The raw configuration from a YAML path or a dict (validated later, when the number of
    workers is known)."""
    if isinstance(source, dict):
        return source
    try:
        loaded = read_yaml(source, "signal configuration")
    except UnreadableYaml as error:
        raise ConfigError([str(error)]) from None
    return loaded if loaded is not None else {}
