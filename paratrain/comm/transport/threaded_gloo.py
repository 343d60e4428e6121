"""A real gloo process group among threads of one process.

torch.distributed normally has one rank per process; its gloo backend, though, works just as
well with one rank per thread if each thread builds its group by hand on a shared store.
That lets PyTorch's own DDP run on the threads launcher, beside ours, with no global state.
It uses torch's lower-level constructors (ProcessGroup + registered backend), the same steps
init_process_group takes internally.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def threaded_gloo_group(store, rank: int, size: int, timeout: float) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore("paratrain-threads", store)
    backend = dist.ProcessGroupGloo(prefixed, rank, size, timedelta(seconds=timeout))
    group = dist.ProcessGroup(prefixed, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group
