"""The cases the collective checkers (collective_checks.py) run, and what each should give:
the matrix (world sizes, dtypes, counts, roots), every rank's input (a function of the case,
made once per process), the reference results, and the layouts a tensor is passed in.
"""

from __future__ import annotations

import functools
import zlib

import torch

from paratrain.comm import Group

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
REDUCE_OPS = ("sum", "avg", "max", "min")
RUN_TIMEOUT_S = 60.0  # a hang fails as a CommTimeoutError naming the call, not as a stuck suite

# Float inputs are multiples of 1/8 in [-2, 2]. Every partial sum of up to 8 of them is exact in
# float32, float16 (11 significant bits) and bfloat16 (8 bits), so sum, max and min are exact
# whatever order an algorithm reduces in, and a part dropped or folded in twice cannot hide
# inside a tolerance. What is left is avg's division: the group divides once in the tensor's own
# dtype, the reference in float64 rounded once to that dtype, so the two may differ by the
# rounding of one division, one unit in the last place: 2^-23 (float32), 2^-10 (float16),
# 2^-7 (bfloat16) relative. The tolerances allow twice that; float16/bfloat16 need the looser
# ones because they have so few bits. int64 is compared exactly (avg truncates on both sides).
FLOAT_TOLERANCE = {  # dtype: (rtol, atol)
    torch.float32: (2.4e-7, 1e-7),
    torch.float16: (2e-3, 1e-4),
    torch.bfloat16: (1.6e-2, 1e-3),
}
SENTINEL = {True: 99.0, False: 10**12}  # is_floating_point -> a value no result can take

# 77 elements split unevenly over every world size tested, and viewed as 7 x 11 it can be
# stored transposed, so one count serves every non-contiguous layout.
NONCONTIGUOUS_COUNT, NONCONTIGUOUS_SHAPE = 77, (7, 11)


def counts_for(world_size: int) -> list[int]:
    """Empty, one element, fewer elements than ranks, not divisible by the world size, and a
    few hundred / thousand (20001 float32 is over the fabric's 64 KiB, so `auto` picks ring)."""
    return sorted({0, 1, max(world_size - 1, 1), 2 * world_size + 1, 300, 4099, 20001})


def roots_for(world_size: int) -> list[int]:
    return sorted({0, world_size // 2, world_size - 1})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- inputs and references ---------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def rank_input(rank: int, count: int, dtype: torch.dtype, salt: str) -> torch.Tensor:
    """Rank `rank`'s input for a case, shared and read-only: each check copies its own rank's
    into the tensor it hands the collective (stored_as, copy_), so none is ever written to,
    and the rank threads of one process share them instead of each cloning every rank's."""
    seed = zlib.crc32(f"{rank}/{count}/{dtype}/{salt}".encode())  # same in every process
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randint(-16, 17, (count,), generator=generator) / 8).to(dtype)
    return torch.randint(-10**6, 10**6, (count,), generator=generator, dtype=dtype)


def case_inputs(size: int, count: int, dtype: torch.dtype, salt: str) -> list[torch.Tensor]:
    """Every rank's input for a case of `count` elements a rank (read-only, as rank_input's)."""
    return [rank_input(rank, count, dtype, salt) for rank in range(size)]


def reduced(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The reduction of all ranks' inputs, computed exactly: max and min in the inputs' dtype
    (exact in any), sums in float64 or int64. Folded one input at a time, elementwise: a
    stack of them and a reduction over its first dimension cost several times as much on
    messages of a few MiB (test_shm_arena.py)."""
    dtype, n = inputs[0].dtype, len(inputs)
    if op in ("max", "min"):
        extreme = torch.maximum if op == "max" else torch.minimum
        return functools.reduce(extreme, inputs[1:], inputs[0].clone())
    total = torch.zeros(inputs[0].shape, dtype=torch.float64 if dtype.is_floating_point else dtype)
    for x in inputs:
        total += x
    if op == "avg":
        total = total / n if dtype.is_floating_point else torch.div(total, n, rounding_mode="trunc")
    return total.to(dtype)


# The ranks of a threads world check the same case at about the same time (the collective keeps
# them in step), so a small cache lets one of them compute the reference for all; read-only too.
@functools.lru_cache(maxsize=64)
def reference(size: int, count: int, dtype: torch.dtype, salt: str, op: str) -> torch.Tensor:
    """`reduced` of a case's inputs."""
    return reduced(case_inputs(size, count, dtype, salt), op)


def parts(tensor: torch.Tensor, world_size: int) -> tuple[torch.Tensor, ...]:
    """torch.tensor_split's parts: the rule the collectives document for uneven counts."""
    return torch.tensor_split(tensor, world_size)


def stored_as(values: torch.Tensor, layout: str, device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tensor on `device` whose logical (row-major) contents are `values`, stored as `layout`
    says, and for "strided" the skipped elements in between (the sentinel, to be checked)."""
    count, dtype = values.numel(), values.dtype
    if layout == "contiguous":
        return values.to(device, copy=True), None
    if layout == "transposed":
        rows, cols = NONCONTIGUOUS_SHAPE
        tensor = torch.empty(cols, rows, dtype=dtype, device=device).t()
        tensor.copy_(values.view(rows, cols))
        return tensor, None
    if layout == "strided":
        storage = torch.full((2 * count,), SENTINEL[dtype.is_floating_point], dtype=dtype, device=device)
        storage[::2] = values
        return storage[::2], storage[1::2]
    raise ValueError(layout)


def output_buffer(count: int, dtype: torch.dtype, layout: str, device="cpu"):
    """An output buffer pre-filled with the sentinel, so elements left unwritten show."""
    return stored_as(torch.full((count,), SENTINEL[dtype.is_floating_point], dtype=dtype), layout, device)


def device_of(group: Group) -> torch.device:
    """Where this rank's tensors live: the CPU, or its GPU (fabric on CUDA, NCCL)."""
    return getattr(group.transport, "device", torch.device("cpu"))
