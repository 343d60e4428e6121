"""Pipeline parallelism driven from the client, with paratrain's own schedules.

A schedule (`parallel/pipeline/schedules.py`) is a list of F and B actions per stage. The
client issues every action of one step in the order the schedule's simulation starts them
(`issue_order`); since each worker runs its own stream in order, each stage then runs exactly
its schedule's list, and the stages overlap because nothing waits for the client.

Between stages, `gt.signal.tensor(x, next_stage_signal)` moves x to the next stage's
workers. B of the last chunk is the loss's backward on its own workers (`backward_local`); B of
chunk c < last sends the gradient of chunk c+1's input back to chunk c and continues backward
there (`backward_into`). Zero-bubble schedules split B into B and W, which whole backward passes
cannot do: they are refused.
"""

from __future__ import annotations

from paratrain.frontend.client.signal import tensor as move_to_signal
from paratrain.frontend.client.autograd import run_backward
from paratrain.parallel.pipeline.schedules import Schedule
from paratrain.parallel.pipeline.simulate import simulate


def issue_order(schedule: Schedule) -> list:
    """Every rank's actions merged by their simulated start: each rank's own order is kept."""
    if schedule.split_backward:
        raise ValueError(f"{schedule.name} splits backward into B and W; the frontend runs whole "
                         "backward passes: use gpipe, 1f1b or interleaved-1f1b")
    timeline = simulate(schedule)
    timed = [(start, rank, index, action) for rank, actions in enumerate(timeline.ranks)
             for index, (action, start, _) in enumerate(actions)]
    return [action for *_, action in sorted(timed, key=lambda item: item[:3])]


def backward_local(loss) -> None:
    """Backward of `loss` on the workers that hold it only; crossings into them wait for
    `backward_into`."""
    if not loss.requires_grad:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    run_backward(loss, [loss._handle], {"local": True}, keep_graph=False)


def backward_into(moved) -> None:
    """Send the gradient of `moved` (made by gt.signal.tensor) back to where it came from, and
    continue backward there."""
    moved._session.issue("cross_backward", [], [moved._handle], [0], tensors=(moved,))


def run_step(schedule: Schedule, chunk_forward, stage_signal, inputs: list, targets: list, loss_fn) -> list:
    """One optimizer step's forward and backward over `schedule.microbatches` microbatches.

    chunk_forward(c, x): chunk c of the model on its input (the model code opens its own
    regions); stage_signal(c): the signal chunk c's input moves to; inputs[i] / targets[i]:
    microbatch i's data, already where chunk 0 / the last chunk computes. Returns each
    microbatch's loss, divided by the number of microbatches (their sum is the step's loss).
    """
    m, last = schedule.microbatches, schedule.num_chunks - 1
    moved, losses = {}, [None] * m
    for action in issue_order(schedule):
        i, c = action.microbatch, action.stage
        if action.op == "F":
            y = chunk_forward(c, inputs[i] if c == 0 else moved[(i, c)])
            if c == last:
                losses[i] = loss_fn(y, targets[i]) / m
            else:
                moved[(i, c + 1)] = move_to_signal(y, stage_signal(c + 1))
        elif c == last:
            backward_local(losses[i])
        else:
            backward_into(moved.pop((i, c + 1)))
    return losses
