"""The operations a worker runs itself (no function in the op table): uploads, frees,
autograd, optimizers and the seed. Each takes the executor and the `Step` being run."""

from __future__ import annotations

import torch

from paratrain.frontend.ops import torch_dtype


def upload(executor, step) -> None:
    kwargs = step.instruction.kwargs
    dtype, shape = torch_dtype(kwargs["dtype"]), kwargs["shape"]
    frame = step.frames[kwargs["frame"]]
    if len(frame) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        tensor = torch.frombuffer(bytearray(frame), dtype=dtype).reshape(shape)
    tensor = tensor.to(executor.device)
    if step.instruction.requires_grad:
        tensor.requires_grad_(True)
    executor.tensors[step.base + step.instruction.outs[0]] = tensor


def free(executor, step) -> None:
    for handle in step.args:
        executor.tensors.pop(step.base + handle, None)
        executor.poisoned.pop(step.base + handle, None)


def backward(executor, step) -> None:
    loss, gradient = step.args[0], step.args[1] if len(step.args) > 1 else None
    loss.backward(gradient, retain_graph=bool(step.instruction.kwargs.get("retain_graph")))


def keep_grads(executor, step) -> None:
    """The client keeps these results' gradients (GT's rule; PyTorch's `retain_grad`)."""
    for handle in step.args:
        result = executor.tensors.get(step.base + handle)
        if isinstance(result, torch.Tensor) and result.grad_fn is not None and not _compiled(result):
            result.retain_grad()


def _compiled(result: torch.Tensor) -> bool:
    """Made by a compiled region: the gradient it would keep misses the uses inside the region,
    so it keeps none (`.grad` then says so)."""
    return "CompiledFunction" in type(result.grad_fn).__name__


def grad(executor, step) -> None:
    tensor = step.args[0]
    gradient = tensor.grad
    if gradient is None and tensor.grad_fn is not None:
        raise RuntimeError("this result kept no gradient: it was made inside a compiled region, or on other "
                           "workers than the ones backward started on")
    if gradient is None:
        raise RuntimeError("the tensor has no gradient (backward did not reach it)")
    executor.store(step, gradient)


def set_grad_none(executor, step) -> None:
    step.args[0].grad = None


def set_grad(executor, step) -> None:
    step.args[0].grad = step.args[1].detach()


def set_data(executor, step) -> None:
    step.args[0].data = step.args[1]


def requires_grad_(executor, step) -> None:
    step.args[0].requires_grad_(bool(step.args[1]))


def manual_seed(executor, step) -> None:
    torch.manual_seed(int(step.args[0]) + executor.rank)  # worker r draws from seed + r


OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def optim_create(executor, step) -> None:
    kwargs = step.instruction.kwargs
    options = {k: v for k, v in kwargs.items() if k != "kind" and v is not None}
    if "betas" in options:
        options["betas"] = tuple(options["betas"])
    if kwargs.get("kind") not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kwargs.get('kind')!r}; valid: {', '.join(OPTIMIZERS)}")
    executor.store(step, OPTIMIZERS[kwargs["kind"]](list(step.args), **options))


def optim_step(executor, step) -> None:
    step.args[0].step()


def optim_zero_grad(executor, step) -> None:
    step.args[0].zero_grad(set_to_none=step.instruction.kwargs.get("set_to_none", True))


def optim_set_lr(executor, step) -> None:
    for group in step.args[0].param_groups:
        group["lr"] = step.instruction.kwargs["lr"]


def region_marker(executor, step) -> None:
    """Where a compiled region begins or ends: compiled.py acts on it before it gets here."""


def _not_on_workers(executor, step) -> None:
    raise RuntimeError(f"{step.instruction.op} is the dispatcher's to route, not a worker's to run")


HANDLERS = {
    "upload": upload, "free": free, "backward": backward, "keep_grads": keep_grads, "grad": grad, "set_grad_none": set_grad_none,
    "set_grad": set_grad, "set_data": set_data, "requires_grad_": requires_grad_, "manual_seed": manual_seed,
    "optim_create": optim_create, "optim_step": optim_step, "optim_zero_grad": optim_zero_grad,
    "optim_set_lr": optim_set_lr, "cross_backward": _not_on_workers, "reshard": _not_on_workers,
    "region_begin": region_marker, "region_end": region_marker,
}
