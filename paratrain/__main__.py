"""`python -m paratrain ...` is the `paratrain` command (how auto-started servers are run)."""

from paratrain.cli import main

main(prog_name="paratrain")
