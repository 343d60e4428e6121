"""Settings in one place (paratrain/environment.py): resolved from defaults, the environment and
flags with their source; no other module reads the environment; `paratrain env` shows them; the
cached algorithm table is used only where it was measured; one entry adds a training flag."""

from __future__ import annotations

import copy
import re
import socket
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import paratrain
from paratrain.cli import main
from paratrain.comm import choice
from paratrain.comm.choice import AlgorithmTable
from paratrain.environment import SPECS, LaunchEnvironment, Settings, SettingsError
from paratrain.train import options
from paratrain.train.config import TrainConfig, apply_overrides

PACKAGE = Path(paratrain.__file__).parent
SETTINGS_MODULE = PACKAGE / "environment.py"  # also hands the environment to the processes we start


def test_no_module_but_the_settings_reads_the_environment():
    """grep for os.environ / os.getenv: the settings module only (children get theirs from its
    `child_environment`)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == SETTINGS_MODULE:
            continue
        where = path.relative_to(PACKAGE).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bos\.(environ|getenv)\b|\bgetenv\(|\bfrom os import\b.*\benviron\b", line):
                found.append(f"{where}:{number}: {line.strip()}")
    assert found == []


def test_settings_come_from_defaults_the_environment_and_flags_and_say_so():
    settings = Settings.resolve({"PARATRAIN_TIMEOUT": "12", "GT_BACKEND": "cpu", "PARATRAIN_SHM": "off",
                                 "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (settings.timeout, settings.backend, settings.shm, settings.debug) == (12.0, "cpu", False, False)
    assert settings.source("timeout") == "environment (PARATRAIN_TIMEOUT)"
    assert settings.source("backend") == "environment (GT_BACKEND)"
    assert settings.source("debug") == "default"
    assert settings.launch == LaunchEnvironment(rank=3, world_size=4, master_addr="h", master_port=1)
    assert settings.launch.in_torchrun
    flagged = settings.with_flags(timeout=5.0, debug=None)
    assert flagged.timeout == 5.0 and flagged.source("timeout") == "flag" and flagged.source("debug") == "default"
    assert Settings.resolve({"PARATRAIN_BACKEND": "cuda", "GT_BACKEND": "cpu"}).backend == "cuda"  # ours wins
    assert Settings.resolve({"PARATRAIN_TIMEOUT": ""}).timeout == Settings.timeout  # empty: unset
    assert not Settings.resolve({}).launch.in_torchrun
    with pytest.raises(SettingsError, match="PARATRAIN_TIMEOUT must be positive and finite, got 'inf'"):
        Settings.resolve({"PARATRAIN_TIMEOUT": "inf"})
    with pytest.raises(TypeError, match="no such setting: colour"):
        settings.with_flags(colour="red")


def test_the_shared_memory_folder_must_be_one_this_user_may_write_in(tmp_path):
    assert Settings.resolve({}).shm_dir == "/dev/shm"
    assert Settings.resolve({"PARATRAIN_SHM_DIR": f"{tmp_path}/./"}).shm_dir == str(tmp_path)
    with pytest.raises(SettingsError, match="PARATRAIN_SHM_DIR must be a folder, got '/no/such' .no such folder."):
        Settings.resolve({"PARATRAIN_SHM_DIR": "/no/such"})
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SettingsError, match="PARATRAIN_SHM_DIR must be a folder"):
        Settings.resolve({"PARATRAIN_SHM_DIR": str(tmp_path / "a-file")})


def test_a_hosts_name_is_paratrain_host_else_the_machines():
    """One place for the name the shared-memory set-up and a frontend worker give their host."""
    assert Settings.resolve({"PARATRAIN_HOST": "node1"}).host_name == "node1"
    assert Settings.resolve({}).host_name == socket.gethostname()


def test_a_group_takes_its_settings_from_the_launcher(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "42")
    seen = paratrain.run(lambda group: (group.timeout, group.settings.source("timeout")), 2)
    assert seen == {0: (42.0, "environment (PARATRAIN_TIMEOUT)"), 1: (42.0, "environment (PARATRAIN_TIMEOUT)")}
    given = Settings.resolve({}).with_flags(timeout=9.0)
    assert paratrain.run(lambda group: group.timeout, 2, settings=given) == {0: 9.0, 1: 9.0}


def test_paratrain_env_prints_every_setting_its_value_and_source(tmp_path):
    table = tmp_path / "mine.json"
    result = CliRunner().invoke(main, ["env", "--nproc", "4"], env={
        "PARATRAIN_TIMEOUT": "30", "PARATRAIN_ALGO_TABLE": str(table), "PARATRAIN_TOKEN": "s3cret"})
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines() if line.startswith("  ")}
    for spec in SPECS:
        assert spec.name in rows, spec.name
    assert rows["timeout"][1:4] == ["30.0", "environment", "(PARATRAIN_TIMEOUT)"]
    assert rows["debug"][1:3] == ["False", "default"]
    assert rows["token"][1] == "(set)" and "s3cret" not in result.output
    assert f"path     {table}" in result.output
    assert "world 4: none there: the defaults" in result.output
    assert re.search(r"--launcher processes\s+(shm|gloo)", result.output)
    assert re.search(r"--launcher threads\s+fabric", result.output)
    refused = CliRunner().invoke(main, ["env"], env={"PARATRAIN_SHM_BYTES": "many"})
    assert refused.exit_code == 2 and "PARATRAIN_SHM_BYTES must be a whole number, got 'many'" in refused.output


def test_paratrain_env_says_whether_the_native_kernels_are_built(tmp_path):
    built = CliRunner().invoke(main, ["env"], env={"XDG_CACHE_HOME": str(tmp_path)})
    assert f"shared segment: native kernels: {tmp_path}/paratrain/native/arena_kernels-" in built.output
    failed = CliRunner().invoke(main, ["env"], env={"XDG_CACHE_HOME": str(tmp_path / "other"), "CC": "false"})
    assert "shared segment: native kernels not built: false failed (exit code 1)" in failed.output
    off = CliRunner().invoke(main, ["env"], env={"PARATRAIN_NATIVE": "0"})
    assert off.exit_code == 0 and "shared segment: torch's ops (native kernels off: PARATRAIN_NATIVE)" in off.output


def _cached_table(tmp_path, host: str, world: int) -> Path:
    path = tmp_path / "cache" / "paratrain" / "algorithms.json"
    table = AlgorithmTable(path=path)
    table.record("fabric", world, "all_reduce", 4096, "direct")
    table.save()
    text = path.read_text().replace(f'"host": "{choice.this_host()}"', f'"host": "{host}"')
    path.write_text(text)
    return path


def test_the_cached_table_is_used_only_on_its_host_for_its_world(tmp_path):
    path = _cached_table(tmp_path, "elsewhere", 2)
    elsewhere = AlgorithmTable.in_use(path, named=False, world_size=2)
    assert not elsewhere.measured and "written on elsewhere" in elsewhere.status
    assert AlgorithmTable.in_use(path, named=True, world_size=3).measured  # named: used as it is

    path = _cached_table(tmp_path, choice.this_host(), 2)
    assert AlgorithmTable.in_use(path, named=False, world_size=2).status == (
        "in use (written on this host for world size 2)")
    other_world = AlgorithmTable.in_use(path, named=False, world_size=4)
    assert not other_world.measured and "measured for world size 2, not 4" in other_world.status


def _auto_pick(group):
    return group.resolve("all_reduce", "auto", 4096), group.table.status


def test_auto_and_explain_follow_the_cached_table_only_where_it_was_measured(tmp_path, monkeypatch):
    monkeypatch.delenv("PARATRAIN_ALGO_TABLE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    default = choice.default_choice("all_reduce", 4096, 2, "fabric").algo
    assert default != "direct"
    _cached_table(tmp_path, "elsewhere", 2)
    assert paratrain.run(_auto_pick, 2)[0][0] == default
    explain = ["bench", "collectives", "--explain", "--launcher", "threads", "--ops", "all_reduce",
               "--min-bytes", "4K", "--max-bytes", "4K"]
    said = CliRunner().invoke(main, explain).output
    assert "not in use, the defaults: written on elsewhere" in said
    assert re.search(rf"all_reduce\s+4096\s+{default}\s", said), said

    _cached_table(tmp_path, choice.this_host(), 2)
    assert paratrain.run(_auto_pick, 2)[0] == ("direct", "in use (written on this host for world size 2)")
    said = CliRunner().invoke(main, explain).output
    assert "in use (written on this host for world size 2)" in said
    assert re.search(r"all_reduce\s+4096\s+direct\s", said), said


def test_world_size_of_reads_the_config_and_leaves_it_as_it_was():
    config = apply_overrides(TrainConfig(), {"parallel.pp": 2, "parallel.tp": 2})
    before = copy.deepcopy(config)
    assert options.world_size_of(config, LaunchEnvironment()) == 4
    assert options.world_size_of(config, LaunchEnvironment(run_id="r", world_size=8)) == 8
    assert config == before


def test_every_training_flag_is_one_entry_naming_its_config_key():
    """A flag is added by one Flag(...) line: its key is a real config key, and the commands
    take it under the name build_config reads."""
    train_params = {param.name for param in main.get_command(None, "train").params}
    config = TrainConfig()
    for flag in options.TRAINING_FLAGS + options.CHECKPOINT_FLAGS:
        assert flag.dest in train_params, flag.dest
        if flag.key is None:
            continue
        section, _, key = flag.key.rpartition(".")
        holder = getattr(config, section) if section else config
        assert hasattr(holder, key) or section == "model", flag.key  # model options may be the model's own
    built = options.build_config(None, {"lr": 0.5, "stage_layers": "1,2", "channels": ["8", "16"], "steps": None})
    assert (built.optim.lr, built.parallel.stage_layers, built.model.overrides["channels"], built.steps) == (
        0.5, [1, 2], [8, 16], TrainConfig().steps)
    with pytest.raises(Exception, match="--stage-layers takes comma-separated integers, got 1,x"):
        options.build_config(None, {"stage_layers": "1,x"})
    assert isinstance(options.TRAINING_FLAGS[0].option(), type(click.option("--x")))


def test_under_torchrun_the_banner_names_the_process_groups_transport_not_the_launchers_default():
    """`paratrain train` under torchrun once printed `transport fabric`: --launcher's default
    (threads), though its ranks are torchrun's processes talking through a process group."""
    import dataclasses

    from paratrain.launch import expected_transport
    from paratrain.environment import LaunchEnvironment, Settings

    torchrun = LaunchEnvironment(rank=0, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                                 master_port=29500, run_id="none")
    settings = dataclasses.replace(Settings(), launch=torchrun)
    assert expected_transport("threads", 2, settings) in ("shm", "gloo", "nccl")
    assert expected_transport("threads", 2, Settings()) == "fabric"
