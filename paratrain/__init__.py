"""paratrain: collectives from point-to-point, data/tensor/pipeline parallelism, benchmarks."""

from paratrain.comm import Group
from paratrain.launch import run
from paratrain.parallel.tensor.apply_plan import parallelize
from paratrain.settings import Settings

__version__ = "0.1.0"
__all__ = ["Group", "Settings", "parallelize", "run", "__version__"]
