"""`paratrain plan` shapes given by flags: --heads and --kv-heads over a base model, with and
without grouped-query attention."""

import pytest
from click.testing import CliRunner

from paratrain.cli import main
from paratrain.models import format_count
from paratrain.plan.cli import build_shape
from paratrain.plan.shapes import named_shape

# Korthikanti et al. 2022, Table 5: (published shape, layers, hidden, heads, tp, pp); seq 2048, vocab 51200.
TABLE_5 = [
    pytest.param("gpt-22b", 48, 6144, 64, 8, 1, id="22b"),
    pytest.param("gpt3-175b", 96, 12288, 96, 8, 8, id="175b"),
    pytest.param("mt-nlg-530b", 105, 20480, 128, 8, 35, id="530b"),
    pytest.param("gpt-1t", 128, 25600, 160, 8, 64, id="1t"),
]


def plan_lines(*flags) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["plan", *map(str, flags)])
    return result.exit_code, result.output.splitlines()


@pytest.mark.parametrize("name, layers, hidden, heads, tp, pp", TABLE_5)
def test_table_5_configurations_plan_from_flags_with_one_kv_head_per_head(name, layers, hidden, heads, tp, pp):
    flags = {"layers": layers, "hidden": hidden, "heads": heads, "seq": 2048, "vocab": 51200}
    code, lines = plan_lines(*[f for key, value in flags.items() for f in (f"--{key}", value)],
                             "--gpus", tp * pp, "--tp", tp, "--pp", pp)
    assert code == 0, lines
    shape = build_shape("gpt-small", flags)
    assert shape.kv_heads == heads
    assert shape == named_shape(name)
    assert lines[0].startswith(f"GPT: {format_count(shape.parameters())} parameters")


def test_heads_over_a_grouped_query_base_keep_its_kv_heads_where_they_divide_else_ask_for_them():
    code, lines = plan_lines("--model", "llama-small", "--heads", 16, "--tp", 2)  # llama-small: 8 heads, 2 kv
    assert code == 0, lines
    assert "a=16" in lines[0] and "g=2," in lines[0]
    code, lines = plan_lines("--model", "tinyllama-1.1b", "--heads", 2, "--tp", 2)  # tinyllama: 4 kv heads
    assert code == 2
    assert lines == ["paratrain plan: error: tinyllama-1.1b's 4 key/value heads do not divide --heads 2: "
                     "pass --kv-heads"]


def test_kv_heads_set_the_key_value_heads():
    code, lines = plan_lines("--model", "tinyllama-1.1b", "--heads", 2, "--kv-heads", 2, "--tp", 2)
    assert code == 0, lines
    assert "a=2" in lines[0] and "g=2," in lines[0]
    code, lines = plan_lines("--model", "llama-small", "--kv-heads", 8, "--tp", 8)  # multi-head: tp 8 fits
    assert code == 0, lines
    assert "a=8" in lines[0] and "g=8," in lines[0]


@pytest.mark.parametrize("flags, line", [
    (["--model", "llama-small", "--kv-heads", 3], "heads (8) must be divisible by kv_heads (3)"),
    (["--model", "gpt-small", "--kv-heads", 2],
     "a GPT has as many kv_heads as heads (4), got 2: plan grouped-query attention from a Llama"),
])
def test_kv_heads_that_do_not_fit_are_one_line(flags, line):
    code, lines = plan_lines(*flags, "--tp", 1)
    assert code == 2
    assert lines == [f"paratrain plan: error: {line}"]
