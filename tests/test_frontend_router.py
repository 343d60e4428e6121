"""The dispatcher's router without a server: where created tensors and operations go, how the
gradients of a graph that crossed workers are exchanged and its crossings released, and what
is refused, with which reason. Fast: no process is started."""

import pytest

from paratrain.frontend.dispatcher.router import ClientTable, Router
from paratrain.frontend.protocol import CLIENT_HANDLES, MalformedMessage, codec, messages

TO_DISPATCHER = codec.decoder(messages.TO_DISPATCHER)


def _router(workers=2):
    return Router(workers, lambda w: True)


def _wire(seq, op, outs, args, targs, kwargs, flags=None):
    """An instruction's wire form, from the old seven fields (flags: w, rg)."""
    flags = flags or {}
    return [seq, op, outs, args, targs, kwargs, False, bool(flags.get("rg")), flags.get("w"), None, None]


def _route(router, table, *instructions):
    """Instructions as the dispatcher sees them: decoded (and checked) by the protocol, then
    routed; -> (streams, errors). A message the protocol refuses raises MalformedMessage."""
    raw = [_wire(*i) if isinstance(i, tuple) else i for i in instructions]
    run = codec.decode(codec.encode(messages.Run(raw, None, [])), TO_DISPATCHER)
    routed = router.route(table, run.instructions, run.frames)
    return routed.streams, routed.errors


def test_creation_follows_the_clients_placement_and_ops_follow_their_first_input():
    router, table = _router(), ClientTable(slot=1, home=0)
    streams, errors = _route(router, table,
                             (1, "randn", [0], [4], [], {}),
                             (2, "randn", [1], [4], [], {}, {"w": 1}),
                             (3, "add", [2], [1, 0], [0, 1], {}))  # runs on worker 1; handle 0 moves there
    assert errors == []
    assert [i.op for i in streams[0]] == ["randn", "send"]
    assert [i.op for i in streams[1]] == ["randn", "recv", "add", "free"]
    temp = streams[1][1].outs[0]
    assert temp >= CLIENT_HANDLES and streams[1][2].args == [1, temp]
    assert table.where[2].workers == (1,) and table.where[2].split is None


def test_backward_across_workers_exchanges_gradients_newest_crossing_first():
    router, table = _router(), ClientTable(slot=1, home=0)
    streams, _ = _route(router, table,
                        (1, "randn", [0], [4], [], {}, {"rg": 1}),
                        (2, "randn", [1], [4], [], {}, {"w": 1, "rg": 1}),
                        (3, "mul", [2], [1, 0], [0, 1], {}),  # on 1, crossing 0: worker 0 -> 1
                        (4, "relu", [3], [0], [0], {}),
                        (5, "add", [4], [3, 2], [0, 1], {}),  # on 0, crossing 1: worker 1 -> 0
                        (6, "sum", [5], [4], [0], {}),
                        (7, "backward", [], [5], [0], {}))
    ops0 = [(i.op, i.kwargs.get("crossing")) for i in streams[0]]
    ops1 = [(i.op, i.kwargs.get("crossing")) for i in streams[1]]
    assert ops0[-3:] == [("backward", None), ("bw_send", 1), ("bw_recv", 0)]
    assert ops1[-2:] == [("bw_recv", 1), ("bw_send", 0)]
    assert streams[0][-3].kwargs["retain_graph"] is True


def test_freeing_the_last_handle_of_a_graph_releases_its_crossings():
    router, table = _router(), ClientTable(slot=1, home=0)
    _route(router, table,
           (1, "randn", [0], [4], [], {}, {"rg": 1}),
           (2, "randn", [1], [4], [], {}, {"w": 1}),
           (3, "add", [2], [1, 0], [0, 1], {}))
    assert len(router.crossings) == 1
    streams, _ = _route(router, table, (4, "free", [], [2], [], {}))
    assert router.crossings == {}
    assert [i.op for i in streams[0]] == ["release"]
    assert sorted(i.op for i in streams[1]) == ["free", "release"]


@pytest.mark.parametrize("instruction, reason", [
    ((1, "os.system", [0], [], [], {}), "unknown operation"),
    ((1, "send", [], [0], [0], {}), "unknown operation"),  # dispatcher-only
    ((1, "relu", [1], [99], [0], {}), "not a tensor of this client"),
    ((1, "sum", [1], [0], [0], {"out": 1}), "no keyword argument 'out'"),
    ((1, "relu", [0], [0], [0], {}), "already in use"),
    ((1, "relu", [1], [0], [5], {}), "targs[0]"),
    ("not a list", "an instruction is a list"),
])
def test_bad_instructions_are_refused_with_a_reason(instruction, reason):
    """By the protocol when malformed (naming the field), by the router when they name handles
    this client does not have."""
    router, table = _router(), ClientTable(slot=1, home=0)
    _route(router, table, (0, "randn", [0], [2], [], {}))
    try:
        streams, errors = _route(router, table, instruction)
    except MalformedMessage as error:
        assert reason in str(error)
        return
    assert len(errors) == 1 and reason in errors[0].message
    assert not streams


def test_results_of_a_refused_instruction_are_skipped_without_a_second_error():
    router, table = _router(), ClientTable(slot=1, home=0)
    _, errors = _route(router, table,
                       (1, "relu", [1], [99], [0], {}),
                       (2, "exp", [2], [1], [0], {}))
    assert len(errors) == 1 and table.refused[2] == table.refused[1]
