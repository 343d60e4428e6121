"""A run of instructions as one Python function, for torch.compile to trace.

`spec_of` reads a run (consecutive compilable instructions of one client) and finds what the
function takes and returns (a `RunSpec`): its inputs are the tensors the run reads but did not make, in
order of first use; its outputs are the results the run makes that were not freed before it
ended (a result freed inside the run is never materialised, so the compiler may fuse it away).
The spec's `key` is the run's signature: each operation with its constant arguments and
where each tensor argument comes from (an input, or an earlier operation's result), the shape,
stride, dtype, device and requires_grad of every input, grad mode and which results are kept.
Two runs with the same key compute the same function of their inputs.

`source` writes that function as Python, one line per instruction, calling the operation's
own function from the table (`ops.py`), so that compiled and eager execution run the same
code. Constant arguments are written as literals: they are plain values (numbers, short
strings, lists of them) checked when the instruction was decoded, and strings go through
`repr`, so no text of a message ever becomes code.
"""

from __future__ import annotations

import hashlib
import linecache
import math
from typing import NamedTuple

import torch

from paratrain.frontend.ops import OPS
from paratrain.frontend.protocol import Instruction

# Random operations end a run instead of joining it: compiled code draws other numbers than
# eager code.
COMPILABLE = frozenset(name for name, op in OPS.items() if op.fn is not None and op.kind == "compute"
                       and not op.random)


class RunSpec(NamedTuple):
    """What the function of a run takes and returns, and its signature."""
    key: tuple  # the run's signature
    inputs: list  # handles the function takes, in order
    tensors: list  # the tensors under them now
    outputs: list  # handles of the results it returns, in order
    kept: list  # (instruction index, result index) of each output


def spec_of(run: list[Instruction], freed: set, lookup) -> RunSpec | None:
    """The function a run computes; `lookup(handle)` gives an input's tensor, or None where
    there is none (then so is the spec: the run must go eagerly, to report the error)."""
    made: dict[int, tuple[int, int]] = {}
    inputs: dict[int, int] = {}
    steps = []
    for index, instruction in enumerate(run):
        sources = []
        for position in instruction.targs:
            handle = instruction.args[position]
            if handle in made:
                sources.append(made[handle])
            else:
                sources.append(inputs.setdefault(handle, len(inputs)))
        constants = tuple(_frozen(arg) if position not in instruction.targs else None
                          for position, arg in enumerate(instruction.args))
        steps.append((instruction.op, tuple(instruction.targs), tuple(sources), constants,
                      _frozen(instruction.kwargs), len(instruction.outs)))
        for result, handle in enumerate(instruction.outs):
            made[handle] = (index, result)
    tensors = [lookup(handle) for handle in inputs]
    if not all(isinstance(tensor, torch.Tensor) for tensor in tensors):
        return None
    outputs = [handle for handle in made if handle not in freed]
    kept = [made[handle] for handle in outputs]
    described = tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)
    key = (run[0].no_grad, tuple(steps), described, tuple(kept))
    return RunSpec(key, list(inputs), tensors, outputs, kept)


def digest(key: tuple) -> str:
    """A short stable name for a signature (file names, debug lines)."""
    return hashlib.sha1(repr(key).encode()).hexdigest()[:12]


def source(run: list[Instruction], spec: RunSpec, name: str) -> str:
    """The run as the Python function `name(i0, i1, ...)`."""
    inputs = {handle: f"i{n}" for n, handle in enumerate(spec.inputs)}
    values = dict(inputs)
    lines = [f"def {name}({', '.join(inputs.values())}):"]
    for index, instruction in enumerate(run):
        results = [f"t{index}_{r}" for r in range(len(instruction.outs))]
        values.update(zip(instruction.outs, results))
        targs = set(instruction.targs)
        args = [values[arg] if position in targs else _literal(arg) for position, arg in enumerate(instruction.args)]
        args += [f"{key}={_literal(value)}" for key, value in instruction.kwargs.items()]
        target = results[0] if len(results) == 1 and OPS[instruction.op].results == 1 else ", ".join(results) + ","
        lines.append(f"    {target} = op_{instruction.op}({', '.join(args)})")
    returned = [f"t{index}_{result}" for index, result in spec.kept]
    lines.append(f"    return ({', '.join(returned)}{',' if len(returned) == 1 else ''})")
    return "\n".join(lines) + "\n"


def function(text: str, name: str, run: list[Instruction]):
    """The function defined by `text` (from `source`), its operations bound to the table's."""
    filename = f"<paratrain region {name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # readable tracebacks
    namespace = {f"op_{instruction.op}": OPS[instruction.op].fn for instruction in run}
    exec(compile(text, filename, "exec"), namespace)  # noqa: S102 - our own generated code, see the module doc
    return namespace[name]


def _literal(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(item) for item in value) + "]"
    return repr(value)


def _frozen(value):
    """A plain value (lists and maps included) as something hashable, kept apart by type
    (1, 1.0 and True are different constants to a compiled function)."""
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    if isinstance(value, list):
        return ("list", tuple(_frozen(item) for item in value))
    if isinstance(value, float):
        return ("float", repr(value))  # so that a NaN constant equals itself
    return (type(value).__name__, value)
