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

import torch

from paratrain.parallel.pipeline.pp_comms import PipelineLink
from paratrain.parallel.pipeline.weight_grad import SplitBackward, supports


class PipelineRuntime:
    def __init__(self, schedule, rank: int, chunks: dict[int, torch.nn.Module], pp_group, loss_fn,
                 data_parallel=None, checkpoint_activations: bool = False, autocast_dtype=None,
                 device=None, verbose: bool = False):
        self.schedule, self.rank, self.chunks = schedule, rank, chunks
        self.loss_fn, self.dp = loss_fn, data_parallel
        self.checkpoint_activations, self.autocast_dtype = checkpoint_activations, autocast_dtype
        self.device = device or torch.device("cpu")
        self.last_chunk = schedule.num_chunks - 1
        self.link = PipelineLink(pp_group, schedule.num_chunks, schedule.microbatches, verbose)
        self.actions = schedule.ranks[rank]
        self.splitters = None
        if schedule.split_backward and not checkpoint_activations and all(supports(c) for c in chunks.values()):
            self.splitters = {c: SplitBackward(chunk) for c, chunk in chunks.items()}
        grad_op = "W" if schedule.split_backward else "B"
        # The last pass that produces each chunk's weight gradients: data parallelism may
        # reduce them only then (earlier passes accumulate without communicating).
        self._final_grad_action = {a.stage: a for a in self.actions if a.op == grad_op}
        # For each action, the index of the next one that receives from another rank: its
        # receive is posted while this one computes (see PipelineLink.expect_activation).
        self._next_receive: list[int | None] = []
        following = None
        for index in reversed(range(len(self.actions))):
            self._next_receive.append(following)
            if self._receives_remotely(self.actions[index]):
                following = index
        self._next_receive.reverse()

    def _receives_remotely(self, action) -> bool:
        c, owner = action.stage, self.schedule.owner
        if action.op == "F":
            return c > 0 and owner(c - 1) != self.rank
        return action.op == "B" and c != self.last_chunk and owner(c + 1) != self.rank

    def _post_step_receives(self) -> None:
        """Post every receive of the step whose message shape is known (all of them, after the
        first step), before the first action: see pp_comms. Costs one buffer of a chunk's
        input per microbatch and direction held from the step's start, little beside the
        activations a chunk stashes for its backward."""
        for action in self.actions:
            if self._receives_remotely(action):
                self._expect(action)

    def _post_next_receive(self, index: int, stash) -> None:
        """Post the receive the next receiving action will need, where it can be posted now."""
        following = self._next_receive[index]
        if following is not None:
            action = self.actions[following]
            entry = stash.get((action.microbatch, action.stage))
            self._expect(action, entry[1] if entry is not None else None)

    def _expect(self, action, output: torch.Tensor | None = None) -> None:
        """Post the receive `action` will take: an F's activation, or a B's gradient, shaped
        like the forward's `output` or, before that has run, like the activation sent."""
        m, c = action.microbatch, action.stage
        if action.op == "F":
            self.link.expect_activation(self.schedule.owner(c - 1), c, m, self.device)
        else:
            self.link.expect_gradient(output, self.schedule.owner(c + 1), c, m, self.device)

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def run(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None) -> dict:
        """One optimizer step's worth of microbatches. `inputs` matter only to the owner of
        chunk 0, `targets` to the owner of the last chunk. Returns the summed (already divided
        by the number of microbatches) loss on the last chunk's owner, and timings."""
        microbatches = self.schedule.microbatches
        # (microbatch, chunk) -> [input, output, output grad, linear records then what W needs]
        stash: dict[tuple[int, int], list] = {}
        loss_sum, peak = 0.0, 0
        op_s = {"F": 0.0, "B": 0.0, "W": 0.0}  # compute time per kind of action
        started = time.perf_counter()
        self._post_step_receives()
        for index, action in enumerate(self.actions):
            m, c = action.microbatch, action.stage
            if action.op == "F":
                if c == 0:
                    x = inputs[m]
                elif self.schedule.owner(c - 1) == self.rank:
                    x = stash[(m, c - 1)][1].detach().requires_grad_()  # a V turns on this rank
                else:
                    x = self.link.recv_activation(self.schedule.owner(c - 1), c, m, self.device)
                    x.requires_grad_()
                self._post_next_receive(index, stash)
                begin = time.perf_counter()
                # The loss too runs under autocast, as in the reference: autocast computes
                # cross-entropy in fp32 (outside it, bf16 logits give a bf16 loss).
                with self._autocast():
                    with self.splitters[c].recording() if self.splitters else nullcontext([]) as records:
                        out = self.chunks[c](x)  # layers are checkpointed in place (train/recompute.py)
                    if c == self.last_chunk:
                        out = self.loss_fn(out, targets[m]) / microbatches
                if c == self.last_chunk:
                    loss_sum += out.item()
                op_s["F"] += time.perf_counter() - begin
                if c != self.last_chunk and self.schedule.owner(c + 1) != self.rank:
                    # First thing: the next stage may be waiting (detached: on threads a
                    # receive copies the tensor, and autograd must not follow it across ranks).
                    self.link.send_activation(out.detach(), self.schedule.owner(c + 1), c + 1, m)
                stash[(m, c)] = [x, out, None, records]
                peak = max(peak, len(stash))
                self._post_next_receive(index, stash)  # a B of this very (m, c) can post only now
            elif action.op == "B":
                x, out, _, records = stash[(m, c)]
                grad = self._output_grad(m, c, out, stash)
                stash[(m, c)][2] = grad
                self._post_next_receive(index, stash)
                begin = time.perf_counter()
                with self._sync_if_final(action):
                    if self.splitters:
                        stash[(m, c)][3] = self.splitters[c].backward_input(out, grad, x if c > 0 else None, records)
                    elif self.schedule.split_backward:
                        if c > 0:
                            torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
                    else:
                        torch.autograd.backward(out, grad)
                op_s["B"] += time.perf_counter() - begin
                if c > 0 and self.schedule.owner(c - 1) != self.rank:
                    self.link.send_gradient(x.grad, self.schedule.owner(c - 1), c, m)
                if not self.schedule.split_backward:
                    self._release(stash, m, c)
            else:  # "W"
                x, out, grad, kept = stash[(m, c)]
                self._post_next_receive(index, stash)
                begin = time.perf_counter()
                with self._sync_if_final(action):
                    if self.splitters:
                        self.splitters[c].backward_weight(kept, self.dp.grad_ready if self.dp else None)
                    else:
                        params = [p for p in self.chunks[c].parameters() if p.requires_grad]
                        torch.autograd.backward(out, grad, inputs=params)
                op_s["W"] += time.perf_counter() - begin
                self._release(stash, m, c)
        self.link.wait_sends()
        total = time.perf_counter() - started
        # peak_stashed: most (microbatch, chunk) entries held at once; left_stashed: at the end (0)
        return {"loss_sum": loss_sum, "busy_s": sum(op_s.values()), "op_s": op_s, "total_s": total,
                "peak_stashed": peak, "left_stashed": len(stash)}

    def _output_grad(self, m: int, c: int, out: torch.Tensor, stash) -> torch.Tensor | None:
        if c == self.last_chunk:
            return None  # out is the loss
        if self.schedule.owner(c + 1) == self.rank:  # the V's turn: the next chunk is ours
            turn = stash[(m, c + 1)]
            grad, turn[0] = turn[0].grad, None  # its input's gradient was all it was kept for
            if turn[1] is None:  # and chunk c+1 is done with it: drop it now
                del stash[(m, c + 1)]
            return grad
        return self.link.recv_gradient(out, self.schedule.owner(c + 1), c, m)

    def _release(self, stash, m: int, c: int) -> None:
        """Drop what microbatch m held on chunk c, except, at a V's turn (chunk c-1 is ours
        too), the input whose gradient B(m, c-1) has yet to take; that B drops it."""
        entry = stash[(m, c)]
        entry[1] = entry[2] = entry[3] = None
        if c == 0 or self.schedule.owner(c - 1) != self.rank or entry[0] is None:
            del stash[(m, c)]

    def _sync_if_final(self, action):
        """Let data parallelism reduce a chunk's gradients only during its last gradient pass."""
        if self.dp is None or self._final_grad_action.get(action.stage) == action:
            return nullcontext()
        return self.dp.no_sync()
