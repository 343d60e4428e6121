"""Transports move bytes between ranks; the `Group` above them adds algorithms and checks."""

from paratrain.comm.transport.base import P2POp, Transport, Work
from paratrain.comm.transport.fabric import Fabric, FabricTransport
from paratrain.comm.transport.torch_pg import TorchTransport

__all__ = ["P2POp", "Transport", "Work", "Fabric", "FabricTransport", "TorchTransport"]
