"""A group that spans hosts, seen as two levels (what `algo="hier"` runs on).

`local`: the group's ranks on this rank's host, through shared memory (kind "shm"), numbered in
the group's order. `cross`: the ranks with this rank's local index on every host, one per host,
numbered by host, through the network. A hierarchical collective does the bulk of its work in
`local` and sends only 1/local of the data through `cross` (algorithms/hierarchical.py). NCCL and
MPI's implementations split a collective the same way: NVLink or shared memory inside a node, one
flow per pair of nodes between them.

Both subgroups are made at the group's first hierarchical call, by every rank of the group in
the same order (each makes two), and closed with the group.
"""

from __future__ import annotations

import torch

from paratrain.comm.choice import Choice, across_hosts_choice


def hier_problem(hosts: tuple[tuple[int, ...], ...] | None) -> str | None:
    """Why a group whose ranks sit on `hosts` (group ranks per host; None: not known) cannot run
    a hierarchical collective; None where it can."""
    if hosts is None:
        return ("needs to know which ranks share a host, which only a process group of CPU tensors "
                "learns as it sets up (not the threads' fabric, not NCCL, which is hierarchical itself)")
    if len(hosts) < 2:
        return "needs a group whose ranks span hosts; this group's are all on one"
    sizes = sorted({len(ranks) for ranks in hosts})
    if len(sizes) > 1:
        return f"needs the same number of the group's ranks on every host; its {len(hosts)} hosts have {sizes}"
    return None


class Spread:
    """Where a group's ranks are: `hosts` (group ranks per host; None: not known), whether a
    hierarchical collective can run on them (`problem`, None where it can), what `auto` picks
    for being spread over hosts, and the two levels once made (`levels`)."""

    def __init__(self, hosts: tuple[tuple[int, ...], ...] | None):
        self.hosts = hosts
        self.problem = hier_problem(hosts)
        self._levels: Hierarchy | None = None

    def choice(self, op: str, nbytes: int | None) -> Choice | None:
        """`auto`'s pick for a group spread over hosts (choice.across_hosts_choice); None: not spread
        so that it matters, the flat choice stands."""
        if self.problem is not None:
            return None
        return across_hosts_choice(op, nbytes, len(self.hosts), len(self.hosts[0]))

    def levels(self, group) -> Hierarchy:
        """`group` as two levels, made by every rank at the first call that needs them (all ranks
        make the same calls, so they make them together)."""
        if self._levels is None:
            self._levels = Hierarchy(group, self.hosts)
        return self._levels

    def close(self) -> None:
        if self._levels is not None:
            self._levels.close()
            self._levels = None


class Hierarchy:
    def __init__(self, group, hosts: tuple[tuple[int, ...], ...]):
        problem = hier_problem(hosts)
        if problem is not None:
            raise ValueError(f"algorithm 'hier' {problem}")
        self.hosts = hosts
        self.size = group.size
        self.host_count, self.per_host = len(hosts), len(hosts[0])
        self.host_index = next(index for index, ranks in enumerate(hosts) if group.rank in ranks)
        self.local_index = hosts[self.host_index].index(group.rank)
        self.local = group.split([list(ranks) for ranks in hosts])
        self.cross = group.split([[ranks[i] for ranks in hosts] for i in range(self.per_host)])
        # Where each group rank's part sits when parts are laid out by local index, then host:
        # the order in which `local` hands out blocks, each of which `cross` splits by host.
        self.position = torch.tensor([self.place(rank)[1] * self.host_count + self.place(rank)[0]
                                      for rank in range(self.size)])
        # The algorithms' intermediate buffers, kept from call to call: a fresh one would cost
        # its pages' first touch every call, and the subgroups replay calls made again on the
        # same tensors (replays.py). A group runs one collective at a time, so one set serves.
        self._buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """The intermediate buffer `name` of `numel` elements of `like`'s dtype and device
        (contents undefined); one per name, replaced when the size changes."""
        key = (name, like.dtype, like.device)
        kept = self._buffers.get(key)
        if kept is None or kept.numel() != numel:
            kept = self._buffers[key] = like.new_empty(numel)
        return kept

    def place(self, rank: int) -> tuple[int, int]:
        """(host index, local index) of a group rank."""
        for host, ranks in enumerate(self.hosts):
            if rank in ranks:
                return host, ranks.index(rank)
        raise ValueError(f"rank {rank} is on none of the hosts {self.hosts}")

    def rank_at(self, host: int, local: int) -> int:
        return self.hosts[host][local]

    def close(self) -> None:
        self._buffers.clear()
        self.local.close()
        self.cross.close()
