"""Hardware profiles: what a device computes, what its links carry, what the software stack does.

A profile is a YAML file (see hardware/*.yaml, each value with its source). `load_profile`
takes a shipped name (`a100-80gb-hdr`) or a path. Achievable rates are the data-sheet peak times
an efficiency, so a reader sees both what the vendor promises and what the model assumes.
Measured collectives (`paratrain model fit`) may be added under `collectives:`; where one
matches an operation and group size the model uses it instead of the link formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path


from paratrain.errors import UnreadableYaml, read_yaml
from paratrain.plan.activations import Software

PROFILE_DIR = Path(__file__).parent / "hardware"


@dataclass(frozen=True)
class Compute:
    peak_tflops: float            # per device, dense, in the precision trained in
    matmul_efficiency: float      # share of peak large weight matmuls reach
    attention_efficiency: float   # share of peak the attention kernel reaches
    memory_gbps: float            # device memory bandwidth (data sheet, or measured)
    memory_efficiency: float      # share of it element-wise operators reach
    op_overhead_us: float = 0.0   # time per operator beyond its work (launch, dispatch, autograd)

    @property
    def matmul_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.matmul_efficiency

    @property
    def attention_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.attention_efficiency

    @property
    def memory_bytes_per_s(self) -> float:
        return self.memory_gbps * 1e9 * self.memory_efficiency


@dataclass(frozen=True)
class Link:
    bandwidth_gbps: float  # per device and direction (GB/s, 1e9 bytes)
    efficiency: float      # share of it collectives reach
    latency_us: float      # per message (alpha)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 * self.efficiency


@dataclass(frozen=True)
class Fitted:
    """One op at one group size, measured: time = alpha + bytes / bandwidth, fitted; and the
    measured (bytes, microseconds) points themselves, which are used between the smallest and
    largest size measured (log-log interpolation) where a line fits badly (gloo switches
    algorithms with size)."""

    alpha_us: float
    gbps: float
    points: tuple[tuple[float, float], ...] = ()

    def seconds(self, nbytes: float) -> float:
        points = sorted(self.points)
        if len(points) >= 2 and points[0][0] <= nbytes <= points[-1][0]:
            for (x0, y0), (x1, y1) in zip(points, points[1:]):
                if nbytes <= x1:
                    share = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
                    return math.exp(math.log(y0) + share * (math.log(y1) - math.log(y0))) * 1e-6
        return self.alpha_us * 1e-6 + nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    devices_per_node: int
    device_memory_gib: float
    reserved_gib: float            # held by runtime, communication buffers, fragmentation
    compute: Compute
    intra_node: Link
    inter_node: Link
    software: Software
    cores: int = 0                 # a CPU host: ranks beyond this many share the cores; 0: not a CPU
    dp_overlap: float = 1.0        # share of the gradient all-reduce backward can hide
    collectives: dict[str, Fitted] = field(default_factory=dict)  # "op/world_size" -> fit

    @property
    def usable_bytes(self) -> float:
        return (self.device_memory_gib - self.reserved_gib) * (1 << 30)

    def fitted(self, op: str, world_size: int) -> Fitted | None:
        return self.collectives.get(f"{op}/{world_size}")


def shipped_profiles() -> list[str]:
    return sorted(path.stem for path in PROFILE_DIR.glob("*.yaml"))


def _section(cls, raw: dict, where: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
    try:
        return cls(**raw)
    except TypeError as error:
        raise ValueError(f"{where}: {error}") from None


def profile_from_dict(raw: dict, source: str = "profile") -> HardwareProfile:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a mapping at the top level")
    raw = dict(raw)
    nested = {"compute": Compute, "intra_node": Link, "inter_node": Link, "software": Software}
    for key, cls in nested.items():
        if key not in raw:
            raise ValueError(f"{source}: missing section '{key}'")
        raw[key] = _section(cls, raw[key] or {}, f"{source}: {key}")
    raw["collectives"] = {key: _section(Fitted, {**value, "points": tuple(map(tuple, value.get("points", ())))},
                                        f"{source}: collectives.{key}")
                          for key, value in (raw.get("collectives") or {}).items()}
    return _section(HardwareProfile, raw, source)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name, or a YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise ValueError(f"unknown hardware profile {str(name_or_path)!r}; shipped: "
                             f"{', '.join(shipped_profiles())}, or give a YAML file")
    try:
        raw = read_yaml(path, "hardware profile")
    except UnreadableYaml as error:
        raise ValueError(str(error)) from None
    return profile_from_dict(raw, str(path))


def profile_to_dict(profile: HardwareProfile) -> dict:
    """Plain data for YAML, in the order the shipped files use."""
    def plain(obj):
        return {f.name: getattr(obj, f.name) for f in fields(obj)}

    raw = plain(profile)
    for key in ("compute", "intra_node", "inter_node", "software"):
        raw[key] = plain(raw[key])
    raw["collectives"] = {key: plain(value) for key, value in profile.collectives.items()}  # points kept
    return raw
