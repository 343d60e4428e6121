"""Transports move bytes between ranks; the `Group` above them adds algorithms and checks.

Three, each with its `kind`: the in-process fabric ("fabric": ranks as threads, fabric.py), a
torch.distributed process group ("gloo" or "nccl": torch_pg.py), and shared memory between the
processes of one host ("shm": shm_transport.py, over a gloo group, chosen when the group is made).
"""

from paratrain.comm.transport.base import P2POp, Transport, Work
from paratrain.comm.transport.fabric import Fabric, FabricTransport
from paratrain.comm.transport.shm_transport import SharedMemoryTransport, over_process_group
from paratrain.comm.transport.torch_pg import TorchTransport

__all__ = ["P2POp", "Transport", "Work", "Fabric", "FabricTransport", "SharedMemoryTransport", "TorchTransport",
           "over_process_group"]
