"""GT's `gt.debug`: the client's tape and the workers' statistics."""

from paratrain.frontend.client.debug import *  # noqa: F401,F403
