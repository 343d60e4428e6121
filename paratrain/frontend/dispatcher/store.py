"""The store workers meet at to form their world, when no launcher formed it for them.

PyTorch's TCPStore listens on every interface when it opens its own socket. Here it is given a
socket already bound to the interface `paratrain serve` listens on, so a dispatcher bound to
loopback exposes nothing beyond this machine.
"""

from __future__ import annotations

import socket


class WorkerStore:
    def __init__(self, host: str, world_size: int):
        import torch.distributed as dist

        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address[:2] if family == socket.AF_INET else address)
        listener.listen(max(128, world_size))
        self.port = listener.getsockname()[1]
        # The store owns the listening socket from here.
        self.store = dist.TCPStore(host, self.port, world_size, is_master=True, wait_for_workers=False,
                                   master_listen_fd=listener.detach())
