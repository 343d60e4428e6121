"""The protocol's two checks of an instruction agree (protocol/instructions.py).

Batches hold hundreds of instructions, so the common case goes through a one-pass check that
names no field (`_plainly_valid`); everything else, and every refusal, goes through the careful
check that names the field at fault (`_check_carefully`). Whatever the one-pass check accepts
must be exactly what the careful one accepts, field for field: generated here are valid
instructions of every operation and near-valid ones (a field replaced by another wire value,
an item added, dropped or repeated, a keyword of another operation, an internal operation from
a client, values at and just past each limit).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paratrain.frontend.ops import HANDLE_LISTS, OPS
from paratrain.frontend.protocol import instructions
from paratrain.frontend.protocol.fields import INT64, MAX_PLAIN_TEXT, MalformedMessage
from paratrain.frontend.protocol.instructions import CLIENT_HANDLES, FIELD_COUNT, MAX_ARGS, Instruction

EDGES = [-1, 0, 1, 2, 60, MAX_ARGS, 1 << 20, (1 << 20) + 1, CLIENT_HANDLES - 1, CLIENT_HANDLES,
         INT64[1], INT64[1] + 1, INT64[0], INT64[0] - 1]
# Values a field or an item is swapped for: each at or past some check's edge, or of a type
# that a looser check would take for another (True for 1, 1.0 for 1, "1").
ODD = [*EDGES, True, False, 1.0, 0.0, float("nan"), "1", "", None, [1], [[1]], [[[1]]], {}, {"x": 1}, b"1",
       "x" * MAX_PLAIN_TEXT, "x" * (MAX_PLAIN_TEXT + 1), "x" * 256, "x" * 257, [0] * 1025]
KEYWORDS = sorted({key for op in OPS.values() for key in op.kwargs} | {"nope"})
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGES), st.integers(-3, 60), st.floats(allow_nan=True),
                    st.text(max_size=4))


@st.composite
def valid_instructions(draw) -> list:
    name = draw(st.sampled_from(sorted(OPS)))
    op = OPS[name]
    fewest, most = op.inputs
    tensors = draw(st.integers(fewest, min(most, 4)))
    results = op.results if op.results is not None else draw(st.integers(1, 3))
    handles = draw(st.lists(st.integers(0, 60), min_size=tensors + results, max_size=tensors + results, unique=True))
    outs = handles[:results]
    if name in HANDLE_LISTS:
        args, targs = draw(st.lists(st.integers(0, 60), max_size=4, unique=True)), []
    else:
        args = handles[results:] + draw(st.lists(st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=3))
        order = draw(st.permutations(range(len(args))))
        args = [args[i] for i in order]
        targs = sorted(order.index(i) for i in range(tensors))
    kwargs = draw(st.dictionaries(st.sampled_from(sorted(op.kwargs)), scalars, max_size=len(op.kwargs))
                  if op.kwargs else st.just({}))
    return [draw(st.integers(0, 1 << 40)), name, outs, args, targs, kwargs, draw(st.booleans()), draw(st.booleans()),
            draw(st.none() | st.integers(0, 4)), draw(st.none() | st.text(max_size=3)), draw(st.none() | st.integers(0, 9))]


def changed(raw: list, field: int, change: str, odd, position: int = 0) -> list:
    """`raw` with one change to one field (a copy)."""
    raw, value = list(raw), raw[field]
    if change == "field":
        raw[field] = odd
    elif change == "operation":
        raw[1] = odd if type(odd) is str and odd not in ("", "1") else KEYWORDS[position % len(KEYWORDS)]
    elif type(value) is dict:
        keys = sorted(value, key=str)
        key = keys[position % len(keys)] if change == "item" and keys else KEYWORDS[position % len(KEYWORDS)]
        raw[field] = {**value, key: odd}
    elif type(value) is list and change == "item" and value:
        position %= len(value)
        raw[field] = value[:position] + [odd] + value[position + 1:]
    elif type(value) is list and change == "add":
        raw[field] = value + [odd]
    elif type(value) is list and change == "repeat" and value:
        raw[field] = value + [value[position % len(value)]]
    elif type(value) is list and change == "drop" and value:
        raw[field] = value[:-1]
    return raw


CHANGES = ("field", "item", "add", "repeat", "drop", "operation")


@st.composite
def near_valid_instructions(draw) -> list:
    raw = draw(valid_instructions())
    for _ in range(draw(st.integers(0, 3))):
        raw = changed(raw, draw(st.integers(0, FIELD_COUNT - 1)), draw(st.sampled_from(CHANGES)),
                      draw(st.sampled_from(ODD) | scalars), draw(st.integers(0, 8)))
    if draw(st.integers(0, 30)) == 0:  # a list of the wrong length
        raw = raw[:-1] if draw(st.booleans()) else raw + [None]
    return raw


def _careful(raw, from_client: bool):
    try:
        return instructions._check_carefully(raw, "batch[0]", from_client)
    except MalformedMessage:
        return None


def _quick(raw, from_client: bool) -> bool:
    if type(raw) is not list or len(raw) != FIELD_COUNT:
        return False
    return instructions._plainly_valid(raw, instructions._BY_SENDER[from_client], instructions._LIMITS[from_client])


def _plain_only(raw: list) -> bool:
    """Every argument and keyword value a scalar: what the one-pass check is for."""
    return all(type(value) is not list for value in raw[3]) and all(type(value) is not list for value in raw[5].values())


# Every single change to a valid instruction is tried exhaustively below (the sweep); these draws
# add instructions changed in several places at once, a few hundred per run (each CI run draws anew).
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=near_valid_instructions(), from_client=st.booleans())
def test_what_the_one_pass_check_accepts_the_careful_check_accepts_alike(raw, from_client):
    if _quick(raw, from_client):
        assert _careful(raw, from_client) == Instruction(*raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=near_valid_instructions(), from_client=st.booleans())
def test_a_plain_instruction_the_careful_check_accepts_takes_the_one_pass_check(raw, from_client):
    accepted = _careful(raw, from_client)
    if accepted is not None and _plain_only(raw) and raw[1] != "upload":
        handle_list_repeats = raw[1] in HANDLE_LISTS and len(set(raw[3])) != len(raw[3])
        assert _quick(raw, from_client) or handle_list_repeats


@given(raw=near_valid_instructions(), from_client=st.booleans())
def test_check_instruction_is_the_careful_check(raw, from_client):
    """The entry point: an Instruction equal to the careful check's, or its refusal."""
    expected = _careful(raw, from_client)
    try:
        got = instructions.check_instruction(raw, "batch", 0, from_client)
    except MalformedMessage:
        got = None
    assert got == expected


