"""Activation memory, counted from what autograd keeps: the tensors every operation saves for its
backward, from the moment forward saves them until backward frees them.

A saved-tensors hook sees each tensor as it is saved; what it hands autograd is a small holder,
and when autograd lets the holder go (its node has run backward, or the graph is dropped) a
finalizer takes the tensor's bytes off the count. Each storage is counted once however many
nodes save it (a tensor saved by two operations, or a view of one), and the model's parameters
are not activations (a matmul saves its weight too). The peak of the live count over a step is
`activations_bytes`: under a pipeline, the microbatches in flight at once; under context
parallelism, 1/cp of the sequence's.
"""

from __future__ import annotations

import weakref

import torch


def _storage(tensor: torch.Tensor) -> tuple[int | None, int]:
    """(pointer, bytes) of the storage under `tensor`; (None, 0) where it has none to read: a
    DTensor (PyTorch's FSDP2) or a parameter whose storage is freed between uses."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None, 0


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedActivations:
    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.live = self.peak = 0
        self._holders: dict[int, int] = {}  # storage pointer -> holders saving it

    def __enter__(self):
        self._parameters = {_storage(p)[0] for p in self.module.parameters()}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor):
        pointer, nbytes = _storage(tensor)
        if pointer in self._parameters or not nbytes:
            return tensor
        if self._holders.get(pointer, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._holders[pointer] = self._holders.get(pointer, 0) + 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, pointer, nbytes)
        return holder

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, pointer: int, nbytes: int) -> None:
        self._holders[pointer] -= 1
        if self._holders[pointer] == 0:
            del self._holders[pointer]
            self.live -= nbytes
