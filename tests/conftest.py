"""Keep every test independent of the machine it runs on: no tuned algorithm table from the
user's cache (it would change what `algo="auto"` picks), no debug or timeout settings from
the shell. Spawned ranks inherit this environment, so the same holds for launcher="processes".
"""

import pytest


@pytest.fixture(autouse=True)
def hermetic_comm_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PARATRAIN_ALGO_TABLE", str(tmp_path / "no-algorithm-table.json"))
    for name in ("PARATRAIN_DEBUG", "PARATRAIN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
