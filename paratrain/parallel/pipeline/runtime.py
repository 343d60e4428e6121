"""One runtime for every schedule: it walks this rank's action list and does what each says.

    F(m, c): take microbatch m's input of chunk c (the data, or an activation received from the
             owner of chunk c-1), run the chunk, send the output on (or, on the last chunk,
             compute the loss).
    B(m, c): take the gradient of chunk c's output (from the owner of chunk c+1, or the loss),
             backpropagate, send the input's gradient back. When the schedule splits the
             backward, B computes only the input's gradient, so the previous stage can go on.
    W(m, c): the weight-gradient half: backpropagate into chunk c's parameters.

When the backward is split, B asks autograd only for the input's gradient, the cheap
parameters' gradients and each linear layer's output gradient, and W does the linear layers'
weight-gradient products from what B kept (weight_grad.py): B + W cost one backward. Where
that split does not apply (activation checkpointing, sequence parallelism), W re-traverses the
chunk's graph with `inputs=parameters` instead, which costs more.

Each action's compute time is recorded, so the step's measured bubble (time not computing)
can be set beside the schedule's theoretical one.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from paratrain.parallel.pipeline.pp_comms import PipelineLink
from paratrain.parallel.pipeline.weight_grad import SplitBackward, supports


@dataclass
class Stashed:
    """What one (microbatch, chunk) holds from its F until its last backward pass."""

    input: torch.Tensor | None  # the chunk's input; B sends back its .grad (at a V's turn, B of c-1 takes it)
    output: torch.Tensor | None  # the chunk's output, or the loss on the last chunk
    output_grad: torch.Tensor | None = None  # set by B: what W backpropagates when autograd re-traverses
    # F: each linear layer's (module, X, Y) as recorded; after a split B: the (module, X, dY) W needs
    linear: list | None = field(default_factory=list)


@dataclass
class _Step:
    """One run's microbatches and what it accumulates while walking the actions."""

    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    stash: dict[tuple[int, int], Stashed] = field(default_factory=dict)
    loss_sum: float = 0.0
    peak: int = 0  # most (microbatch, chunk) entries stashed at once
    op_s: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0, "W": 0.0})  # compute per kind


