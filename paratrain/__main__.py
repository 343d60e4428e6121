"""`python -m paratrain ...` (what `torchrun -m paratrain train ...` runs)."""

from paratrain.cli import main

main()
