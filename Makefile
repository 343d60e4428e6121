# Two commands a new user needs: `make demo` and `make test`. Both build .venv on first use.
# TORCH_SPEC pins the CPU build of torch here; on a GPU machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/paratrain bench collectives --ops all_reduce,reduce_scatter --algos ring,hd,native,auto \
		--nproc 2 --launcher processes --min-bytes 64K --max-bytes 16M --factor 4 --iters 10

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
