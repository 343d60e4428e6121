"""`make docs-check`: blocks read from a page with their annotations, shown output compared with
numbers wildcarded and in order, a block past its time killed with everything it started, and a
small page checked end to end."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from frontend_helpers import wait_until

from paratrain.docs_check.cli import main
from paratrain.docs_check.compare import compare
from paratrain.docs_check.pages import Block, read_page
from paratrain.docs_check.run import run_block
from paratrain.lifetime import process_alive

PAGE = '''\
# A page

```bash
.venv/bin/paratrain train --model gpt-tiny \\
    --steps 2   # a comment
# a comment line
python - <<'EOF'
print("in a here-document")
EOF
```

<!-- docs-check: file run.yaml -->
```yaml
steps: 3
```

<!-- docs-check: skip: needs two machines -->
<!-- docs-check: timeout 20 -->
```console
$ paratrain plan --model gpt3-175b \\
      --tp 8
layout tp8 pp8
$ paratrain env
setting value
```

<!-- docs-check: in examples -->
```python
print("hello")
```

<!-- docs-check: output -->
```
hello
```

```json
{"not": "run"}
```

<!-- docs-check: console -->
```
$ echo shown
shown
```
'''


def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text))
    return path


def test_blocks_are_read_with_their_commands_annotations_and_shown_output(tmp_path):
    bash, console, python, plain = read_page(page(tmp_path, PAGE))

    assert bash.lang == "bash" and bash.line == 3
    assert [c.text for c in bash.commands] == [
        ".venv/bin/paratrain train --model gpt-tiny \\\n    --steps 2   # a comment",
        "python - <<'EOF'\nprint(\"in a here-document\")\nEOF"]
    assert bash.files == {}

    assert console.skip == "needs two machines" and console.timeout_s == 20
    assert [c.text for c in console.commands] == ["paratrain plan --model gpt3-175b \\\n      --tp 8", "paratrain env"]
    assert [c.shown for c in console.commands] == [["layout tp8 pp8"], ["setting value"]]
    assert console.files == {"run.yaml": "steps: 3\n"}  # the yaml block: written, not run

    assert python.lang == "python" and python.shown == ["hello"] and python.folder == "examples"
    assert plain.lang == "console" and plain.commands[0].shown == ["shown"]  # json: not a block


def test_an_unknown_annotation_is_an_error_not_a_silent_skip(tmp_path):
    path = page(tmp_path, "<!-- docs-check: skpi needs a GPU -->\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match="page.md:2: not a docs-check annotation: 'skpi needs a GPU'"):
        read_page(path)


def test_numbers_match_any_number_and_runs_of_spaces_one_space():
    actual = "step     0  loss 2.30741     71.8 ms\nstep     1  loss 2.30002     27.7 ms\n"
    assert compare(["step 0  loss 2.31 65.0 ms", "step  1 loss 9.9e-01 1 ms"], actual) is None
    assert compare(["step 0 loss 2.30741 71.8 s"], actual) is not None  # words still count
    assert compare(["error -6% +16%", "in .../docs-check-cache-..."], "error +3% -1%\nin /tmp/docs-check-cache-3ab") is None


def test_shown_lines_must_come_in_order_with_any_lines_between():
    actual = "a 1\nnoise\nb 2\nc 3\n"
    assert compare(["a 1", "...", "c 3"], actual) is None
    assert compare(["a 1", "c 3"], actual) is None
    assert compare(["c 3", "a 1"], actual) is not None
    assert compare(["path /tmp/.../rank0.json"], "path /tmp/pt-hang-x1/rank0.json") is None


def test_a_missing_line_is_reported_with_the_nearest_actual_line():
    message = compare(["PASS: same model", "largest loss difference 1e-7"],
                      "PASS: same model\nlargest loss diff 2e-7 (relative)\nend\n")
    assert message.splitlines() == ["shown line not found: largest loss difference 1e-7",
                                    "  nearest actual line: largest loss diff 2e-7 (relative)"]


def test_a_block_past_its_timeout_is_killed_with_its_whole_process_group(tmp_path):
    pid_file = tmp_path / "pid"
    path = page(tmp_path, f"""\
        <!-- docs-check: timeout 2 -->
        ```bash
        sleep 300 &
        echo $! > {pid_file}
        sleep 300
        ```
        """)
    [block] = read_page(path)
    result = run_block(block)

    assert result.status == "FAIL" and "timed out after 2 s in `sleep 300`; killed" in result.why
    wait_until(lambda: not process_alive(int(pid_file.read_text())), 10, "the background sleep to end")


def test_a_skipped_block_is_not_run_and_keeps_its_reason(tmp_path):
    block = Block(tmp_path / "page.md", 1, "bash", "false\n", skip="needs a GPU")
    result = run_block(block)
    assert (result.status, result.why) == ("skipped", "needs a GPU")


def test_a_page_runs_end_to_end_passing_and_failing_blocks(tmp_path, capsys):
    path = page(tmp_path, """\
        <!-- docs-check: file numbers.yaml -->
        ```yaml
        first: 12
        ```

        ```console
        $ cat numbers.yaml
        first: 7
        $ cd paratrain && ls docs_check.py
        docs_check.py
        ```

        ```console
        $ echo "loss 2.5"
        loss 2.5
        accuracy 0.9
        ```

        <!-- docs-check: skip: needs a GPU -->
        ```bash
        nvidia-smi
        ```

        ```bash
        python -c "import sys; print(sys.prefix)"
        exit 3
        ```

        ```console
        $ echo "cache: $XDG_CACHE_HOME"
        cache: .../docs-check-cache-...
        ```

        ```bash
        make -n docs-check   # in the repository root, whatever the page's folder
        ```
        """)
    status = main([str(path)])
    out = capsys.readouterr().out

    assert status == 1
    assert f"{path}:6 PASS" in out  # the saved yaml, the repository's tree, numbers wildcarded
    assert f"{path}:13 FAIL" in out and "shown line not found: accuracy 0.9" in out
    assert "nearest actual line: loss 2.5" in out
    assert f"{path}:20 skipped (needs a GPU)" in out
    assert f"{path}:24 FAIL" in out and "exit status 3 from `exit 3`" in out
    assert f"{path}:29 PASS" in out  # a cache of the run's own: a `--tune` table stays out of ~/.cache
    assert f"{path}:34 PASS" in out
    assert "docs-check: 5 run, 3 passed, 2 failed, 1 skipped" in out
    assert f"skipped {path}:20: needs a GPU" in out