def _canonical(name: str) -> list:
    """A valid instruction of `name`: its fewest tensors (one at least, where it takes any), a
    plain argument, two of its keywords."""
    op = OPS[name]
    tensors = max(op.inputs[0], min(op.inputs[1], 1))
    outs = list(range(1, 1 + (op.results if op.results is not None else 2)))
    if name in HANDLE_LISTS:
        args, targs = [7, 8], []
    else:
        args, targs = [10 + i for i in range(tensors)] + [1.5], list(range(tensors))
    kwargs = {key: 1 for key in sorted(op.kwargs)[:2]}
    if name == "upload":
        kwargs = {"dtype": "float32", "shape": [2], "frame": 0}
    return [5, name, outs, args, targs, kwargs, False, False, 1, "s", 3]


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_single_change_to_an_instruction_is_judged_alike_by_both_checks(name):
    """Every field and item of one instruction of each operation swapped for each odd value,
    items added, repeated and dropped: the one-pass check accepts none the careful one refuses."""
    raw = _canonical(name)
    assert _careful(raw, True if OPS[name].kind != "internal" else False) is not None
    wrong = []
    for field in range(FIELD_COUNT):
        size = len(raw[field]) if type(raw[field]) in (list, dict) else 1
        for change in CHANGES:
            for odd in ODD:
                for position in range(max(size, 1) if change in ("item", "repeat") else 1):
                    candidate = changed(raw, field, change, odd, position)
                    for from_client in (True, False):
                        if _quick(candidate, from_client) and _careful(candidate, from_client) != Instruction(*candidate):
                            wrong.append((candidate, from_client))
    assert not wrong, wrong[:3]
