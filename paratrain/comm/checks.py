"""Argument checks for collectives, and the debug check that all ranks make the same call.

Arguments are checked on each rank before anything is sent, so a bad call raises a clear
error instead of hanging. The debug check (Group(debug=True) or PARATRAIN_DEBUG=1) goes
further: before each collective the ranks swap a fixed-size description of their call, so a
rank that calls all_gather while the others call all_reduce, or with another shape or dtype,
gets an error naming the ranks that differ.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from paratrain.comm.errors import CollectiveMismatchError
from paratrain.comm.link import Link
from paratrain.comm.ops import Splits
from paratrain.comm.transport.base import P2POp

_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "barrier")
_ALGOS = ("ring", "hd", "tree", "direct", "native", "oneshot", "twoshot")  # appended: codes stay
_REDUCE = ("", "sum", "avg", "max", "min")
_DTYPES = (
    None, torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_MAX_DIMS = 8
_WIDTH = 6 + _MAX_DIMS  # op, algo, dtype, reduce op, root, ndim, dims...
ANY_ROWS = -2  # a dimension 0 that differs from rank to rank (the missing dims are -1)


def tensor_arg(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name!r} must be a torch.Tensor, got {type(value).__name__}")


def same_dtype(op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{op}: output is on {output.device}, input on {input.device}")


def numel(op: str, name: str, tensor: torch.Tensor, expected: int, what: str) -> None:
    if tensor.numel() != expected:
        raise ValueError(
            f"{op}: {name!r} has {tensor.numel()} elements, expected {expected} ({what})"
        )


def row_splits(op: str, output: torch.Tensor, input: torch.Tensor, output_split_sizes, input_split_sizes,
               size: int) -> Splits:
    """An uneven all-to-all's split sizes, rows of dimension 0 as torch.distributed's
    all_to_all_single takes them (None: equal parts), as element counts of the flat buffers."""
    out_shape, in_shape = output.shape, input.shape
    for name, shape in (("output", out_shape), ("input", in_shape)):
        if not shape:
            raise ValueError(f"{op}: split sizes count rows of dimension 0, and {name!r} has no dimensions")
    row = in_shape[1:]
    if out_shape[1:] != row:
        raise ValueError(f"{op}: a row of 'output' has shape {list(out_shape[1:])} and a row of 'input' "
                         f"{list(row)}; they must be the same")
    receive = _split_sizes(op, "output", out_shape[0], output_split_sizes, size)
    send = _split_sizes(op, "input", in_shape[0], input_split_sizes, size)
    elements = row.numel()  # of a row
    if elements == 1:
        return Splits(send, receive)
    return Splits(tuple(rows * elements for rows in send), tuple(rows * elements for rows in receive))


def _split_sizes(op: str, name: str, rows: int, sizes, ranks: int) -> tuple[int, ...]:
    option = f"{name}_split_sizes"
    if sizes is None:
        if rows % ranks:
            raise ValueError(f"{op}: {option} left out, so {name!r}'s {rows} rows must split evenly over "
                             f"{ranks} ranks; give {option}")
        return (rows // ranks,) * ranks
    if isinstance(sizes, (str, bytes, torch.Tensor)) or not hasattr(sizes, "__len__"):
        raise TypeError(f"{op}: {option} must be a list of ints, one per rank, got {type(sizes).__name__}")
    if len(sizes) != ranks:
        raise ValueError(f"{op}: {option} has {len(sizes)} entries, expected {ranks} (one per rank)")
    try:
        counts = tuple(map(operator.index, sizes))
    except TypeError:
        raise TypeError(f"{op}: {option} must hold ints, got {list(sizes)!r}") from None
    if min(counts) < 0:
        raise ValueError(f"{op}: {option} {list(counts)} holds a negative size")
    if sum(counts) != rows:
        raise ValueError(f"{op}: {option} {list(counts)} sum to {sum(counts)} rows, but {name!r} has {rows} "
                         f"(its dimension 0)")
    return counts


def root(op: str, value, size: int) -> None:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"{op}: root {value!r} out of range [0, {size})")


def flat_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view to write results into: the tensor itself, or a contiguous copy."""
    if not tensor.is_contiguous():
        return tensor.contiguous().view(-1)
    return tensor if tensor.dim() == 1 else tensor.view(-1)  # a view costs a microsecond or two


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat, contiguous, read-only view of an input."""
    return flat_buffer(tensor)


def write_back(tensor: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        tensor.copy_(buf.view(tensor.shape))
    return tensor


class CallSignature(NamedTuple):
    """What a collective call is, as the debug check and the flight recorder see it. A named
    tuple: every call makes one, and a tuple is the cheapest object to make."""

    op: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    reduce_op: str = ""
    root: int = -1
    algo: str = "native"

    @classmethod
    def of(cls, op: str, tensor: torch.Tensor | None, reduce_op: str = "", root: int = -1):
        if tensor is None:
            return cls(op, None, (), reduce_op, root)
        return cls(op, tensor.dtype, tuple(tensor.shape), reduce_op, root)

    @classmethod
    def of_rows(cls, op: str, tensor: torch.Tensor):
        """A call whose ranks pass as many rows as each has (an all-to-all with split sizes):
        the dtype and a row's shape must agree, dimension 0 (written ANY_ROWS) need not."""
        return cls(op, tensor.dtype, (ANY_ROWS, *tensor.shape[1:]))

    def with_algo(self, algo: str) -> CallSignature:
        return self._replace(algo=algo)

    def encode(self) -> torch.Tensor:
        dims = list(self.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
        dtype = _DTYPES.index(self.dtype) if self.dtype in _DTYPES else len(_DTYPES)
        head = [_OPS.index(self.op), _ALGOS.index(self.algo), dtype, _REDUCE.index(self.reduce_op)]
        return torch.tensor(head + [self.root, len(self.shape)] + dims, dtype=torch.int64)

    @staticmethod
    def describe(code: list[int]) -> str:
        op, algo, dtype, reduce_op, root, ndim = code[:6]
        text = _OPS[op]
        if _OPS[op] != "barrier":
            name = str(_DTYPES[dtype]).replace("torch.", "") if dtype < len(_DTYPES) else "other"
            dims = ["*" if dim == ANY_ROWS else dim for dim in code[6 : 6 + min(ndim, _MAX_DIMS)]]
            text += f"({name}[{', '.join(map(str, dims))}]"
            text += f", op={_REDUCE[reduce_op]}" if reduce_op else ""
            text += f", root={root}" if root >= 0 else ""
            text += ")"
        return f"{text} [algo={_ALGOS[algo]}]"


def same_call_everywhere(link: Link, signature: CallSignature) -> None:
    """Swap call descriptions with every rank; raise on all ranks if any differ."""
    mine = signature.encode()
    # Its own tag, one above the call's, so these messages never meet the call's own.
    check = Link(link.transport, link.op_name, link.seq, link.tag + (1 << 20), link.timeout, link.segment_bytes)
    others = [peer for peer in range(check.size) if peer != check.rank]
    received = {peer: torch.empty_like(mine) for peer in others}
    ops = [P2POp("send", mine, peer) for peer in others]
    ops += [P2POp("recv", received[peer], peer) for peer in others]
    check.wait(check.start(ops))
    received[check.rank] = mine
    by_call: dict[tuple[int, ...], list[int]] = {}
    for rank in range(check.size):
        by_call.setdefault(tuple(received[rank].tolist()), []).append(rank)
    if len(by_call) > 1:
        parts = [
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} called "
            f"{CallSignature.describe(list(code))}"
            for code, ranks in by_call.items()
        ]
        raise CollectiveMismatchError(
            f"rank {check.rank}: collective call #{check.seq} differs across ranks: " + "; ".join(parts)
        )
