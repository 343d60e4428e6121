"""paratrain: collectives from point-to-point, data/tensor/pipeline parallelism, benchmarks."""

from paratrain.comm import Group
from paratrain.launch import run

__version__ = "0.1.0"
__all__ = ["Group", "run", "__version__"]
