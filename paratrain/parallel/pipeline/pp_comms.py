"""Pipeline communication: activations forward to the next chunk, gradients back to the previous.

Every message is tagged with (direction, receiving chunk, microbatch), so a receive matches its
send whatever order the two ranks' schedules post them in. Sends are asynchronous: a rank
posts its activation and carries on with its next action; the handles are waited for at the
end of the step. An activation is preceded by a small header (dtype and shape), since the
receiver cannot know, for instance, whether autocast made it bfloat16. A gradient needs none:
it has the shape and dtype of the activation its receiver sent.

A receive can be posted ahead (`expect_activation`, `expect_gradient`) while the rank still
computes: gloo sends a message only once its receiver has asked for it, so a receive posted
only when the data is needed costs a hand-off between threads on both ranks on top of the
transfer, which shows up as bubble. Once the first step has taught both ends every message's
shape, the runtime posts all of a step's receives before its first action: a receive posted
mid-step waits, now and then, for milliseconds on gloo's I/O thread (which holds the
connection while it reads a message and is itself waiting for a core on a busy host).
"""

from __future__ import annotations

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_HEADER = 10  # dtype, ndim, up to 8 dims
FORWARD, BACKWARD = 0, 1


def message_tag(direction: int, chunk: int, microbatch: int, num_chunks: int, microbatches: int) -> int:
    return (direction * num_chunks + chunk) * microbatches + microbatch


class PipelineLink:
    """This rank's pipeline p2p, over the pipeline-axis Group."""

    def __init__(self, pp_group, num_chunks: int, microbatches: int, verbose: bool = False):
        self.group, self.num_chunks, self.microbatches = pp_group, num_chunks, microbatches
        self.verbose = verbose
        self._sends: list = []
        self._sent_headers: dict[int, tuple] = {}  # chunk -> (dtype, shape) already announced
        self._known_headers: dict[int, tuple] = {}  # chunk -> (dtype, shape) announced to us
        self._posted: dict[int, tuple] = {}  # tag -> (buffer, handle) of a receive posted ahead

    def _tag(self, direction, chunk, microbatch) -> int:
        return message_tag(direction, chunk, microbatch, self.num_chunks, self.microbatches)

    def _log(self, text: str) -> None:
        print(f"[pp rank {self.group.rank}] {text}", flush=True)

    def send_activation(self, tensor: torch.Tensor, peer: int, chunk: int, microbatch: int) -> None:
        """Send the input of `chunk` (the output of chunk-1) for `microbatch` to `peer`."""
        tag = self._tag(FORWARD, chunk, microbatch)
        signature = (tensor.dtype, tuple(tensor.shape))
        announced = self._sent_headers.get(chunk)
        if announced is None:
            header = torch.full((_HEADER,), -1, dtype=torch.int64)
            header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
            header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
            self._sends.append(self.group.isend(header, peer, tag))
            self._sent_headers[chunk] = signature
        elif announced != signature:
            raise ValueError(f"activation into chunk {chunk} changed from {announced} to {signature}; "
                             "a pipeline run needs one microbatch shape")
        if self.verbose:  # not even the message is made otherwise: this runs cold, right after compute
            self._log(f"send_forward chunk {chunk} mb {microbatch} -> rank {peer} {tuple(tensor.shape)}")
        self._sends.append(self.group.isend(tensor, peer, tag))  # isend makes it contiguous

    def expect_activation(self, peer: int, chunk: int, microbatch: int, device) -> None:
        """Post the receive of `recv_activation(peer, chunk, microbatch)` now, if its shape is
        known (after the chunk's first activation, which brings the header)."""
        tag = self._tag(FORWARD, chunk, microbatch)
        if chunk in self._known_headers and tag not in self._posted:
            dtype, shape = self._known_headers[chunk]
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self._posted[tag] = (buffer, self.group.irecv(buffer, peer, tag))

    def expect_gradient(self, like: torch.Tensor | None, peer: int, chunk: int, microbatch: int, device=None) -> None:
        """Post the receive of `recv_gradient(like, peer, chunk, microbatch)` now. Without `like`
        (the forward has not run yet), only if an activation of this chunk was sent before: the
        gradient has its dtype and shape."""
        tag = self._tag(BACKWARD, chunk + 1, microbatch)
        if tag in self._posted:
            return
        if like is not None:
            buffer = torch.empty_like(like)
        elif chunk + 1 in self._sent_headers:
            dtype, shape = self._sent_headers[chunk + 1]
            buffer = torch.empty(shape, dtype=dtype, device=device)
        else:
            return
        self._posted[tag] = (buffer, self.group.irecv(buffer, peer, tag))

    def _posted_receive(self, tag: int) -> torch.Tensor | None:
        if tag not in self._posted:
            return None
        buffer, handle = self._posted.pop(tag)
        handle.wait()
        return buffer

    def recv_activation(self, peer: int, chunk: int, microbatch: int, device) -> torch.Tensor:
        tag = self._tag(FORWARD, chunk, microbatch)
        posted = self._posted_receive(tag)
        if posted is not None:
            if self.verbose:
                self._log(f"recv_forward chunk {chunk} mb {microbatch} <- rank {peer} {tuple(posted.shape)} (posted ahead)")
            return posted
        if chunk not in self._known_headers:
            header = torch.empty(_HEADER, dtype=torch.int64)
            self.group.recv(header, peer, tag)
            ndim = int(header[1])
            self._known_headers[chunk] = (_DTYPES[int(header[0])], header[2 : 2 + ndim].tolist())
        dtype, shape = self._known_headers[chunk]
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if self.verbose:
            self._log(f"recv_forward chunk {chunk} mb {microbatch} <- rank {peer} {tuple(buffer.shape)}")
        return self.group.recv(buffer, peer, tag)

    def send_gradient(self, tensor: torch.Tensor, peer: int, chunk: int, microbatch: int) -> None:
        """Send the gradient of `chunk`'s input back to `peer`, who owns chunk-1."""
        if self.verbose:
            self._log(f"send_backward chunk {chunk} mb {microbatch} -> rank {peer}")
        self._sends.append(self.group.isend(tensor, peer, self._tag(BACKWARD, chunk, microbatch)))

    def recv_gradient(self, like: torch.Tensor, peer: int, chunk: int, microbatch: int) -> torch.Tensor:
        """The gradient of the output of `chunk`, sent back by the owner of chunk+1."""
        if self.verbose:
            self._log(f"recv_backward chunk {chunk} mb {microbatch} <- rank {peer}")
        tag = self._tag(BACKWARD, chunk + 1, microbatch)
        posted = self._posted_receive(tag)
        return posted if posted is not None else self.group.recv(torch.empty_like(like), peer, tag)

    def wait_sends(self) -> None:
        for handle in self._sends:
            handle.wait()
        self._sends.clear()
        if self._posted:  # every receive posted ahead is one the schedule makes
            raise RuntimeError(f"pipeline: {len(self._posted)} receive(s) posted ahead were never taken")
