"""The front door and the pages behind it: a short README whose links lead somewhere, a layout
page that names every module, and a results page rendered from benchmark JSON (here a small
fixture: no benchmark runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from paratrain.bench.results_page import RUN_FILE, SWEEPS, command_line, render

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_readme_is_a_front_door_of_at_most_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_relative_links_in_the_readme_and_docs_resolve_to_files_and_headings():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_layout_page_names_every_module_of_the_package():
    layout = (ROOT / "docs" / "layout.md").read_text()
    missing = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "paratrain").rglob("*.py"))
               if path.name != "__init__.py" and path.name not in layout]
    assert not missing, f"docs/layout.md does not name: {', '.join(missing)}"


def _fixture(folder: Path) -> None:
    """One small record file per benchmark, as each `paratrain bench ... --json` writes them."""
    collective = {"launcher": "processes", "transport": "shm", "world_size": 2, "count": 4096,
                  "dtype": "float32", "wrong": 0}
    records = {
        "collectives-2": [
            {**collective, "op": "all_reduce", "algo": "ring", "bytes": 16384, "time_us": 241.2,
             "algbw_gbps": 0.068, "busbw_gbps": 0.068},
            {**collective, "op": "all_reduce", "algo": "native", "bytes": 16384, "time_us": 500.0,
             "algbw_gbps": 0.033, "busbw_gbps": 0.033},
            {**collective, "op": "all_reduce", "algo": "auto(direct)", "bytes": 16384, "time_us": 250.0,
             "algbw_gbps": 0.066, "busbw_gbps": 0.066},
            {**collective, "op": "barrier", "algo": "native", "bytes": 0, "time_us": 90.0,
             "algbw_gbps": None, "busbw_gbps": None},
        ],
        "collectives-mpi-2": [
            {**collective, "op": "all_reduce", "algo": "auto(oneshot)", "bytes": 16384, "time_us": 12.0,
             "algbw_gbps": 1.37, "busbw_gbps": 1.37},
            {**collective, "op": "all_reduce", "algo": "mpi", "bytes": 16384, "time_us": 6.05,
             "algbw_gbps": 2.73, "busbw_gbps": 2.73},
        ],
        "p2p-shm": [
            {"test": "uni", "src": 0, "dst": 1, "bytes": 8, "time_us": 36.0, "gbps": 0.0002, "latency_us": 18.0,
             "launcher": "processes", "transport": "gloo (shared memory)", "world_size": 2},
            {"test": "uni", "src": 1, "dst": 0, "bytes": 8, "time_us": 40.0, "gbps": 0.0002, "latency_us": 20.0,
             "launcher": "processes", "transport": "gloo (shared memory)", "world_size": 2},
            {"test": "bi", "src": 0, "dst": 1, "bytes": 8, "time_us": 35.0, "gbps": 0.0005,
             "launcher": "processes", "transport": "gloo (shared memory)", "world_size": 2},
        ],
        "ddp": [{"model": "mlp16", "params": 16793600, "mode": "ddp", "world_size": 2, "launcher": "processes",
                 "batch_per_rank": 64, "steps": 10, "repeats": 2, "step_ms": 171.5, "step_ms_stdev": 3.0,
                 "ratio_to_torch": 0.79, "comm_ms": 60.0, "exposed_comm_ms": 12.0, "comm_share": 0.35}],
        "sharding-2": [{"model": "gpt-small", "params": 1725696, "mode": "fsdp", "world_size": 2,
                        "launcher": "processes", "batch_per_rank": 64, "steps": 10, "repeats": 2, "step_ms": 720.4,
                        "step_ms_stdev": 26.7, "ratio_to_torch": 0.91, "ratio_to_ddp": 1.03, "comm_ms": 176.4,
                        "exposed_comm_ms": 14.4, "comm_share": 0.24}],
        "scaling": [{"mode": "weak", "model": "mlp", "dp_mode": "ddp", "launcher": "processes", "world_size": 2,
                     "batch_per_rank": 1024, "global_batch": 2048, "iter_ms": 5.0, "iter_ms_stdev": 0.5,
                     "samples_per_s": 409600.0, "speedup": 1.1, "efficiency": 0.55, "cpu_count": 2}],
        "pipeline": [{"impl": "paratrain", "schedule": "1f1b", "stages": 2, "microbatches": 8, "step_ms": 230.0,
                      "bubble_measured": 0.153, "bubble_simulated": 0.14, "bubble_theoretical": 0.111,
                      "bubble_theoretical_costs": 0.111, "ratio_to_torch": 0.95}],
        "tp": [{"model": "gpt-tiny", "tp": 2, "global_batch": 16, "steps": 12, "warmup": 2, "rounds": 3,
                "ours_ms": 13.7, "torch_ms": 43.1, "ratio": 0.318, "max_loss_diff": 0.0}],
        "frontend": [{"batch": 256, "hidden": 1024, "workers": 1, "frontend_ms": 10.64, "torch_ms": 8.22,
                      "ratio": 1.294, "streamed_instruction_us": 18.0, "round_trip_ms": 0.17}],
        "cp": {"rows": [{"cp": 1, "seq": 1024, "method": "ring", "layout": "contiguous", "step_ms": 100.0,
                         "exposed_ms": 0.0},
                        {"cp": 4, "seq": 1024, "method": "ring", "layout": "zigzag", "step_ms": 40.0, "exposed_ms": 4.0}],
               "torch_context_parallel": "NotImplementedError: no sharding strategy",
               "args": {"seqs": [1024], "batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 64, "steps": 3}},
    }
    for name, rows in records.items():
        (folder / f"{name}.json").write_text(json.dumps(rows))
    statuses = {"collectives-4": 1}  # a sweep that failed; collectives-threads ran but wrote nothing
    run = {
        "machine": {"date": "2030-01-02 03:04 UTC", "cpu": "Test CPU 9000", "cores": 2, "platform": "Linux",
                    "python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "copy_gbps": 19.0,
                    "commit": "abc1234"},
        "load_before": 0.5, "load_after": 1.5, "seconds": 300.0,
        "sweeps": [{"name": s.name, "command": command_line(s, Path("docs/results")), "seconds": 10.0,
                    "status": statuses.get(s.name, 0)} for s in SWEEPS],
    }
    (folder / RUN_FILE).write_text(json.dumps(run))


def test_results_page_is_rendered_from_the_benchmarks_json(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    _fixture(folder)
    page = render(folder, tmp_path / "results.md")

    assert "2030-01-02 03:04 UTC" in page and "commit abc1234" in page
    assert "Test CPU 9000, 2 cores" in page and "torch 2.13.0+cpu" in page
    for sweep in SWEEPS:  # every command, exactly as run, with its title
        assert command_line(sweep, Path("docs/results")) in page and f"## {sweep.title}" in page
    assert "PARATRAIN_SHM=0 paratrain bench p2p" in page

    # the tables carry the records' numbers
    assert "| 16K | 241 (0.07) | 500 (0.03) | 250 (0.07) | direct | 2.00x |" in page
    assert "| 16K | 12 (1.37) | 6.05 (2.73) | oneshot | 1.98x |" in page and "*auto / MPI* = our time" in page
    assert "| - | - | 90 | - | - |" not in page and "| - | 90 |" in page  # a barrier: time only
    assert "| 8 | 40.0 | 0.000 | 0.001 | - |" in page and "Latency (half the round at 8 B): 20.0 us" in page
    assert "| mlp16 | 16,793,600 | ddp | 171.5 ± 3.00 | 0.79x | - | 60.0 | 12.0 | 35% |" in page
    assert "| gpt-small | 1,725,696 | fsdp | 720.4 ± 26.7 | 0.91x | 1.03x | 176.4 | 14.4 | 24% |" in page
    assert "| weak | 2 | 1024 | 2048 | 5.00 ± 0.50 | 409,600 | 1.10 | 0.55 |" in page
    assert "| paratrain | 1f1b | 230.0 | 0.95x | 15.3% | 14.0% | 11.1% | 11.1% |" in page
    assert "| 2 | 13.7 | 43.1 | 0.32x | 0.0e+00 |" in page
    assert "| 256 x 1024 | 12.4 |" not in page and "| 256 x 1024 | 10.6 | 8.22 | 1.29x |" in page
    assert "| 4 | 1024 | ring | zigzag | 40.0 | 4.00 | 10% | 0.40 |" in page
    assert "at cp 4: zigzag 1.00, contiguous 1.75" in page and "NotImplementedError: no sharding strategy" in page

    # links to each JSON relative to the page; failures said, not hidden
    assert "[ddp.json](results/ddp.json)" in page
    assert "Failed (exit status: 1)" in page and "It wrote no collectives-threads.json." in page


def test_results_run_records_each_command_and_renders_what_it_wrote(tmp_path, monkeypatch):
    from paratrain.bench.results_page import Sweep, run_sweeps

    monkeypatch.chdir(ROOT)  # the commands run from the repository root, as `make results` runs them
    tiny = Sweep("tiny", "collectives", "A tiny sweep",
                 ("--launcher", "threads", "--ops", "all_reduce", "--algos", "ring,native",
                  "--min-bytes", "1K", "--max-bytes", "1K", "--warmup", "0", "--iters", "1"))
    run = run_sweeps(tmp_path, sweeps=(tiny,))
    assert [entry["status"] for entry in run["sweeps"]] == [0]
    assert run["sweeps"][0]["command"] == command_line(tiny, tmp_path)
    page = render(tmp_path, tmp_path / "results.md", sweeps=(tiny,))
    assert "transport fabric" in page and "| 1K |" in page and "Wrong elements: 0." in page


def test_every_data_parallel_strategy_the_pages_name_is_one_dp_mode_accepts():
    from paratrain.parallel.data.strategy import STRATEGIES, resolve_strategy

    named = {name for page in PAGES for name in re.findall(r"--dp-mode ([a-z0-9-]+)", page.read_text())}
    for name in named:
        resolve_strategy(name)  # raises StrategyError for a name --dp-mode refuses
    table = (ROOT / "docs" / "training.md").read_text()
    assert all(f"| `{name}`" in table for name in STRATEGIES), "training.md's strategy table lists every strategy"


def test_the_readmes_group_example_runs_under_torchrun_as_it_says(tmp_path):
    """"The same script runs under `torchrun --nproc-per-node 4 step.py`": the script calls
    `run` twice, and the second call used to make a second process group in torchrun's store,
    where gloo waited minutes on the first one's addresses. Each rank prints its own result,
    once per call."""
    import os
    import signal
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    script = re.search(r"### 1\. The communication library.*?```python\n(.*?)```", readme, re.S).group(1)
    assert "torchrun --nproc-per-node 4 step.py" in readme
    (tmp_path / "step.py").write_text(script)
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.Popen([str(torchrun), "--nproc-per-node", "4", "step.py"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True)
    try:
        stdout, stderr = run.communicate(timeout=90)
    finally:
        if run.poll() is None:  # it hung: no rank is left waiting on the rest
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 0, stderr[-3000:]
    printed = sorted(re.findall(r"\{\d+: \([^)]*\)\}", stdout))  # ranks share the pipe: lines may run together
    assert printed == sorted(f"{{{rank}: (10.0, 1000.0)}}" for rank in range(4) for _ in range(2)), stdout
