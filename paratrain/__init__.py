"""paratrain: collectives from point-to-point, data/tensor/pipeline parallelism, benchmarks."""

from paratrain.comm import Group
from paratrain.launch import run
from paratrain.mesh import Mesh
from paratrain.parallel.tensor.parallelize import parallelize
from paratrain.environment import Settings
from paratrain.train.api import Prepared, prepare
from paratrain.train.setup import seeded

__version__ = "0.1.0"
__all__ = ["Group", "Mesh", "Prepared", "Settings", "parallelize", "prepare", "run", "seeded", "__version__"]
