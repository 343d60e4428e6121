"""GT's `gt.client.tensor`: the Tensor class and the functions that make tensors."""

from paratrain.frontend import Tensor, cat, from_numpy, ones, randn, tensor, zeros  # noqa: F401
