# Two commands a new user needs: `make demo` and `make test`. Both build .venv on first use.
# TORCH_SPEC pins the CPU build of torch here; on a GPU machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench-collectives install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Data-parallel training on 2 processes: our bucketed DDP, a CNN on the digits images.
demo: $(STAMP)
	@echo "== paratrain demo: 2 processes (gloo) train a CNN on scikit-learn's digits images with"
	@echo "   our DDP. Each rank takes half of every batch of 128; gradient buckets are all-reduced"
	@echo "   while backward still runs. Watch the loss fall; the summary splits each step into"
	@echo "   compute and communication, and says how much communication backward did not hide."
	$(BIN)/paratrain train --model cnn --nproc 2 --launcher processes --dp-mode ddp \
		--steps 80 --global-batch 128 --optimizer adamw --lr 0.003 --log-every 20

# A short sweep of our collectives against gloo's own.
bench-collectives: $(STAMP)
	$(BIN)/paratrain bench collectives --ops all_reduce,reduce_scatter --algos ring,hd,native,auto \
		--nproc 2 --launcher processes --min-bytes 64K --max-bytes 16M --factor 4 --iters 10

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
