"""`import gt` for GT's programs: GT's public API, served by paratrain's frontend.

    PYTHONPATH=compat python your_gt_program.py

Everything here is `paratrain.frontend`; the submodules below exist so that GT's import
paths (`gt.client.tensor`, `gt.client.nn`, `gt.nn`, `gt.config`, `gt.debug`,
`python -m gt.server`, `python -m gt.worker`) resolve to the same objects.
"""

from paratrain.frontend import *  # noqa: F401,F403 - the alias is the whole public API
from paratrain.frontend import __all__ as _frontend_names

__all__ = list(_frontend_names)
