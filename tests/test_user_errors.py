"""Every error a user can cause is one line naming what and where, and exit code 2: bad flag
values, missing or unwritable paths, corrupted or mismatched checkpoints, malformed records.
The traceback comes only with --debug or PARATRAIN_DEBUG=1; a bug in paratrain keeps its own.

The bad invocations run in this process (a `python -m paratrain` start costs seconds of
imports); three run as a user runs them, to show the entry point does the same."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.cli_errors import OneLineErrors


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """What the bad invocations point at: a good checkpoint (a 2-step MLP run), damaged and
    mismatched uses of it, a file where a folder should be, bad YAML, malformed flight records."""
    root = tmp_path_factory.mktemp("user-errors")
    good = root / "ckpt"
    saved = CliRunner().invoke(main, ["train", "--steps", "2", "--algo", "ring", "--save-dir", str(good)])
    assert saved.exit_code == 0, saved.output
    step = good / "step-000002"
    corrupted = _copy_tree(good, root / "corrupted")
    data = corrupted / "step-000002" / "rank-00001" / "__0_0.distcp"
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # same size, one byte flipped: only the checksum tells
    data.write_bytes(bytes(damaged))
    cut = _copy_tree(good, root / "cut-manifest")
    manifest = cut / "step-000002" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    (root / "a-file").write_text("not a folder\n")
    (root / "bad.yaml").write_text("steps: [1\n")
    (root / "latin1.yaml").write_bytes("name: caf\u00e9\n".encode("latin-1"))  # not UTF-8
    for name, text in [("records-cut", '{"rank": 0, "calls": ['), ("records-wrong", '{"rank": 0, "capacity": 64, "error": null, "calls": [{"seq": 1}]}'),
                       ("records-empty", None)]:
        (root / name).mkdir()
        if text is not None:
            (root / name / "rank0.json").write_text(text)
    return {"ckpt": str(good), "step": str(step), "corrupted": str(corrupted), "cut": str(cut),
            "file": str(root / "a-file"), "bad_yaml": str(root / "bad.yaml"), "latin1": str(root / "latin1.yaml"), "missing": str(root / "missing"),
            **{name: str(root / name) for name in ("records-cut", "records-wrong", "records-empty")}}


def _copy_tree(source: Path, target: Path) -> Path:
    for path in source.rglob("*"):
        if path.is_file():
            (target / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (target / path.relative_to(source)).write_bytes(path.read_bytes())
    return target


# (arguments, what the line must say); {name} is a path from `files`
BAD_INVOCATIONS = [
    (["train", "--resume"], "--resume without a path needs --save-dir"),
    (["train", "--save-dir", "{file}/ckpt"], "cannot write {file}/ckpt: {file} is not a directory"),
    (["train", "--resume", "{corrupted}", "--steps", "4"], "is corrupted (its crc32 differs"),
    (["train", "--resume", "{cut}", "--steps", "4"], "manifest.json cannot be read"),
    (["train", "--resume", "{ckpt}", "--model", "mlp16"], "was saved with model.name = 'mlp', this run has 'mlp16'"),
    (["train", "--resume", "{ckpt}", "--steps", "2"], "is at step 2; --steps 2 leaves nothing to train"),
    (["train", "--lr", "nan"], "optim.lr must be a finite number > 0, got nan"),
    (["train", "--lr", "inf"], "optim.lr must be a finite number > 0, got inf"),
    (["train", "--momentum", "nan"], "optim.momentum must be in [0, 1), got nan"),
    (["train", "--weight-decay", "inf"], "optim.weight_decay must be a finite number >= 0, got inf"),
    (["train", "--nproc", "two"], "Invalid value for '--nproc': 'two' is not a valid integer"),
    (["train", "--config", "{missing}.yaml"], "cannot read config {missing}.yaml"),
    (["train", "--config", "{bad_yaml}"], "{bad_yaml} is not valid YAML at line 2, column 1"),
    (["train", "--config", "{latin1}"], "config {latin1} is not UTF-8 text (byte 9 is 0xe9)"),
    (["plan", "--hardware", "{latin1}"], "hardware profile {latin1} is not UTF-8 text"),
    (["train", "--metrics-out", "{file}/metrics.json"], "cannot write {file}/metrics.json"),
    (["train", "--launcher", "mpi"], "parallel.launcher: unknown value 'mpi'"),
    (["check", "--loss-rtol", "nan"], "Invalid value for '--loss-rtol': 'nan' is not a finite number"),
    (["check", "--timeout", "inf"], "parallel.timeout must be a finite number of seconds > 0, got inf"),
    (["bench", "collectives", "--json", "{file}/out.json"], "Invalid value for '--json': cannot write"),
    (["bench", "p2p", "--timeout", "nan"], "'nan' is not a finite number"),
    (["bench", "ddp", "--bucket-mb", "inf"], "'inf' is not a finite number"),
    (["bench", "pipeline", "--nproc", "1"], "a pipeline needs at least 2 stages"),
    (["plan", "--hardware", "{missing}.yaml"], "cannot read hardware profile {missing}.yaml"),
    (["plan", "--hardware", "{bad_yaml}"], "{bad_yaml} is not valid YAML"),
    (["plan", "--pp", "2", "--schedule", "bogus"], "this layout cannot run: unknown schedule 'bogus'"),
    (["serve", "--port", "99999"], "99999 is not in the range 0<=x<=65535"),
    (["serve", "--client-timeout", "nan"], "'nan' is not a finite number"),
    (["serve", "--instruction-log", "{file}/log"], "cannot write {file}/log"),
    (["serve", "--host", "0.0.0.0", "--token", "       "], "its token must hold at least 16 characters other than"),
    (["serve", "--host", "0.0.0.0", "--token", "short-token"], "its token must hold at least 16 characters other than"),
    (["schedule", "--microbatches", "1000000"], "'--microbatches': 1000000 is not in the range 1<=x<=1024"),
    (["schedule", "--stages", "64", "--microbatches", "1024"], "stages x virtual stages x microbatches is 65,536"),
    (["worker", "--connect-timeout", "nan"], "'nan' is not a finite number"),
    (["worker", "--port", "-1"], "-1 is not in the range 0<=x<=65535"),
    (["sample", "--checkpoint", "{missing}"], "{missing} is not a checkpoint"),
    (["sample", "--checkpoint", "{ckpt}"], "sampling needs a language model (a vocab_size and a block_size), got MLP"),
    (["sample", "--checkpoint", "{ckpt}", "--temperature", "nan"], "'nan' is not a finite number"),
    (["debug", "hang", "{missing}"], "Directory '{missing}' does not exist"),
    (["debug", "hang", "{records-empty}"], "no flight records (rank<N>.json)"),
    (["debug", "hang", "{records-cut}"], "rank0.json cannot be read as a flight record"),
    (["debug", "hang", "{records-wrong}"], "rank0.json is not a flight record: calls[0].group is missing"),
]


def test_each_bad_invocation_prints_one_line_naming_what_and_where(files):
    assert len(BAD_INVOCATIONS) >= 25
    assert {args[0] for args, _ in BAD_INVOCATIONS} >= {
        "train", "check", "bench", "plan", "serve", "worker", "sample", "debug"}
    failures = []
    for args, expected in BAD_INVOCATIONS:
        args = [arg.format(**files) for arg in args]
        result = CliRunner().invoke(main, args)
        lines = result.output.splitlines()
        command = " ".join(["paratrain", *args[:2 if args[0] in ("bench", "debug") else 1]])
        said = [line for line in lines if line.startswith(f"{command}: error: ")]
        if not (result.exit_code == 2 and isinstance(result.exception, SystemExit) and len(lines) <= 2
                and "Traceback" not in result.output and len(said) == 1 and expected.format(**files) in said[0]):
            failures.append(f"paratrain {' '.join(args)} -> exit {result.exit_code}, {result.exception!r}:\n"
                            + result.output)
    assert not failures, "\n".join(failures)


def test_as_a_user_runs_it_one_line_and_with_debug_the_traceback_too(files):
    """`python -m paratrain` as typed; PARATRAIN_DEBUG=1 and --debug add the traceback."""
    command = [sys.executable, "-m", "paratrain", "train", "--resume"]
    runs = {"plain": subprocess.Popen(command, **_pipes()),
            "env": subprocess.Popen(command, **_pipes(PARATRAIN_DEBUG="1"))}
    flag = CliRunner().invoke(main, ["--debug", "plan", "--hardware", files["missing"] + ".yaml"])
    done = {name: (run.communicate(timeout=120)[0], run.returncode) for name, run in runs.items()}
    done["flag"] = (flag.output, flag.exit_code)
    output, code = done["plain"]
    assert code == 2 and output.splitlines() == [
        "paratrain train: error: checkpoint.resume: --resume without a path needs --save-dir to look in"], output
    for name, line in (("env", "paratrain train: error: checkpoint.resume: --resume without a path"),
                       ("flag", "paratrain plan: error: cannot read hardware profile")):
        output, code = done[name]
        assert code == 2 and "Traceback (most recent call last):" in output, output
        assert output.splitlines()[-1].startswith(line), output


def _pipes(**env) -> dict:
    return {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "env": {**os.environ, **env}}


class _Program(OneLineErrors, click.Group):
    pass


@click.group(cls=_Program, name="program")
def program():
    """A program with a bug."""


@program.command()
def lookup():
    json.loads("{}")["missing"]  # a KeyError: paratrain's mistake, not the user's


def test_a_bug_keeps_its_traceback_and_is_not_made_a_user_error():
    result = CliRunner().invoke(program, ["lookup"])
    assert isinstance(result.exception, KeyError)  # escapes as itself: Python prints its traceback
    assert "error:" not in result.output


def test_a_command_group_given_no_command_still_shows_its_help():
    result = CliRunner().invoke(main, ["bench"])
    assert result.output.startswith("Usage: paratrain bench [OPTIONS] COMMAND [ARGS]...") and "error:" not in result.output
