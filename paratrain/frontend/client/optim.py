"""Optimizers whose `step()` is one instruction: the update runs on the workers, with
PyTorch's own `torch.optim.SGD` / `AdamW` built there over the parameters each worker holds."""

from __future__ import annotations


class Optimizer:
    kind = ""

    def __init__(self, params, **hyper):
        self.params = list(params)
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        self.session = self.params[0]._session
        self.hyper = hyper
        self.handle = self.session.new_handle()
        handles = [p._handle for p in self.params]
        self.session.issue("optim_create", [self.handle], handles, list(range(len(handles))),
                           {"kind": self.kind, **hyper}, tensors=tuple(self.params))

    def step(self) -> None:
        self.session.issue("optim_step", [], [self.handle], [0])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.session.issue("optim_zero_grad", [], [self.handle], [0], {"set_to_none": set_to_none})
        if set_to_none:
            for param in self.params:
                param._has_grad, param._grad_tensor = False, None

    @property
    def lr(self) -> float:
        return self.hyper["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        self.hyper["lr"] = float(value)
        self.session.issue("optim_set_lr", [], [self.handle], [0], {"lr": float(value)})

    def __del__(self):
        try:
            self.session.free(self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class SGD(Optimizer):
    kind = "sgd"

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, dampening: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         nesterov=nesterov, dampening=dampening)


class AdamW(Optimizer):
    kind = "adamw"

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay)
