"""The stores a world's processes meet at: the elastic agent's rendezvous and the ranks' own
store, served on loopback where the world is local (`loopback_server`), and which store a rank
joins (`store_for`), with its keys kept apart from a failed attempt's after an elastic restart.
launch.py starts the rendezvous and joins the ranks through them.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from paratrain.environment import Settings

# A local world listens on loopback only. PyTorch's TCPStore listens on every interface whatever
# host it is given, so what a local world serves is started here on a socket bound to 127.0.0.1:
# the rendezvous (the agent's own TCPStore, multi-tenant, finds ours on its port and shares it)
# and the ranks' store (rank 0 serves it, `store_for`), instead of the one the agent would
# start for them on every interface (TORCH_DISABLE_SHARE_RDZV_TCP_STORE keeps it from starting).

def loopback_server(host: str, port: int, world_size: int | None, timeout: float, multi_tenant: bool = False):
    """A TCPStore served from a socket bound to `host`:`port` (0: any free port) alone."""

    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(128)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timedelta(seconds=timeout), multi_tenant=multi_tenant,
                         master_listen_fd=listener.detach(), use_libuv=True)


def store_for(settings: Settings):
    """The store the ranks meet at; None: the default (env://, as torchrun describes it).

    - A local world our launcher started: rank 0 serves it on loopback (see loopback_server).
    - After an elastic restart, a store may still hold the keys the failed attempt's ranks wrote
      (gloo's addresses among them), and the new ranks would try to connect to dead ones: a
      prefix per attempt keeps each attempt's keys apart.
    - Under torchrun with a store of the ranks' own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), rank 0
      serves a new one at a new port each round: no prefix, and none must be, since with several
      nodes the attempt count differs from node to node (an agent that restarts its ranks because
      another node rejoined does not count it) and the ranks would wait on each other's keys."""
    import torch.distributed as dist

    where = settings.launch
    if where.master_addr is None or where.master_port is None:
        return None
    timeout = timedelta(seconds=settings.timeout)
    if where.launcher_pid is not None and not where.agent_store and where.rank == 0:
        store = loopback_server(where.master_addr, where.master_port, where.world_size, settings.timeout)
    elif where.launcher_pid is not None or where.restart_count and where.agent_store:
        store = dist.TCPStore(where.master_addr, where.master_port, where.world_size,
                              is_master=not where.agent_store and where.rank == 0, timeout=timeout)
    else:
        return None
    return dist.PrefixStore(f"paratrain/attempt-{where.restart_count}", store) if where.restart_count else store
