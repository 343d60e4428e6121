"""`python -m gt.worker --host H -p PORT [--backend B]`: a paratrain worker with GT's flags.

(`gt/worker/` has no `__init__.py`: importing `gt` keeps `gt.worker` as the API's function.)"""

import runpy

runpy.run_module("paratrain.frontend.worker", run_name="__main__")
