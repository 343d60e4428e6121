"""`python -m paratrain.frontend.server`: GT's `python -m gt.server -p PORT [--spawn_gpu_workers N]`,
which is `paratrain serve` (the same command, so the same flags: -p/--port, -H/--host,
--spawn_gpu_workers, --log-file, --no-console-log, and all of paratrain's own)."""

from paratrain.frontend.cli import serve

if __name__ == "__main__":
    serve(prog_name="python -m paratrain.frontend.server", help_option_names=["-h", "--help"])
