"""Validation loss during training, computed by the parallel model that trains.

Every `eval_every` steps and at the last step, every rank runs the forward pass alone over the
same held-out global batches (`paratrain.data.validation_batches`: text and digits have a
validation split; the synthetic sets give fresh draws). Each rank takes its data-parallel share
of every batch; under pipeline parallelism the share goes through the stages in chunk order,
activations sent stage to stage as in training, and the last chunk's owner computes the loss;
under tensor parallelism the loss is the vocabulary-parallel one that trains. Losses are summed
with the number of targets behind them and all-reduced, so the result is the mean over every
held-out target, whatever the dp x pp x tp layout.

The model is put in eval mode (no dropout) under torch.no_grad() and given back in the mode it
was in; nothing here draws from an RNG or touches gradients or optimizer state, so training
losses are the same with and without evaluation.

Shape legend: B batch (this rank's share), T sequence position.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from paratrain.data import validation_batches
from paratrain.parallel.context.layout import shard
from paratrain.parallel.pipeline.pp_comms import PipelineLink
from paratrain.parallel.precision import autocast

# Held-out global batches per evaluation: enough for a steady number (gpt-tiny on text at batch
# 64: 32K held-out bytes), few enough that evaluating costs about as much as 3 training steps.
EVAL_BATCHES = 8


class Evaluator:
    """What one rank needs to compute the validation loss at any step."""

    def __init__(self, config, dataset, parallel, mesh, device=None):
        """`parallel`: the ParallelModel that trains (train/parallel_model.py), on `mesh`."""
        self.every, self.last_step = config.eval_every, config.steps - 1
        self.parallel, self.mesh, self.device = parallel, mesh, device or torch.device("cpu")
        self.module, self.loss_fn, self.dp_group = parallel.module, parallel.loss_fn, mesh.dp
        self.cp_layout = config.parallel.cp_layout
        self.batches = validation_batches(dataset, config.data.global_batch, EVAL_BATCHES) if self.every else []
        # Accuracy is argmax over the whole output: only classifiers, whose output is never sharded.
        self.classifier = dataset.task == "classification"
        self.autocast = autocast(config.parallel.precision, self.device)
        self.pipelined = parallel.schedule is not None

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def run(self) -> dict[str, float]:
        """{"val_loss"} (and {"val_accuracy"} for classifiers), the same on every rank."""
        # [summed loss, targets counted, correct predictions]
        totals = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad(), _eval_mode(self.module):
            shares = [self._share(inputs, targets) for inputs, targets in self.batches]
            if self.pipelined:
                totals += self._pipeline_totals(shares)
            else:
                for inputs, targets in shares:
                    if len(targets):
                        totals += self._totals(self._forward(self.module, inputs), targets)
        if self.pipelined:
            self.mesh.pp.all_reduce(totals, "sum")  # only the last chunk's owner has counted
        self.mesh.dp_cp.all_reduce(totals, "sum")  # every replica's rows, every cp rank's tokens
        loss_sum, count, correct = totals.tolist()
        result = {"val_loss": loss_sum / count}
        if self.classifier:
            result["val_accuracy"] = correct / count
        return result

    def _share(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows: tensor_split, so a short last batch (digits) still
        splits; its counts make the all-reduced mean exact."""
        rank, size, cp = self.dp_group.rank, self.dp_group.size, self.mesh.cp
        rows = [t.tensor_split(size)[rank] for t in (inputs, targets)]
        if cp.size > 1:  # and this context-parallel rank's part of each sequence
            rows = [shard(t, 1, cp.rank, cp.size, self.cp_layout) for t in rows]
        return rows[0].to(self.device), rows[1].to(self.device)

    def _forward(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return module(x)

    def _totals(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        count = targets.numel()  # the loss is a mean over every target element
        loss_sum = float(self.loss_fn(outputs, targets)) * count
        correct = int((outputs.argmax(-1) == targets).sum()) if self.classifier else 0
        return torch.tensor([loss_sum, count, correct], dtype=torch.float64)

    def _pipeline_totals(self, shares: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward only, batch after batch, each through this rank's chunks in chunk order: a
        rank waits only for activations of lower chunks, whose sends never block, so every
        order of arrival completes."""
        schedule, rank = self.parallel.schedule, self.mesh.coords.pp
        last = schedule.num_chunks - 1
        link = PipelineLink(self.mesh.pp, schedule.num_chunks, len(shares))
        totals = torch.zeros(3, dtype=torch.float64)
        for b, (inputs, targets) in enumerate(shares):
            outputs = {}
            for c in sorted(self.parallel.chunks):
                if c == 0:
                    x = inputs
                elif schedule.owner(c - 1) == rank:
                    x = outputs[c - 1]
                else:
                    x = link.recv_activation(schedule.owner(c - 1), c, b, self.device)
                outputs[c] = self._forward(self.parallel.chunks[c], x)
                if c == last:
                    totals += self._totals(outputs[c], targets)
                elif schedule.owner(c + 1) != rank:
                    link.send_activation(outputs[c], schedule.owner(c + 1), c + 1, b)
        link.wait_sends()
        return totals


def format_validation(entry: dict) -> str:
    """The log line's validation part: '' at steps without an evaluation."""
    text = f"  val loss {entry['val_loss']:.5f}" if "val_loss" in entry else ""
    return text + (f"  val acc {entry['val_accuracy']:.1%}" if "val_accuracy" in entry else "")


@contextmanager
def _eval_mode(module: torch.nn.Module):
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)
