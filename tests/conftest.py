"""Keep every test independent of the machine it runs on: no tuned algorithm table from the
user's cache (it would change what `algo="auto"` picks), no debug or timeout settings from
the shell, and flight records of failing calls in the test's own temporary folder. Spawned
ranks inherit this environment, so the same holds for launcher="processes".
"""

import gc
import multiprocessing.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# torch and the frontend are imported where they are used: xdist's controller loads this file
# too, and runs no test (their imports cost it 4 CPU-seconds while its workers collect).


def pytest_configure(config):
    # One intra-op thread per test process and per process a test starts: `make test` runs four
    # pytest workers on two cores, where a second OpenMP thread spin-waits after every operation
    # on tiny tensors (a gpt-tiny reference run: 2.4 s of CPU with two threads, 0.15 s with one).
    # Results stay within every stated tolerance: only the order of some sums changes. Set before
    # torch is imported, which reads it (and so does every process a test starts).
    os.environ["OMP_NUM_THREADS"] = "1"
    config.addinivalue_line("markers", "serial: leaves or compares what every run on the host shares "
                                       "(/dev/shm): `make test` runs these after the parallel part, alone")


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=2000,
                     help="mutated messages the frontend fuzz test sends on each side of authentication")


# The files that take longest (seconds of one xdist worker, measured with `make test
# PYTEST_ARGS=--durations=0`), in that order. pytest-xdist's --dist loadfile hands files to its
# workers in collection order (with --no-loadscope-reorder, as the Makefile says: by default it
# orders them by their number of tests), so collecting these first leaves short files to fill the end of
# the run, instead of one long file running alone on a core while the others sit idle. A file
# not named keeps its place after them; a stale list costs only that balance.
LONGEST_FIRST = (
    "test_leftovers.py", "test_frontend_debug_tools.py", "test_frontend_faults.py", "test_fsdp.py",
    "test_multinode.py", "test_frontend_workers.py", "test_matrix.py", "test_frontend_compile.py", "test_docs.py",
    "test_checkpoint.py", "test_parallel_3d.py", "test_bench_mpi_peer.py", "test_frontend_gt.py",
    "test_frontend_instruction_checks.py", "test_moe_training.py", "test_hf_models.py", "test_shm_p2p.py",
    "test_collectives_fabric.py", "test_frontend_demo.py", "test_data_parallel.py", "test_compile_training.py",
    "test_shm_arena.py", "test_launcher_exposure.py", "test_context_training.py", "test_hf_export.py",
    "test_bench_collectives.py", "test_all_to_all_uneven.py", "test_precision.py", "test_bench_training.py",
    "test_text_data.py", "test_user_errors.py", "test_native_kernels.py", "test_collectives_gloo.py",
    "test_frontend_errors.py", "test_frontend_peer_limits.py", "test_data.py", "test_llama_parallel.py",
    "test_bench_simulated_hosts.py", "test_schedules.py", "test_layers.py", "test_moe_models.py",
    "test_frontend_fuzz.py", "test_frontend_resilience.py", "test_frontend_backward_placement.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: in-file order kept


def pytest_collection_finish(session):
    import torch

    torch.set_num_threads(1)  # where torch was imported before OMP_NUM_THREADS was set
    # What collection imported (torch, transformers, every test module) lives as long as the
    # process: frozen, the garbage collector stops walking it, and it collects the youngest
    # objects after 20,000 allocations instead of 700 (a test's ranks allocate many short-lived
    # objects, none of them in cycles that matter). Measured on three parity files: 2.0 of 39
    # CPU-seconds went to collections, 0.9 so.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


@pytest.fixture
def short_tmp() -> Path:
    """A temporary directory of the test's own (TMPDIR for its runs), with a short path: a fork
    server's socket lives in it, and a socket's path may not pass 107 bytes (an xdist worker's
    tmp_path takes most of them). Removed when this process exits, after multiprocessing has
    removed its own folder in it: a fork server made there serves this process's later runs."""
    folder = tempfile.mkdtemp(prefix="pt-", dir="/tmp")
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                  exitpriority=-200)  # multiprocessing's own folder goes at -100
    return Path(folder)


@pytest.fixture(autouse=True)
def hermetic_comm_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PARATRAIN_ALGO_TABLE", str(tmp_path / "no-algorithm-table.json"))
    monkeypatch.setenv("PARATRAIN_TRACE_DIR", str(tmp_path / "flight-records"))  # failures dump here
    for name in ("PARATRAIN_DEBUG", "PARATRAIN_TIMEOUT", "PARATRAIN_SHM", "PARATRAIN_SHM_BYTES", "PARATRAIN_SHM_DIR"):
        monkeypatch.delenv(name, raising=False)
    # A waiting rank polls 50 ms before it sleeps where each rank has a core; the suite runs four
    # tests at once on two cores, where that polling takes the cores of the other tests' ranks.
    # 200 us still polls first, then sleeps: both halves of a wait run.
    monkeypatch.setenv("PARATRAIN_SHM_SPIN_US", "200")


@pytest.fixture(autouse=True)
def fresh_signal_configuration():
    """A program's signal configuration outlives its sessions (GT's rule); tests are separate
    programs, so each starts with none."""
    import paratrain.frontend as gt

    yield
    configuration = gt.get_config()
    configuration.on_change, on_change = None, configuration.on_change  # no session to tell
    try:
        configuration.clear()
    finally:
        configuration.on_change = on_change


@pytest.fixture(scope="session")
def server():
    """One frontend dispatcher with one worker for the API and error tests (a client that stops
    sending heartbeats is dropped after 5 s, five of its heartbeats: a loaded CI host may hold a
    test's heartbeat thread back a second; one message may carry at most 1 MiB)."""
    from paratrain.frontend.client.autostart import LocalServer

    srv = LocalServer.start(1, extra_args=("--client-timeout", "5", "--max-message-mb", "1"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def four_workers(tmp_path_factory):
    """One dispatcher with four workers and an instruction log, shared by the sharding tests and
    the four-worker training test (a start costs seconds, and each worker's first optimizer step
    seconds more)."""
    from paratrain.frontend.client.autostart import LocalServer

    log = tmp_path_factory.mktemp("four-workers") / "instructions.log"
    srv = LocalServer.start(4, extra_args=("--instruction-log", str(log)))
    srv.log = log
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """Two workers behind a token, for the tests of what peers send (each module that uses it
    starts its own); `.said`: the file of what the dispatcher says."""
    from frontend_helpers import TOKEN, serve_saying

    said = tmp_path_factory.mktemp("token-server") / "serve.err"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PARATRAIN_TIMEOUT", "20")  # a worker left waiting on a broken partner gives up soon
        srv = serve_saying(said, "--workers", "2", "--token", TOKEN, "--max-tensor-mb", "16",
                           "--client-timeout", "20", "--threads", "1")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def saying_server(tmp_path_factory):
    """One worker, no token, messages of at most 1 MiB; `.said`: the file of what the dispatcher
    says. Shared by the tests that read what it says of one peer (each looks for its own line)."""
    from frontend_helpers import serve_saying

    srv = serve_saying(tmp_path_factory.mktemp("saying-server") / "serve.err", "--workers", "1",
                       "--max-message-mb", "1")
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    import paratrain.frontend as gt

    session = gt.connect(server.address)
    yield session
    gt.disconnect()
