"""paratrain: collectives from point-to-point, data/tensor/pipeline parallelism, benchmarks."""

from paratrain.comm import Group
from paratrain.launch import run
from paratrain.settings import Settings

__version__ = "0.1.0"
__all__ = ["Group", "Settings", "run", "__version__"]
