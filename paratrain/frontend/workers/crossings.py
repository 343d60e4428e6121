"""Tensors crossing between workers (see dispatcher/moves.py for the routing side).

A tensor moves with paratrain's own point-to-point (`Group.isend/recv`): a fixed-size header
(dimensions, dtype, whether it requires grad) and then its bytes. A crossing of a tensor that
requires grad is differentiable: the receiver's copy becomes a leaf, and in backward the
receiver sends that leaf's gradient back, under a tag made from the crossing's number, and the
sender continues backward from the tensor it sent.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import torch

from paratrain.frontend.ops import TORCH_DTYPES
from paratrain.parallel.tensor.tp_comms import all_gather_along

_HEADER = 16  # int64 slots: ndim (or a negative code), dims..., dtype, requires_grad
_NO_GRAD, _POISONED = -1, -2
_DTYPE_CODES = list(TORCH_DTYPES.values())
MAX_SENDS_IN_FLIGHT = 64


class Links:
    """This worker's ends of its crossings, and the messages in flight."""

    def __init__(self, group, device: torch.device, rank: int):
        self.group, self.device, self.rank = group, device, rank
        self.copies: dict[int, torch.Tensor] = {}  # crossing -> the leaf received here
        self.sources: dict[int, torch.Tensor] = {}  # crossing -> the tensor sent from here
        self.mailbox: dict[int, deque] = defaultdict(deque)  # tag -> what this worker sent itself
        self.in_flight: deque = deque()  # sends posted and not yet waited for
        self.wait_s = 0.0  # time spent waiting for another worker's tensor

    def send_tensor(self, tensor: torch.Tensor, peer: int, tag: int, requires_grad: bool) -> None:
        if tensor.dim() > _HEADER - 4:
            raise ValueError(f"cannot move a tensor of {tensor.dim()} dimensions (at most {_HEADER - 4})")
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = tensor.dim()
        if tensor.dim():
            header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        header[-2] = _DTYPE_CODES.index(tensor.dtype)
        header[-1] = int(requires_grad)
        self._send(header, peer, tag)
        if tensor.numel():
            # A leaf (a parameter) may change in place, by an optimizer step, while its message
            # is in flight: it travels as a copy. Activations and gradients are not changed.
            payload = tensor.detach().contiguous()
            self._send(payload.clone() if tensor.is_leaf and payload.data_ptr() == tensor.data_ptr() else payload,
                       peer, tag)

    def send_poisoned(self, peer: int, tag: int = 0) -> None:
        """Tell a receiver the tensor it waits for failed here."""
        self._send_code(peer, tag, _POISONED)

    def send_no_grad(self, peer: int, tag: int) -> None:
        self._send_code(peer, tag, _NO_GRAD)

    def _send_code(self, peer: int, tag: int, code: int) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[0] = code
        self._send(header, peer, tag)

    def recv_tensor(self, peer: int, tag: int):
        """(tensor or None for "no gradient", whether it requires grad)."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        waiting = time.perf_counter()
        self._recv(header, peer, tag)
        self.wait_s += time.perf_counter() - waiting
        values = header.tolist()
        if values[0] == _NO_GRAD:
            return None, False
        if values[0] == _POISONED:
            raise RuntimeError(f"the tensor sent by worker {peer} had failed there")
        shape = values[1 : 1 + values[0]]
        tensor = torch.empty(shape, dtype=_DTYPE_CODES[values[-2]], device=self.device)
        if tensor.numel():
            self._recv(tensor, peer, tag)
        return tensor, bool(values[-1])

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
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

    def _recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        if peer == self.rank:
            tensor.copy_(self.mailbox[tag].popleft())
        else:
            self.group.recv(tensor, peer, tag)


def grad_tag(crossing: int) -> int:
    return 1 + crossing % ((1 << 20) - 2)  # p2p tags live in [0, 2**20); 0 is forward data


def send(executor, step) -> None:
    tensor, kwargs = step.args[0], step.instruction.kwargs
    tracks_grad = tensor.requires_grad and torch.is_grad_enabled()
    executor.links.send_tensor(tensor, kwargs["to"], 0, tracks_grad)
    if tracks_grad:
        executor.links.sources[kwargs["crossing"]] = tensor


def recv(executor, step) -> None:
    kwargs = step.instruction.kwargs
    tensor, requires_grad = executor.links.recv_tensor(kwargs["src"], 0)
    if requires_grad:
        tensor.requires_grad_(True)
        executor.links.copies[kwargs["crossing"]] = tensor
    executor.store(step, tensor)


def bw_send(executor, step) -> None:
    """Send the gradient of a crossing's copy to each worker it came from (whole, or the
    receiver's part when the crossing's gradient travels split)."""
    links, kwargs = executor.links, step.instruction.kwargs
    leaf = links.copies.get(kwargs["crossing"])
    grad = leaf.grad if leaf is not None else None
    tag = grad_tag(kwargs["crossing"])
    for receiver, index in kwargs["to"]:
        if grad is None:
            links.send_no_grad(receiver, tag)
        elif kwargs["parts"]:
            links.send_tensor(torch.tensor_split(grad, kwargs["parts"], dim=kwargs["axis"])[index], receiver, tag, False)
        else:
            links.send_tensor(grad, receiver, tag, False)
    if leaf is not None:
        leaf.grad = None  # the next backward through this crossing starts from zero
        if not kwargs.get("retain", True):
            del links.copies[kwargs["crossing"]]


def bw_recv(executor, step) -> None:
    links, kwargs = executor.links, step.instruction.kwargs
    grad, _ = links.recv_tensor(kwargs["src"], grad_tag(kwargs["crossing"]))
    if grad is not None and kwargs.get("gather"):  # the gradient travelled in parts
        group = executor.groups[tuple(kwargs["gather"])]
        grad = all_gather_along(grad, group, kwargs["axis"], length=kwargs["length"])
    retain = kwargs.get("retain", True)
    source = links.sources.get(kwargs["crossing"]) if retain else links.sources.pop(kwargs["crossing"], None)
    if grad is not None and source is not None:
        torch.autograd.backward(source, grad, retain_graph=retain)


def twin_copy(executor, step) -> None:
    """A result of a region whose backward runs on other workers (dispatcher/twins.py), on the
    workers that ran its forward: cut loose from this worker's graph as a leaf, whose gradient
    backward sends to the twin's workers."""
    tensor = step.args[0]
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        leaf = tensor.detach().requires_grad_(True)
        executor.tensors[step.base + step.instruction.args[0]] = leaf
        executor.links.copies[step.instruction.kwargs["crossing"]] = leaf


