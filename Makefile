# Two commands a new user needs: `make demo` and `make test`. Both build .venv on first use.
# TORCH_SPEC pins the CPU build of torch here; on a GPU machine, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONDONTWRITEBYTECODE :=

.PHONY: demo demo-dp demo-frontend test bench-collectives results matrix picture docs-check install clean

# The venv without pip's own copy (ensurepip costs 5 s); uv through this Python's pip; torch
# (TORCH_SPEC), the rest, and pip for the user's own installs, through uv (it keeps the torch it
# finds: the project asks only torch>=2.4). Where pip is told of a folder of wheels (PIP_FIND_LINKS,
# as on a machine that keeps the CPU build of torch on its disk) and TORCH_SPEC is the default, uv
# looks there too: the local build (2.13.0+cpu) ranks above the index's 2.13.0, and uv unpacks it in
# a third of pip's time. Otherwise pip installs TORCH_SPEC as given (an --index-url, say).
# Not all of it byte-compiled ahead (that was 30 s of a 50 s build): one import of what every
# rank and test process imports writes those modules' .pyc files, and the rest are written the
# first time something imports them (this Makefile clears PYTHONDONTWRITEBYTECODE for every
# command it runs), so only what runs is compiled, once. Two imports at once, one per core: what
# torch's compiler and the tests import that does not import torch (sympy, networkx, transformers'
# front, pytest's plugins: BESIDE_TORCH) beside torch's own, 11.5 s where one import took 15.7.
BESIDE_TORCH := 'sympy', 'networkx', 'mpmath', 'jinja2', 'transformers', 'zmq', 'rich.progress', \
	'pytest', 'xdist', 'hypothesis.strategies'
ifneq ($(and $(PIP_FIND_LINKS),$(filter file,$(origin TORCH_SPEC))),)
TORCH_BY_UV := $(foreach folder,$(PIP_FIND_LINKS),--find-links $(folder)) $(TORCH_SPEC)
else
TORCH_BY_PIP := $(TORCH_SPEC)
endif

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install --quiet --no-compile $(TORCH_BY_PIP) uv
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/uv pip install --quiet $(TORCH_BY_UV) pip -e '.[test,mpi,hf]'
	$(BIN)/python -c "import importlib.util; [importlib.import_module(m) for m in ($(BESIDE_TORCH)) \
		if importlib.util.find_spec(m.split('.')[0])]" & beside=$$!; \
	$(BIN)/python -c "import importlib, paratrain.forking as f; \
		[importlib.import_module(m) for m in (*f.PRELOAD, 'torch._inductor.compile_fx', 'torch.distributed.checkpoint')]" \
		&& wait $$beside
	touch $(STAMP)

install: $(STAMP)

# A short 3D run: 8 ranks (threads) = 2 data-parallel replicas x 2 pipeline stages x 2
# tensor-parallel ranks, training a small GPT with the 1F1B schedule.
demo: $(STAMP)
	@echo "== paratrain demo: a small GPT on 8 ranks = dp 2 x pp 2 x tp 2 (one thread each)."
	@echo "   Tensor parallelism splits every layer over 2 ranks, the pipeline splits the layers"
	@echo "   into 2 stages run with the 1F1B schedule below, and 2 replicas average gradients."
	@echo "   Watch the loss fall; the summary gives the measured pipeline bubble beside the schedule's."
	$(BIN)/paratrain train --model gpt-small --dp 2 --pp 2 --tp 2 --schedule 1f1b --microbatches 4 \
		--steps 40 --global-batch 32 --optimizer adamw --lr 0.003 --log-every 10

# Data-parallel training on 2 processes: our bucketed DDP, a CNN on the digits images.
demo-dp: $(STAMP)
	@echo "== 2 processes (gloo) train a CNN on scikit-learn's digits images with our DDP: each rank"
	@echo "   takes half of every batch; gradient buckets are all-reduced while backward still runs."
	$(BIN)/paratrain train --model cnn --nproc 2 --launcher processes --dp-mode ddp \
		--steps 80 --global-batch 128 --optimizer adamw --lr 0.003 --log-every 20

# The GT seed's demo through the single-controller frontend: one client program drives 8
# workers, TP=2 within each of 4 pipeline stages (examples/tuning_demo/sharding_config.yaml).
demo-frontend: $(STAMP)
	@echo "== One client program drives 8 workers (processes): the GT seed's GPT split TP=2 x PP=4 by"
	@echo "   examples/tuning_demo/sharding_config.yaml, trained with the 1F1B schedule and AdamW."
	@echo "   Each step prints the loss, the step time, and the bubble the workers measured."
	$(BIN)/python examples/tuning_demo/train.py --small --steps 30

# A short sweep of our collectives against gloo's own.
bench-collectives: $(STAMP)
	$(BIN)/paratrain bench collectives --ops all_reduce,reduce_scatter --algos ring,hd,native,auto \
		--nproc 2 --launcher processes --min-bytes 64K --max-bytes 16M --factor 4 --iters 10

# docs/results.md from data: the benchmark sweeps that fit in about 10 minutes on 2 cores write
# their JSON under docs/results/, and the page is rendered from it (paratrain/bench/results_page.py).
results: $(STAMP) picture
	$(BIN)/python -m paratrain.bench.results_page --folder docs/results --page docs/results.md

# The parity matrix: every model x data-parallel strategy x layout against one process (about 5
# minutes on 2 cores); its table goes into docs/results.md, written even when a cell fails.
matrix: $(STAMP)
	$(BIN)/paratrain matrix --json docs/results/matrix.json; status=$$?; \
		$(BIN)/python -m paratrain.bench.results_page --folder docs/results --page docs/results.md --render; \
		exit $$status

# The picture on the README's front page: the 1F1B schedule the runtime executes, as a timeline.
picture: $(STAMP)
	$(BIN)/paratrain schedule --schedule 1f1b --stages 4 --microbatches 8 --png docs/pipeline-1f1b.png

# Four pytest-xdist workers, one test file each at a time (files share their servers and
# worlds): many tests wait (on process start-up, rendezvous, a lost peer's timeout), and the suite
# used 1.4 of the two cores with three workers; four took 218-230 s where three took 240-242, in
# runs back to back. Files are handed out longest first (tests/conftest.py's LONGEST_FIRST):
# --no-loadscope-reorder, or xdist hands them out by their number of tests instead, and a long
# file can start last. Then, alone, the tests marked serial: each test keeps its files in folders
# of its own (PARATRAIN_SHM_DIR, TMPDIR), but a run killed whole leaves multiprocessing's
# semaphores in /dev/shm itself, and any run beside it would remove them (and say so). The serial
# part collects only the files that name the mark (collecting all of them takes 6 s).
# PYTEST_ARGS adds options to both, e.g. PYTEST_ARGS=--durations=30 for the slowest tests.
TEST_WORKERS ?= 4
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m serial $(PYTEST_ARGS) $$(grep -l "pytest.mark.serial" tests/test_*.py)

# Every shell command and Python snippet in README.md, docs/*.md (but the generated results.md and
# configuration.md) and examples/**/README.md, run one block at a time, and the output each page
# shows compared (paratrain/docs_check/). DOCS_CHECK_ARGS narrows it, e.g. --only training.md.
docs-check: $(STAMP)
	$(BIN)/python -m paratrain.docs_check $(DOCS_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
