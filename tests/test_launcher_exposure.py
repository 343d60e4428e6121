"""A local world is local: everything a run started by our launcher listens on is bound to
127.0.0.1 (PyTorch's own stores would listen on every interface), and its ranks end when the
launcher does, even when it is killed with SIGKILL (they are forked from a server, not from it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from frontend_helpers import listening_addresses, wait_until
from paratrain import launch, lifetime


def _where_ranks_listen(group):
    import torch

    group.all_reduce(torch.ones(4))  # every transport is up
    group.barrier()
    return listening_addresses(os.getpid()), listening_addresses(int(os.environ["PARATRAIN_LAUNCHER_PID"]))


def test_every_socket_a_local_process_world_listens_on_is_loopback():
    results = launch.run(_where_ranks_listen, 2, launcher="processes")
    launcher = results[0][1]
    assert launcher, "the launcher serves the rendezvous: it listens on something"
    for rank, (own, _) in results.items():
        for address in [*own, *launcher]:
            assert address.startswith("127.0.0.1:"), (rank, own, launcher)


def test_ranks_end_within_five_seconds_of_their_launcher_killed_by_sigkill(tmp_path, short_tmp):
    # The killed launcher leaves its log folder in its temporary directory for the next run to
    # remove: one of the test's own, or the next run of a test beside this one would, and say so
    # in the output that test reads.
    ranks = []
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--nproc", "2", "--launcher", "processes",
         "--steps", "1000000", "--log-every", "1", "--global-batch", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(short_tmp)})
    try:
        wait_until(lambda: "step" in launcher.stdout.readline(), 120, "the run trains")
        # the launcher's children are the fork server and the resource tracker; the ranks, the server's
        ranks = wait_until(lambda: [p for p in lifetime.descendants(launcher.pid) if _parent(p[0]) != launcher.pid],
                           30, "the ranks are found")
        assert len(ranks) >= 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed_at = time.monotonic()
        wait_until(lambda: not any(lifetime.start_time(pid) == started and lifetime.process_alive(pid)
                                   for pid, started in ranks), 10, "every rank has ended")
        assert time.monotonic() - killed_at < 5.0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid, started in ranks:
            if lifetime.start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _rank_of(group):
    return group.rank


def test_a_processes_launch_never_reads_the_stack_with_inspect(monkeypatch):
    """The elastic agent's rendezvous names each step it records; it did so with inspect.stack(),
    which reads the source of every frame on the stack (seconds of CPU per launch from a deep
    caller). While our launcher runs the agent, the name comes from the frame; restored after."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def record():  # as the rendezvous's _record asks: the name of the method that called it
        return dynamic_rendezvous.get_method_name()

    def keep_alive():
        return record()

    assert keep_alive() == "keep_alive"  # torch's own, reading the stack
    with launch._rendezvous_records_cheap():
        assert keep_alive() == "keep_alive"

    before = dynamic_rendezvous.get_method_name
    stacks = []
    real_stack = inspect.stack

    def counted_stack(*args, **kwargs):
        stacks.append(1)
        return real_stack(*args, **kwargs)

    monkeypatch.setattr(inspect, "stack", counted_stack)
    assert launch.run(_rank_of, 2, launcher="processes") == {0: 0, 1: 1}
    assert stacks == [] and dynamic_rendezvous.get_method_name is before
