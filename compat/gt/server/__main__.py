"""`python -m gt.server -p PORT [--spawn_gpu_workers N]`: paratrain's dispatcher with GT's flags."""

import runpy

runpy.run_module("paratrain.frontend.server", run_name="__main__")
