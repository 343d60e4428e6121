"""`make docs-check`: every command and Python snippet in the docs is run, and where a page shows
what it prints, the output is compared.

    python -m paratrain.docs_check [PAGES...] [--list] [--only PATTERN]

The package: pages.py reads the blocks and their annotations, run.py runs one, compare.py
matches what a page shows against what ran, cli.py is the command.

What runs: fenced blocks marked ```bash, ```sh, ```shell (every line not a comment is a command,
`\\` continues it, a here-document belongs to its command), ```console (`$ ` starts a command; the
lines up to the next `$ ` are the output the page shows for it) and ```python (a script, run by
this virtual environment's python). Other fences (yaml, text, none) are prose: they are not run.

Where it runs: each block in a fresh temporary folder that holds a link to every entry of the
repository root (so `.venv/bin/paratrain`, `examples/...` resolve, and what the block writes
beside them stays out of the checkout), this environment's bin/ first on PATH; a command that
starts `make ` runs in the repository root. The run has a cache folder of its own
(XDG_CACHE_HOME), so a table `bench collectives --tune` measures does not steer the user's `auto`.
A block has a bounded time; a block that outlives it is killed with its whole process group, and
so is whatever a block leaves running.

What passes: each line the page shows must appear in the output, in order, other lines allowed
between them (so a `...` line in the shown output is only a reminder); numbers match any number
and runs of spaces match one space, since timings and losses vary, and `...` inside a line
matches any text. A command must exit 0 unless the page shows its output: then the output is
the check (a page may show an error on purpose).

Annotations, HTML comments on the lines just before a fence, one directive each:

    <!-- docs-check: skip: REASON -->      not run; the summary prints REASON (a GPU, two machines)
    <!-- docs-check: timeout SECONDS -->   this block's limit instead of 300 s
    <!-- docs-check: file NAME -->         the block saved as NAME for the page's later blocks
                                           (a yaml block is then only written; python still runs)
    <!-- docs-check: output -->            this plain block is what the command block above prints
    <!-- docs-check: console -->           this plain block is a console transcript ($ lines)
    <!-- docs-check: in FOLDER -->         run among FOLDER's entries (from the repository root),
                                           for a snippet the page says to run in that folder
"""
