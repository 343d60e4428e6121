"""What a worker does with instructions: run them, in order, on the tensors it holds.

Tensors are kept under a key `slot << 32 | handle`, where `slot` numbers the client (the
dispatcher assigns it) and `handle` is the number the client chose. An instruction that fails
records an error for its client and *poisons* its results: later instructions that use them
are skipped without a second error, and the client hears of the first one at its next sync.

Tensors move between workers with paratrain's own point-to-point (`Group.send/recv`). A
transfer of a tensor that requires grad is differentiable: the receiver's copy becomes a leaf
(a "boundary"), and in backward the receiver sends that leaf's gradient back, under a tag made
from the transfer's number, and the sender continues backward from the original tensor.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import torch

from paratrain.frontend.collective_ops import CollectiveOps
from paratrain.frontend.ops import DTYPE_NAMES, OPS, TORCH_DTYPES, torch_dtype
from paratrain.parallel.tensor.tp_comms import all_gather_along

HANDLE_BITS = 32
_HEADER = 16  # int64 slots: ndim (or a negative code), dims..., dtype, requires_grad
_NO_GRAD, _POISONED = -1, -2
_DTYPE_CODES = list(TORCH_DTYPES.values())
MAX_SENDS_IN_FLIGHT = 64
MAX_ERRORS_KEPT = 64  # per client between two syncs: the first ones explain the rest


class Executor(CollectiveOps):
    def __init__(self, group, device: torch.device):
        self.group = group  # None for a world of one worker
        self.groups = {}  # worker tuple -> Group, for collectives over some workers
        self.device = device
        self.rank = group.rank if group is not None else 0
        self.tensors: dict[int, object] = {}  # tensors, and optimizers under their handle
        self.poisoned: dict[int, str] = {}
        self.errors: dict[int, list] = defaultdict(list)
        self.boundary: dict[int, torch.Tensor] = {}  # transfer -> the received leaf
        self.pending: dict[int, torch.Tensor] = {}  # transfer -> the sent tensor
        self.mailbox: dict[int, deque] = defaultdict(deque)  # tag -> what this worker sent itself
        self.in_flight: deque = deque()  # sends posted and not yet waited for
        self.executed = 0
        self.wait_s = 0.0  # time spent waiting for another worker's tensor (a pipeline's bubble)

    # ---- running a batch ----------------------------------------------------------------

    def run_batch(self, slot: int, ops: list, frames: list, timings: list | None) -> None:
        base = slot << HANDLE_BITS
        for instr in ops:
            if timings is not None:
                started, clock = time.time(), time.perf_counter()
                self._run(slot, base, instr, frames)
                log_id = (instr[6] or {}).get("L")
                if log_id is not None:
                    timings.append([log_id, started, time.perf_counter() - clock])
            else:
                self._run(slot, base, instr, frames)
        self.executed += len(ops)

    def _run(self, slot: int, base: int, instr: list, frames: list) -> None:
        seq, name, outs, args, targs, kwargs, flags = instr
        handles = [args[i] for i in targs]
        try:
            for i, handle in zip(targs, handles):
                key = base + handle
                if key in self.poisoned:  # an earlier failure: skip quietly, pass it on
                    self._poison(base, outs, handles, name, self.poisoned[key])
                    if name == "send":  # the receiving worker is waiting for a header
                        self._send_header_only(kwargs["to"], 0, _POISONED)
                    return
                if key not in self.tensors:
                    raise KeyError(f"handle {handle} is not a tensor on worker {self.rank}")
                args[i] = self.tensors[key]
            with torch.set_grad_enabled(not (flags and flags.get("ng"))):
                self._execute(base, name, outs, args, kwargs, flags, frames)
        except Exception as error:  # noqa: BLE001 - reported to the client, never kills the worker
            message = f"{type(error).__name__}: {error}"
            self._record_error(slot, seq, name, args, targs, message)
            self._poison(base, outs, handles, name, message)

    def _execute(self, base, name, outs, args, kwargs, flags, frames):
        op = OPS.get(name)
        if op is not None and op.fn is not None:
            if op.kind == "create":
                result = op.fn(*args, device=self.device, **kwargs)
                if flags and flags.get("rg"):
                    result.requires_grad_(True)
            else:
                result = op.fn(*args, **kwargs)
            if op.kind != "inplace":
                self._store(base, outs, result)
            return
        getattr(self, "_op_" + name)(base, outs, args, kwargs, flags, frames)

    def _store(self, base: int, outs: list, result) -> None:
        if isinstance(result, (tuple, list)):
            if len(result) != len(outs):
                raise RuntimeError(f"produced {len(result)} results, the client expected {len(outs)}")
            for handle, value in zip(outs, result):
                self.tensors[base + handle] = value
        else:
            self.tensors[base + outs[0]] = result

    def _poison(self, base, outs, handles, name, message) -> None:
        for handle in outs:
            self.poisoned[base + handle] = message
        if handles and name in OPS and OPS[name].kind == "inplace":
            self.poisoned[base + handles[0]] = message

    def _record_error(self, slot, seq, name, args, targs, message) -> None:
        kept = self.errors[slot]
        if len(kept) < MAX_ERRORS_KEPT:
            shapes = [_describe(args[i]) for i in targs]
            kept.append([seq, name, shapes, self.rank, message])

    # ---- client requests outside the stream ---------------------------------------------

    def sync(self, slot: int, fetch: list[int]) -> tuple[list, list, list]:
        """Errors since the last sync, and the fetched tensors as (handle, dtype, shape) + bytes."""
        base = slot << HANDLE_BITS
        self.wait_sends()
        errors = self.errors.pop(slot, [])
        meta, frames = [], []
        for handle in fetch:
            key = base + handle
            if key in self.poisoned:
                meta.append([handle, None, self.poisoned[key]])
                continue
            tensor = self.tensors.get(key)
            if not isinstance(tensor, torch.Tensor):
                meta.append([handle, None, "no such tensor on this worker"])
                continue
            data = tensor.detach().to("cpu").contiguous()
            meta.append([handle, DTYPE_NAMES[data.dtype], list(data.shape)])
            frames.append(_raw_bytes(data))
        return errors, meta, frames

    def drop(self, slot: int) -> None:
        """Forget everything of a client that left."""
        for table in (self.tensors, self.poisoned):
            for key in [k for k in table if k >> HANDLE_BITS == slot]:
                del table[key]
        self.errors.pop(slot, None)

    def memory_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in list(self.tensors.values()) if isinstance(t, torch.Tensor)
        )

    # ---- operations the executor implements ---------------------------------------------

    def _op_upload(self, base, outs, args, kwargs, flags, frames):
        dtype, shape = torch_dtype(kwargs["dtype"]), kwargs["shape"]
        frame = frames[kwargs["frame"]]
        if len(frame) == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)
        tensor = tensor.to(self.device)
        if flags and flags.get("rg"):
            tensor.requires_grad_(True)
        self.tensors[base + outs[0]] = tensor

    def _op_free(self, base, outs, args, kwargs, flags, frames):
        for handle in args:
            self.tensors.pop(base + handle, None)
            self.poisoned.pop(base + handle, None)

    def _op_backward(self, base, outs, args, kwargs, flags, frames):
        loss, gradient = args[0], args[1] if len(args) > 1 else None
        loss.backward(gradient, retain_graph=bool(kwargs.get("retain_graph")))

    def _op_grad(self, base, outs, args, kwargs, flags, frames):
        grad = args[0].grad
        if grad is None:
            raise RuntimeError("the tensor has no gradient (backward did not reach it)")
        self.tensors[base + outs[0]] = grad

    def _op_set_grad_none(self, base, outs, args, kwargs, flags, frames):
        args[0].grad = None

    def _op_set_grad(self, base, outs, args, kwargs, flags, frames):
        args[0].grad = args[1].detach()

    def _op_set_data(self, base, outs, args, kwargs, flags, frames):
        args[0].data = args[1]

    def _op_requires_grad_(self, base, outs, args, kwargs, flags, frames):
        args[0].requires_grad_(bool(args[1]))

    def _op_manual_seed(self, base, outs, args, kwargs, flags, frames):
        torch.manual_seed(int(args[0]) + self.rank)  # worker r draws from seed + r

    def _op_optim_create(self, base, outs, args, kwargs, flags, frames):
        options = {k: v for k, v in kwargs.items() if k != "kind" and v is not None}
        if "betas" in options:
            options["betas"] = tuple(options["betas"])
        kinds = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
        if kwargs.get("kind") not in kinds:
            raise ValueError(f"unknown optimizer {kwargs.get('kind')!r}; valid: {', '.join(kinds)}")
        self.tensors[base + outs[0]] = kinds[kwargs["kind"]](list(args), **options)

    def _op_optim_step(self, base, outs, args, kwargs, flags, frames):
        args[0].step()

    def _op_optim_zero_grad(self, base, outs, args, kwargs, flags, frames):
        args[0].zero_grad(set_to_none=kwargs.get("set_to_none", True))

    def _op_optim_set_lr(self, base, outs, args, kwargs, flags, frames):
        for group in args[0].param_groups:
            group["lr"] = kwargs["lr"]

    # ---- transfers between workers (asked for by the dispatcher only) -----------------

    def _op_send(self, base, outs, args, kwargs, flags, frames):
        tensor = args[0]
        tracks_grad = tensor.requires_grad and torch.is_grad_enabled()
        self._send_tensor(tensor, kwargs["to"], 0, tracks_grad)
        if tracks_grad:
            self.pending[kwargs["t"]] = tensor

    def _op_recv(self, base, outs, args, kwargs, flags, frames):
        tensor, requires_grad = self._recv_tensor(kwargs["src"], 0)
        if requires_grad:
            tensor.requires_grad_(True)
            self.boundary[kwargs["t"]] = tensor
        self.tensors[base + outs[0]] = tensor

    def _op_bw_send(self, base, outs, args, kwargs, flags, frames):
        """Send the gradient of a crossing's copy to each worker it came from (whole, or the
        receiver's part when the crossing's gradient travels split)."""
        leaf = self.boundary.get(kwargs["t"])
        grad = leaf.grad if leaf is not None else None
        tag = _grad_tag(kwargs["t"])
        for receiver, index in kwargs["to"]:
            if grad is None:
                self._send_header_only(receiver, tag, _NO_GRAD)
            elif kwargs["parts"]:
                self._send_tensor(torch.tensor_split(grad, kwargs["parts"], dim=kwargs["axis"])[index], receiver, tag, False)
            else:
                self._send_tensor(grad, receiver, tag, False)
        if leaf is not None:
            leaf.grad = None  # the next backward through this crossing starts from zero
            if not kwargs.get("retain", True):
                del self.boundary[kwargs["t"]]

    def _op_bw_recv(self, base, outs, args, kwargs, flags, frames):
        grad, _ = self._recv_tensor(kwargs["src"], _grad_tag(kwargs["t"]))
        if grad is not None and kwargs.get("gather"):  # the gradient travelled in parts
            grad = all_gather_along(grad, self.groups[tuple(kwargs["gather"])], kwargs["axis"], length=kwargs["length"])
        retain = kwargs.get("retain", True)
        source = self.pending.get(kwargs["t"]) if retain else self.pending.pop(kwargs["t"], None)
        if grad is not None and source is not None:
            torch.autograd.backward(source, grad, retain_graph=retain)

    def _op_release(self, base, outs, args, kwargs, flags, frames):
        for transfer in args:
            self.boundary.pop(transfer, None)
            self.pending.pop(transfer, None)

    def _send_tensor(self, tensor: torch.Tensor, peer: int, tag: int, requires_grad: bool) -> None:
        if tensor.dim() > _HEADER - 4:
            raise ValueError(f"cannot transfer a tensor of {tensor.dim()} dimensions (at most {_HEADER - 4})")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = tensor.dim()
        if tensor.dim():
            header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header[-2] = _DTYPE_CODES.index(tensor.dtype)
        header[-1] = int(requires_grad)
        self._p2p_send(header, peer, tag)
        if tensor.numel():
            # A leaf (a parameter) may change in place, by an optimizer step, while its message
            # is in flight: it travels as a copy. Activations and gradients are not changed.
            payload = tensor.detach().contiguous()
            self._p2p_send(payload.clone() if tensor.is_leaf and payload.data_ptr() == tensor.data_ptr() else payload,
                           peer, tag)

    def _send_header_only(self, peer: int, tag: int, code: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = code
        self._p2p_send(header, peer, tag)

    def _recv_tensor(self, peer: int, tag: int):
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        waiting = time.perf_counter()
        self._p2p_recv(header, peer, tag)
        self.wait_s += time.perf_counter() - waiting
        values = header.tolist()
        if values[0] == _NO_GRAD:
            return None, False
        if values[0] == _POISONED:
            raise RuntimeError(f"the tensor sent by worker {peer} had failed there")
        shape = values[1 : 1 + values[0]]
        tensor = torch.empty(shape, dtype=_DTYPE_CODES[values[-2]], device=self.device)
        if tensor.numel():
            self._p2p_recv(tensor, peer, tag)
        return tensor, bool(values[-1])

    def _p2p_send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Posted, not waited for (as paratrain's pipeline does): the stream goes on while the
        message travels."""
        if peer == self.rank:  # to itself: the receive comes later in this same stream
            self.mailbox[tag].append(tensor.clone())
            return
        self.in_flight.append(self.group.isend(tensor, peer, tag))
        if len(self.in_flight) > MAX_SENDS_IN_FLIGHT:
            self.in_flight.popleft().wait()

    def wait_sends(self) -> None:
        while self.in_flight:
            self.in_flight.popleft().wait()

    def _p2p_recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        if peer == self.rank:
            tensor.copy_(self.mailbox[tag].popleft())
        else:
            self.group.recv(tensor, peer, tag)


def _grad_tag(transfer: int) -> int:
    return 1 + transfer % ((1 << 20) - 2)  # p2p tags live in [0, 2**20); 0 is forward data


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{DTYPE_NAMES.get(value.dtype, value.dtype)}{list(value.shape)}"
    return type(value).__name__


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return memoryview(tensor.numpy()).cast("B")