def twin_source(executor, step) -> None:
    """The same result computed again, with its graph, on the backward signal's workers."""
    tensor = step.args[0]
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        executor.links.sources[step.instruction.kwargs["crossing"]] = tensor


def twin_bw_send(executor, step) -> None:
    """Send this worker's part of a twin copy's gradient (all of it, if the copy is whole) to
    each worker of the twin that takes it from here."""
    links, kwargs = executor.links, step.instruction.kwargs
    leaf = links.copies.get(kwargs["crossing"])
    grad = leaf.grad if leaf is not None else None
    tag = grad_tag(kwargs["crossing"])
    for receiver in kwargs["to"]:
        if grad is None:
            links.send_no_grad(receiver, tag)
        else:
            links.send_tensor(grad, receiver, tag, False)
    if leaf is not None:
        leaf.grad = None  # the next backward through this twin starts from zero


def twin_bw_recv(executor, step) -> None:
    """Assemble a twin's gradient from the copies' parts (`axis`: the copies' split, None when
    each is whole and one message suffices), keep this worker's part of the twin's own split
    (`part`: [index, count, axis]), and continue backward from the twin."""
    links, kwargs = executor.links, step.instruction.kwargs
    tag = grad_tag(kwargs["crossing"])
    parts = [links.recv_tensor(sender, tag)[0] for sender in kwargs["src"]]
    source = links.sources.get(kwargs["crossing"])
    if source is None or any(part is None for part in parts):
        return
    grad = parts[0] if kwargs["axis"] is None else torch.cat(parts, dim=kwargs["axis"])
    if kwargs["part"] is not None:
        index, count, axis = kwargs["part"]
        grad = torch.tensor_split(grad, count, dim=axis)[index]
    torch.autograd.backward(source, grad, retain_graph=kwargs["retain"])


def release(executor, step) -> None:
    for crossing in step.args:
        executor.links.copies.pop(crossing, None)
        executor.links.sources.pop(crossing, None)


HANDLERS = {"send": send, "recv": recv, "bw_send": bw_send, "bw_recv": bw_recv, "release": release,
            "twin_copy": twin_copy, "twin_source": twin_source, "twin_bw_send": twin_bw_send,
            "twin_bw_recv": twin_bw_recv}