class PipelineRuntime:
    def __init__(self, schedule, rank: int, chunks: dict[int, torch.nn.Module], pp_group, loss_fn,
                 data_parallel=None, checkpoint_activations: bool = False, autocast=nullcontext,
                 device=None, verbose: bool = False):
        """`autocast()`: the precision's context for forward and loss (paratrain.parallel.precision)."""
        self.schedule, self.rank, self.chunks = schedule, rank, chunks
        self.loss_fn, self.dp, self.autocast = loss_fn, data_parallel, autocast
        self.checkpoint_activations = checkpoint_activations
        self.device = device or torch.device("cpu")
        self.last_chunk = schedule.num_chunks - 1
        self.link = PipelineLink(pp_group, schedule.num_chunks, schedule.microbatches, verbose)
        self.actions = schedule.ranks[rank]
        self.splitters = None
        if schedule.split_backward and not checkpoint_activations and all(supports(c) for c in chunks.values()):
            self.splitters = {c: SplitBackward(chunk) for c, chunk in chunks.items()}
        # What each kind of action does: the schedules' F, B and W.
        self.handlers = {"F": self._forward, "B": self._backward_input, "W": self._backward_weight}
        # The last pass that produces each chunk's weight gradients: data parallelism may
        # reduce them only then (earlier passes accumulate without communicating).
        self._final_grad_action = {a.stage: a for a in self.actions if a.op == schedule.last_backward_op}
        # For each action, the index of the next one that receives from another rank: its
        # receive is posted while this one computes (see PipelineLink.expect_activation).
        self._next_receive: list[int | None] = []
        following = None
        for index in reversed(range(len(self.actions))):
            self._next_receive.append(following)
            if self._receives_remotely(self.actions[index]):
                following = index
        self._next_receive.reverse()

    def _remote(self, chunk: int) -> bool:
        """Whether `chunk` is held by another rank (its messages travel)."""
        return self.schedule.owner(chunk) != self.rank

    def _receives_remotely(self, action) -> bool:
        c = action.stage
        if action.op == "F":
            return c > 0 and self._remote(c - 1)
        return action.op == "B" and c != self.last_chunk and self._remote(c + 1)

    def _post_step_receives(self) -> None:
        """Post every receive of the step whose message shape is known (all of them, after the
        first step), before the first action: see pp_comms. Costs one buffer of a chunk's
        input per microbatch and direction held from the step's start, little beside the
        activations a chunk stashes for its backward."""
        for action in self.actions:
            if self._receives_remotely(action):
                self._expect(action)

    def _post_next_receive(self, index: int, stash: dict[tuple[int, int], Stashed]) -> None:
        """Post the receive the next receiving action will need, where it can be posted now."""
        following = self._next_receive[index]
        if following is not None:
            action = self.actions[following]
            entry = stash.get((action.microbatch, action.stage))
            self._expect(action, entry.output if entry is not None else None)

    def _expect(self, action, output: torch.Tensor | None = None) -> None:
        """Post the receive `action` will take: an F's activation, or a B's gradient, shaped
        like the forward's `output` or, before that has run, like the activation sent."""
        m, c = action.microbatch, action.stage
        if action.op == "F":
            self.link.expect_activation(self.schedule.owner(c - 1), c, m, self.device)
        else:
            self.link.expect_gradient(output, self.schedule.owner(c + 1), c, m, self.device)

    def run(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None) -> dict:
        """One optimizer step's worth of microbatches. `inputs` matter only to the owner of
        chunk 0, `targets` to the owner of the last chunk. Returns the summed (already divided
        by the number of microbatches) loss on the last chunk's owner, and timings."""
        step = _Step(inputs, targets)
        started = time.perf_counter()
        self._post_step_receives()
        for index, action in enumerate(self.actions):
            self.handlers[action.op](index, action, step)
        self.link.wait_sends()
        total = time.perf_counter() - started
        # peak_stashed: most (microbatch, chunk) entries held at once; left_stashed: at the end (0)
        return {"loss_sum": step.loss_sum, "busy_s": sum(step.op_s.values()), "op_s": step.op_s,
                "total_s": total, "peak_stashed": step.peak, "left_stashed": len(step.stash)}

    def _forward(self, index: int, action, step: _Step) -> None:
        """F(m, c): run chunk c on its input, send the output on, or compute the loss."""
        m, c = action.microbatch, action.stage
        x = self._forward_input(m, c, step)
        self._post_next_receive(index, step.stash)
        begin = time.perf_counter()
        # The loss too runs under autocast, as in the reference: autocast computes
        # cross-entropy in fp32 (outside it, bf16 logits give a bf16 loss).
        with self.autocast():
            with self.splitters[c].recording() if self.splitters else nullcontext([]) as records:
                out = self.chunks[c](x)  # layers are checkpointed in place (train/recompute.py)
            if c == self.last_chunk:
                out = self.loss_fn(out, step.targets[m]) / self.schedule.microbatches
        if c == self.last_chunk:
            step.loss_sum += out.item()
        step.op_s["F"] += time.perf_counter() - begin
        if c != self.last_chunk and self._remote(c + 1):
            # First thing: the next stage may be waiting (detached: on threads a receive
            # copies the tensor, and autograd must not follow it across ranks).
            self.link.send_activation(out.detach(), self.schedule.owner(c + 1), c + 1, m)
        step.stash[(m, c)] = Stashed(x, out, linear=records)
        step.peak = max(step.peak, len(step.stash))
        self._post_next_receive(index, step.stash)  # a B of this very (m, c) can post only now

    def _forward_input(self, m: int, c: int, step: _Step) -> torch.Tensor:
        if c == 0:
            return step.inputs[m]
        if not self._remote(c - 1):
            return step.stash[(m, c - 1)].output.detach().requires_grad_()  # a V turns on this rank
        x = self.link.recv_activation(self.schedule.owner(c - 1), c, m, self.device)
        return x.requires_grad_()

    def _backward_input(self, index: int, action, step: _Step) -> None:
        """B(m, c): backpropagate the output's gradient to the input's and send that back; the
        whole backward, unless the schedule splits it (then W does the weights)."""
        m, c = action.microbatch, action.stage
        entry = step.stash[(m, c)]
        x, out = entry.input, entry.output
        entry.output_grad = grad = self._output_grad(m, c, out, step.stash)
        self._post_next_receive(index, step.stash)
        begin = time.perf_counter()
        with self._sync_if_final(action):
            if self.splitters:
                entry.linear = self.splitters[c].backward_input(out, grad, x if c > 0 else None, entry.linear)
            elif self.schedule.split_backward:
                if c > 0:
                    torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
            else:
                torch.autograd.backward(out, grad)
        step.op_s["B"] += time.perf_counter() - begin
        if c > 0 and self._remote(c - 1):
            self.link.send_gradient(x.grad, self.schedule.owner(c - 1), c, m)
        if not self.schedule.split_backward:
            self._release(step.stash, m, c)

    def _backward_weight(self, index: int, action, step: _Step) -> None:
        """W(m, c): the weight-gradient half of a split backward."""
        m, c = action.microbatch, action.stage
        entry = step.stash[(m, c)]
        self._post_next_receive(index, step.stash)
        begin = time.perf_counter()
        with self._sync_if_final(action):
            if self.splitters:
                self.splitters[c].backward_weight(entry.linear, self.dp.grad_ready if self.dp else None)
            else:
                params = [p for p in self.chunks[c].parameters() if p.requires_grad]
                torch.autograd.backward(entry.output, entry.output_grad, inputs=params)
        step.op_s["W"] += time.perf_counter() - begin
        self._release(step.stash, m, c)

    def _output_grad(self, m: int, c: int, out: torch.Tensor, stash) -> torch.Tensor | None:
        if c == self.last_chunk:
            return None  # out is the loss
        if not self._remote(c + 1):  # the V's turn: the next chunk is ours
            turn = stash[(m, c + 1)]
            grad, turn.input = turn.input.grad, None  # its input's gradient was all it was kept for
            if turn.output is None:  # and chunk c+1 is done with it: drop it now
                del stash[(m, c + 1)]
            return grad
        return self.link.recv_gradient(out, self.schedule.owner(c + 1), c, m)

    def _release(self, stash, m: int, c: int) -> None:
        """Drop what microbatch m held on chunk c, except, at a V's turn (chunk c-1 is ours
        too), the input whose gradient B(m, c-1) has yet to take; that B drops it."""
        entry = stash[(m, c)]
        entry.output = entry.output_grad = entry.linear = None
        if c == 0 or self._remote(c - 1) or entry.input is None:
            del stash[(m, c)]

    def _sync_if_final(self, action):
        """Let data parallelism reduce a chunk's gradients only during its last gradient pass."""
        if self.dp is None or self._final_grad_action.get(action.stage) == action:
            return nullcontext()
        return self.dp.no_sync()
