"""Run GT's own public-API tests twice, on GT and on paratrain (through this `gt` alias).

    python compat/gt_tests.py --gt /path/to/gt2            # a checkout of github.com/bwasti/gt2
    python compat/gt_tests.py --gt /path/to/gt2 --files test_basic_ops.py test_nn.py

It exits 1 when a test that passes on GT does not pass on paratrain.

A test file counts as public-API when it imports only GT's public modules (`gt`, `gt.client`,
`gt.client.tensor`, `gt.client.nn`, `gt.nn`, `gt.config`, `gt.debug`) and touches no private
module global (`gt._client`); files that build GT's dispatcher, workers or client objects, or
reset GT's globals to reach its own test fixture's port, test GT's internals and are listed as
skipped.
Each file runs in its own pytest process on each side. On GT's side its own conftest starts
its dispatcher and worker; on ours a small conftest (written to a temporary copy of the
folder) gives the same fixture names over the program's default session, which starts
itself. The table lists every test that fails on either side.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PUBLIC = {"gt", "gt.client", "gt.client.tensor", "gt.client.nn", "gt.nn", "gt.config", "gt.debug"}
ALIAS = Path(__file__).resolve().parent  # holds the `gt` package
RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")

# GT's fixtures, over paratrain's default session: the first operation starts a server.
OUR_CONFTEST = '''
import pytest
import gt


@pytest.fixture(scope="session")
def gt_system():
    yield
    gt.disconnect()


@pytest.fixture
def client(gt_system):
    yield None


@pytest.fixture(scope="session")
def gt_system_4workers():
    gt.gpu_workers(4)
    yield
    gt.disconnect()


@pytest.fixture
def client_4workers(gt_system_4workers):
    yield None


def pytest_addoption(parser):
    parser.addoption("--backend", action="store", default="gt")


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", ["gt"])
'''


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in PUBLIC)
    return {name for name in names if name == "gt" or name.startswith("gt.")}


def private_names(path: Path) -> set[str]:
    """`gt._name`s a file reaches for (GT's module globals, e.g. `gt._client`)."""
    tree = ast.parse(path.read_text())
    return {f"gt.{node.attr}" for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "gt" and node.attr.startswith("_")}


def is_public(path: Path) -> bool:
    return imported_modules(path) <= PUBLIC and not private_names(path)


def run_file(folder: Path, name: str, pythonpath: str, timeout: float, **extra_env: str) -> dict[str, str]:
    """{test id: outcome} for one file (a file that cannot run at all gives one ERROR row)."""
    env = {**os.environ, "PYTHONPATH": pythonpath, **extra_env}
    env.pop("PARATRAIN_SERVER", None)
    command = [sys.executable, "-m", "pytest", name, "-v", "-p", "no:cacheprovider", "-o", "addopts=",
               "--timeout", str(int(timeout)), "-rN"]
    try:
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout * 4)
        output = done.stdout
    except subprocess.TimeoutExpired as error:
        output = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
    outcomes = {}
    for line in output.splitlines():
        found = RESULT.match(line.strip())
        if found:
            outcomes[found.group(1).split("tests/")[-1]] = found.group(2)
    return outcomes or {f"{name}::(file)": "ERROR"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gt", required=True, type=Path, help="a checkout of GT (github.com/bwasti/gt2)")
    parser.add_argument("--files", nargs="*", help="only these test files (names in GT's tests/)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per test")
    args = parser.parse_args()
    tests = args.gt / "tests"
    if not tests.is_dir():
        parser.error(f"{tests} is not a folder: --gt names a checkout of GT")
    files = sorted(p.name for p in tests.glob("test_*.py"))
    if args.files:
        files = [name for name in files if name in args.files]
    public = [name for name in files if is_public(tests / name)]
    internal = [name for name in files if name not in public]
    with tempfile.TemporaryDirectory(prefix="gt-tests-") as scratch:
        ours = Path(scratch) / "checkout"
        shutil.copytree(args.gt, ours, ignore=shutil.ignore_patterns("gt", ".git"))
        (ours / "tests" / "conftest.py").write_text(OUR_CONFTEST)
        rows = []
        for name in public:
            theirs = run_file(args.gt, f"tests/{name}", str(args.gt), args.timeout)
            # GT's fixture serves its tests from a worker with the NumPy backend: so do ours.
            mine = run_file(ours, f"tests/{name}", str(ALIAS), args.timeout, GT_BACKEND="numpy")
            rows.append((name, theirs, mine))
            print(f"{name:40s} GT {_count(theirs):>7s}   paratrain {_count(mine):>7s}", flush=True)
    print(f"\nskipped (they use GT's internals): {', '.join(internal) or 'none'}")
    for name in internal:
        reasons = sorted((imported_modules(tests / name) - PUBLIC) | private_names(tests / name))
        print(f"  {name}: {', '.join(reasons)}")
    total_gt = sum(_passed(theirs) for _, theirs, _ in rows)
    total_ours = sum(_passed(mine) for _, _, mine in rows)
    count = sum(max(len(theirs), len(mine)) for _, theirs, mine in rows)
    print(f"passed: GT {total_gt}, paratrain {total_ours}, of {count} tests in {len(rows)} files\n")
    print("tests that do not pass on both sides:")
    for name, theirs, mine in rows:
        for test in sorted(set(theirs) | set(mine)):
            a, b = theirs.get(test, "absent"), mine.get(test, "absent")
            if not (a == b == "PASSED"):
                print(f"  {test:70s} GT {a:8s} paratrain {b}")
    return exit_status(rows)


def exit_status(rows: list) -> int:
    """1 when a test that passes on GT does not pass here (a regression of ours), else 0. A
    test failing on GT too says nothing of us."""
    return int(any(theirs.get(test) == "PASSED" and mine.get(test) != "PASSED"
                   for _, theirs, mine in rows for test in theirs))


def _passed(outcomes: dict) -> int:
    return sum(outcome == "PASSED" for outcome in outcomes.values())


def _count(outcomes: dict) -> str:
    return f"{_passed(outcomes)}/{len(outcomes)}"


if __name__ == "__main__":
    sys.exit(main())
