"""GT's `gt.client.nn`: modules and loss functions (paratrain's `gt.nn`)."""

from paratrain.frontend.client.nn import *  # noqa: F401,F403
from paratrain.frontend.client.nn import cross_entropy_loss, mse_loss  # noqa: F401
