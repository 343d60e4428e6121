"""A Group's calls made again (a mixin of `Group`, group.py): an all-reduce on a tensor that
has a plan, or a reduce-scatter or all-gather repeated on the same tensors (plans.py), runs
what the earlier call worked out and nothing else. The call that noted it checked the
arguments and described the call for the flight recorder; those hold for this one, which is
still numbered, recorded and failed like any other."""

from __future__ import annotations

import torch

from paratrain.comm.flight import named_range
from paratrain.comm.link import TRANSPORT_ERRORS, Link, comm_error, original_cause
from paratrain.comm.ops import divide_
from paratrain.comm.p2p_calls import USER_TAGS


class StraightCalls:
    def _goes_straight(self, entry, op_name: str, algo: str) -> bool:
        """Whether a call that found `entry` (a plan or a repeated call, plans.py, or None) runs it."""
        return entry is not None and (entry.asked == (algo, self.table, self.table.version)
                                      or self._confirms(entry, op_name, algo))

    def _confirms(self, entry, op_name: str, algo: str) -> bool:
        """Whether `algo` (the caller's argument) resolves to the algorithm `entry` (a plan or a
        repeated call, plans.py) runs; remembered on the entry, with the table and its version,
        when it does: until the table changes or is replaced, the same argument resolves the same way."""
        if self.resolve(op_name, algo, entry.nbytes) != entry.algo:
            return False
        entry.asked = (algo, self.table, self.table.version)
        return True

    def _run_straight(self, op_name: str, entry, result, averaged: torch.Tensor | None = None):
        """A call made again from what an earlier one noted (an all-reduce's plan, a repeated
        reduce-scatter or all-gather, plans.py): its `run` and nothing else, numbered, recorded
        and failed like any other call; `averaged` is divided by the world size after. What
        `_run` and the op would do besides (check the arguments, describe the call, build its
        closures) the call that noted it has done for this one."""
        self._collective_seq += 1
        seq = self._collective_seq
        call = self._recorder.start(self._key, "collective", seq, op_name, entry.signature, entry.algo)
        link = None
        try:
            try:
                with named_range(op_name):
                    if entry.timed is not None:  # a shared-segment plan: no message, so no Link to make
                        entry.timed(self.timeout)
                    else:
                        link = Link(self.transport, op_name, seq, USER_TAGS + seq % USER_TAGS, self.timeout,
                                    self.segment_bytes, self._scratch)
                        entry.run(link)
            except TRANSPORT_ERRORS as error:  # the shared segment's own waits (Link's say who already)
                raise comm_error(error, self.rank, op_name, seq, self.timeout) from original_cause(error)
        except Exception as error:
            self._failed(call, error)
            raise
        if averaged is not None:
            divide_(averaged, self.size)
        if link is not None:
            self._retire(link.finished)
        call.complete()
        return result
