"""How a Group's collective call runs once its arguments are checked and its algorithm chosen:
numbered, recorded in the flight recorder, run here or on the group's communication thread, a
failure named and recorded (`run`); and the straight path of a call made again on the same
tensors, which runs what an earlier call kept (`run_straight`, from the Group's Replays,
replays.py). The Group (group.py) holds one CollectiveCalls, as it holds a PointToPoint, and gives
it what both kinds of call share: the transport, the flight recorder, and what a failed and a
finished call do.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from paratrain.comm import checks
from paratrain.comm.algorithms import ALGORITHMS
from paratrain.comm.flight import named_range
from paratrain.comm.handles import CollectiveHandle, timed
from paratrain.comm.link import TRANSPORT_ERRORS, Link, comm_error, original_cause
from paratrain.comm.ops import divide_, reduced_as
from paratrain.comm.p2p_calls import USER_TAGS


class CollectiveCalls:
    def __init__(self, transport, recorder, key, timeout: float, segment_bytes: int, scratch, debug: bool,
                 failed: Callable, retire: Callable):
        self.transport, self.rank, self.size = transport, transport.rank, transport.size
        self._recorder, self._key = recorder, key  # the rank's flight recorder, the group's key in it
        self.timeout, self.segment_bytes, self._scratch = timeout, segment_bytes, scratch
        self.debug = debug  # check before every call that all ranks make the same one
        self._failed, self._retire = failed, retire  # Group._failed, Group._retire
        self.seq = 0  # the last call's number: the same on every rank, since all make the same calls
        self.whole = 0  # calls that took the whole path (`run`), not a replay's
        self.executor: ThreadPoolExecutor | None = None  # the communication thread, once an async call starts it

    def run(self, op_name: str, chosen: str, signature: checks.CallSignature, args: tuple, hierarchy=None, *,
            reduce_op: str | None = None, moves: bool = True, averaged: torch.Tensor | None = None,
            written: tuple | None = None, replay=None, async_op: bool = False):
        """Number the call, then (check it in debug mode and) run algorithm `chosen`, here or,
        with `async_op`, on the communication thread.

        The algorithm gets its Link (or the group's two levels, `hierarchy`, where `chosen` is
        hierarchical), then `args` (its buffers, flat, and a root), then the reduce op where there
        is one: an average runs as a sum, and `averaged` is divided after. Nothing runs unless the
        call `moves` something; `written` = (tensor, buffer): the buffer copied back into the
        caller's tensor, which is returned. `replay(link, algo, algorithm, args)`, where given,
        runs the algorithm instead, keeping what it needs to run it again (replays.py).
        """
        self.seq += 1
        self.whole += 1
        seq = self.seq
        call = self._recorder.start(self._key, "collective", seq, op_name, signature, chosen)
        link = Link(
            self.transport, op_name, seq, USER_TAGS + seq % USER_TAGS, self.timeout,
            self.segment_bytes, self._scratch,
        )
        if reduce_op is not None:
            args += (reduced_as(reduce_op),)

        def execute():
            try:
                if self.debug:
                    checks.same_call_everywhere(link, signature.with_algo(chosen))
                try:
                    with named_range(op_name):
                        if moves:
                            algorithm = ALGORITHMS[op_name][chosen]
                            if hierarchy is not None:  # its subgroups' calls: nothing of this group's to replay
                                algorithm(hierarchy, *args)
                            elif replay is None:
                                algorithm(link, *args)
                            else:
                                replay(link, chosen, algorithm, args)
                except TRANSPORT_ERRORS as error:  # a native collective's own
                    raise comm_error(error, self.rank, op_name, seq, self.timeout, self.transport) from original_cause(error)
                if reduce_op == "avg" and averaged is not None:
                    divide_(averaged, self.size)
                self._retire(link.finished)
            except Exception as error:
                self._failed(call, error)
                raise
            call.complete()
            return checks.write_back(*written) if written is not None else None

        if async_op:
            return CollectiveHandle(self._comm_thread().submit(timed, execute), op_name, seq)
        if self.executor is not None:
            # Calls run in the order they were made on every rank, or ranks would wait on each
            # other's different calls: a blocking call queues behind the pending async ones.
            return self.executor.submit(execute).result()
        return execute()

    def run_straight(self, op_name: str, entry, result: torch.Tensor, reduce_op: str = ""):
        """A call made again from what an earlier one kept (replays.py): its `run` and nothing
        else, numbered, recorded and failed like any other call; an average is divided after.
        What `run` and the op would do besides (check the arguments, describe the call) the call
        that kept it has done for this one. Calls on the communication thread, whose order must
        hold, and calls in debug mode, which checks every call, never come here."""
        self.seq += 1
        seq = self.seq
        call = self._recorder.start(self._key, "collective", seq, op_name, entry.signature, entry.algo)
        link = None
        try:
            try:
                with named_range(op_name):
                    if entry.timed is not None:  # a shared-segment replay: no message, so no Link to make
                        entry.timed(self.timeout)
                    else:
                        link = Link(self.transport, op_name, seq, USER_TAGS + seq % USER_TAGS, self.timeout,
                                    self.segment_bytes, self._scratch)
                        entry.run(link)
            except TRANSPORT_ERRORS as error:  # the shared segment's own waits (Link's say who already)
                raise comm_error(error, self.rank, op_name, seq, self.timeout, self.transport) from original_cause(error)
        except Exception as error:
            self._failed(call, error)
            raise
        if reduce_op == "avg":
            divide_(result, self.size)
        if link is not None:
            self._retire(link.finished)
        call.complete()
        return result

    def _comm_thread(self) -> ThreadPoolExecutor:
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"comm-rank{self.rank}")
        return self.executor

    def close(self) -> None:
        """Stop the communication thread, if async calls started one."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
