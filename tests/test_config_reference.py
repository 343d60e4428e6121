"""docs/configuration.md is what the flags' table and the dataclasses' defaults say now, and
`paratrain train --print-config` prints a file that runs the same configuration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.environment import Settings
from paratrain.train.cli import train
from paratrain.train.config import ParallelConfig, TrainConfig, load_yaml
from paratrain.train.config_reference import EXAMPLE, PAGE, REGENERATE, render
from paratrain.train.config_reference import main as reference_main
from paratrain.train.options import CHECKPOINT_FLAGS, TRAINING_FLAGS, validated_config

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--model", "gpt-tiny", "--tp", "2", "--nproc", "4", "--optimizer", "adamw", "--lr", "0.003",
         "--n-layer", "3", "--stage-layers", "2,3", "--pp", "2", "--microbatches", "2"]


def config_from(args: list[str]):
    """The TrainConfig `paratrain train ARGS` runs, parsed by the command itself."""
    params = train.make_context("train", list(args)).params
    return validated_config(params.pop("config_path"), params, Settings.resolve())[0]


def test_the_configuration_page_is_rendered_from_the_flags_and_defaults_now():
    assert (ROOT / PAGE).read_text() == render(), f"{PAGE} is out of date: run {REGENERATE}"


def test_check_exits_1_with_one_line_when_the_page_is_stale(tmp_path, capsys):
    page = tmp_path / "configuration.md"
    assert reference_main(["--write", str(page)]) == 0 and reference_main(["--check", str(page)]) == 0
    page.write_text(render().replace("`--lr`", "`--learning-rate`"))
    assert reference_main(["--check", str(page)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"{page} is out of date with the flags and defaults: run python -m paratrain.train.config_reference "
        f"--write {page}"]


def test_the_configuration_page_names_every_flag():
    page = (ROOT / PAGE).read_text()
    missing = [decl for flag in TRAINING_FLAGS + CHECKPOINT_FLAGS for decl in flag.decls
               for name in decl.split("/") if name.startswith("--") and f"`{name}`" not in page]
    assert not missing, f"{PAGE} does not name: {', '.join(missing)}"


def test_the_pages_yaml_example_is_a_valid_configuration(tmp_path):
    (tmp_path / "example.yaml").write_text(EXAMPLE)
    config, world = validated_config(str(tmp_path / "example.yaml"), {}, Settings.resolve())
    assert (config.model.overrides, world) == ({"n_layer": 4}, 4)


def test_print_config_round_trips_through_config(tmp_path):
    printed = CliRunner().invoke(main, ["train", *FLAGS, "--print-config"])
    assert printed.exit_code == 0, printed.output
    assert "parallel:\n  nproc: 4\n" in printed.output
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed.output)
    expected = config_from(FLAGS)
    assert load_yaml(saved) == expected
    assert config_from(["--config", str(saved)]) == expected
    again = CliRunner().invoke(main, ["train", "--config", str(saved), "--print-config"])
    assert again.exit_code == 0 and again.output == printed.output


def test_print_config_resolves_nproc_and_keeps_the_dataclass_order():
    printed = CliRunner().invoke(main, ["train", "--print-config"])
    assert printed.exit_code == 0, printed.output
    raw = yaml.safe_load(printed.output)
    assert list(raw) == [field.name for field in dataclasses.fields(TrainConfig)]
    assert list(raw["parallel"]) == [field.name for field in dataclasses.fields(ParallelConfig)]
    assert raw["parallel"]["nproc"] == 2  # unset, it is the default world: 2 ranks


def test_a_bad_value_with_print_config_is_the_usual_one_line_error():
    result = CliRunner().invoke(main, ["train", "--lr", "-1", "--print-config"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.splitlines() == [
        "paratrain train: error: optim.lr must be a finite number > 0, got -1.0"]
