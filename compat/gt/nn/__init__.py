"""GT's `gt.nn`: modules, losses and the SGD optimizer."""

from paratrain.frontend.client.nn import *  # noqa: F401,F403
from paratrain.frontend.client.nn import SGD, cross_entropy_loss, mse_loss  # noqa: F401
