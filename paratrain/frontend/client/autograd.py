"""Whether operations issued now record autograd graphs on the workers (PyTorch's grad mode,
per thread, as in PyTorch)."""

from __future__ import annotations

import functools
import threading

_state = threading.local()


def is_grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


class _GradMode:
    enabled: bool

    def __enter__(self):
        self._previous = is_grad_enabled()
        _state.enabled = self.enabled
        return self

    def __exit__(self, *exc):
        _state.enabled = self._previous
        return False

    def __call__(self, fn):  # also usable as a decorator, like torch.no_grad
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)
        return wrapped


class no_grad(_GradMode):  # noqa: N801 - PyTorch's (and GT's) name
    enabled = False


class enable_grad(_GradMode):  # noqa: N801
    enabled = True
