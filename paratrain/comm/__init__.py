"""Communication: transports, the Group over them, and collectives written from p2p."""

from paratrain.comm.choice import AlgorithmTable, Choice
from paratrain.comm.errors import CollectiveMismatchError, CommTimeoutError, FabricAborted, PeerLostError
from paratrain.comm.flight import dump_flight_record
from paratrain.comm.group import Group
from paratrain.comm.transport import Fabric, FabricTransport, SharedMemoryTransport, TorchTransport, over_process_group

__all__ = [
    "AlgorithmTable", "Choice", "CollectiveMismatchError", "CommTimeoutError", "Fabric",
    "FabricAborted", "FabricTransport", "Group", "PeerLostError", "SharedMemoryTransport", "TorchTransport",
    "dump_flight_record", "over_process_group",
]
