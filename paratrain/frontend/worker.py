"""`python -m paratrain.frontend.worker`: GT's `python -m gt.worker --host H -p PORT`, which is
`paratrain worker` (the same command: -p/--port, --host, --backend, --id, and paratrain's own).

`paratrain.frontend.worker` is also `gt.worker(i)`, the function that places tensors on worker
i. `python -m` runs this file without importing it as that name, so the function stays. But an
import of `paratrain.frontend.worker` (a tool that imports every module) would set the
package's `worker` to this module; so imported, the module puts the function in its own place
in `sys.modules`, and the import binds the function again.
"""

import sys

if __name__ == "__main__":
    from paratrain.frontend.cli import worker

    worker(prog_name="python -m paratrain.frontend.worker", help_option_names=["-h", "--help"])
else:
    from paratrain.frontend.client.api import worker as place_on_worker

    sys.modules[__name__] = place_on_worker
