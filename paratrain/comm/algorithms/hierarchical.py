"""Collectives in two levels, for a group that spans hosts (`algo="hier"`; hierarchy.py).

With h hosts of L ranks and S bytes, rank (host, i) runs:

- all_reduce: reduce-scatter inside the host (each local rank keeps the host's sum of 1/L of the
  buffer), all-reduce that 1/L across hosts among the ranks with local index i, all-gather
  inside the host. Across hosts each rank sends 2(h-1)/h * S/L, where a flat ring over all
  n = hL ranks sends 2(n-1)/n * S from every rank whose ring successor is on another host.
- reduce_scatter: the input laid out by (local index, host) of the part's owner; a
  reduce-scatter inside the host leaves local rank i the host's sum of the parts of ranks
  (every host, i); a reduce-scatter across hosts leaves each its own part. Across: (h-1)/h * S/L.
- all_gather: the reverse: across hosts first (each rank's part to the ranks of its local
  index), then inside the host, then each part moved to its owner's place.
- broadcast: the root's host broadcasts inside itself, each of its ranks sends 1/L of the
  buffer to its local index's ranks on every other host, which all-gather it inside theirs.
- all_to_all (equal or uneven parts): inside the host, each rank sends local rank j what it
  has for local index j on every host (the host's ranks first tell each other their split
  sizes); across hosts, local rank j passes each host what its host has for it; the parts are
  then put in their sources' order.

Each level's call is a collective of the subgroup, with `algo="auto"`: inside a host the shared
segment's algorithms, across hosts the network's. A part of a size that does not divide evenly
travels padded to the largest part.
"""

from __future__ import annotations

import torch

from paratrain.comm.ops import Splits, all_to_all_parts, part_sizes


def all_reduce(hier, flat: torch.Tensor, op: str) -> None:
    sizes = part_sizes(flat.numel(), hier.per_host)
    chunk = hier.buffer("chunk", sizes[hier.local_index], flat)
    hier.local.reduce_scatter(chunk, flat, op)
    hier.cross.all_reduce(chunk, op)
    hier.local.all_gather(flat, chunk)


def reduce_scatter(hier, flat_in: torch.Tensor, flat_out: torch.Tensor, op: str) -> None:
    sizes = part_sizes(flat_in.numel(), hier.size)
    width = sizes[0]  # the largest part
    staged = _staged(hier, flat_in, sizes, width)
    block = hier.buffer("block", hier.host_count * width, flat_in)
    hier.local.reduce_scatter(block, staged, op)
    mine = hier.buffer("part", width, flat_in)
    hier.cross.reduce_scatter(mine, block, op)
    flat_out.copy_(mine[:flat_out.numel()])


def all_gather(hier, flat_in: torch.Tensor, flat_out: torch.Tensor) -> None:
    sizes = part_sizes(flat_out.numel(), hier.size)
    width = sizes[0]
    mine = flat_in
    if flat_in.numel() != width:  # a short part travels padded
        mine = hier.buffer("part", width, flat_in)
        mine[:flat_in.numel()] = flat_in
        mine[flat_in.numel():] = 0
    block = hier.buffer("block", hier.host_count * width, flat_in)
    hier.cross.all_gather(block, mine)
    staged = hier.buffer("staged", hier.size * width, flat_in)
    hier.local.all_gather(staged, block)
    _unstage(hier, staged, flat_out, sizes, width)


def broadcast(hier, flat: torch.Tensor, root: int) -> None:
    root_host, root_local = hier.place(root)
    on_root_host = hier.host_index == root_host
    if on_root_host:
        hier.local.broadcast(flat, root_local)
    sizes = part_sizes(flat.numel(), hier.per_host)
    start = sum(sizes[:hier.local_index])
    chunk = hier.buffer("chunk", sizes[hier.local_index], flat)
    if on_root_host:
        chunk.copy_(flat[start:start + chunk.numel()])
    hier.cross.broadcast(chunk, root_host)
    hier.local.all_gather(flat, chunk)


def all_to_all(hier, flat_in: torch.Tensor, flat_out: torch.Tensor, splits: Splits | None = None) -> None:
    if splits is None:  # equal parts: rank r receives part_sizes(...)[r] from everyone
        sizes = part_sizes(flat_in.numel(), hier.size)
        rank = hier.rank_at(hier.host_index, hier.local_index)
        splits = Splits(tuple(sizes), (sizes[rank],) * hier.size)
    send_parts, receive_parts = all_to_all_parts(flat_in, flat_out, hier.size, splits)
    # what every rank of this host sends each rank of the group: the first step's sizes
    counts = torch.tensor(splits.send, dtype=torch.int64)
    table = counts.new_empty(hier.per_host * hier.size)
    hier.local.all_gather(table, counts)
    sent = table.view(hier.per_host, hier.size).tolist()  # sent[local rank][group rank]
    hosts, me = range(hier.host_count), hier.local_index
    # 1. inside the host: to local rank j, what this rank has for local index j on every host
    step_in = torch.cat([send_parts[hier.rank_at(host, j)] for j in range(hier.per_host) for host in hosts])
    to_local = [sum(splits.send[hier.rank_at(host, j)] for host in hosts) for j in range(hier.per_host)]
    from_local = [sum(sent[i][hier.rank_at(host, me)] for host in hosts) for i in range(hier.per_host)]
    gathered = flat_in.new_empty(sum(from_local))
    hier.local.all_to_all(gathered, step_in, output_split_sizes=from_local, input_split_sizes=to_local)
    # gathered holds, for each local source i, its parts for (every host, local index me)
    pieces = dict(zip([(i, host) for i in range(hier.per_host) for host in hosts],
                      gathered.split([sent[i][hier.rank_at(host, me)] for i in range(hier.per_host)
                                      for host in hosts])))
    # 2. across hosts: to each host, what this host's ranks have for its rank of local index me
    step_in = torch.cat([pieces[i, host] for host in hosts for i in range(hier.per_host)])
    to_hosts = [sum(sent[i][hier.rank_at(host, me)] for i in range(hier.per_host)) for host in hosts]
    from_hosts = [sum(splits.receive[hier.rank_at(host, i)] for i in range(hier.per_host)) for host in hosts]
    arrived = flat_in.new_empty(sum(from_hosts))
    hier.cross.all_to_all(arrived, step_in, output_split_sizes=from_hosts, input_split_sizes=to_hosts)
    sources = [hier.rank_at(host, i) for host in hosts for i in range(hier.per_host)]
    for source, piece in zip(sources, arrived.split([splits.receive[r] for r in sources])):
        receive_parts[source].copy_(piece)


def _staged(hier, flat: torch.Tensor, sizes: list[int], width: int) -> torch.Tensor:
    """`flat`'s parts (one per group rank) laid out by their owner's (local index, host), each
    in a slot of `width` elements."""
    staged = hier.buffer("staged", hier.size * width, flat)
    if len(set(sizes)) == 1:
        staged.view(hier.size, width).index_copy_(0, hier.position, flat.view(hier.size, width))
        return staged
    staged.zero_()
    start = 0
    for rank, size in enumerate(sizes):
        slot = int(hier.position[rank]) * width
        staged[slot:slot + size] = flat[start:start + size]
        start += size
    return staged


def _unstage(hier, staged: torch.Tensor, flat: torch.Tensor, sizes: list[int], width: int) -> None:
    """The reverse of _staged: each group rank's part from its slot into its place in `flat`."""
    if len(set(sizes)) == 1:
        torch.index_select(staged.view(hier.size, width), 0, hier.position, out=flat.view(hier.size, width))
        return
    start = 0
    for rank, size in enumerate(sizes):
        slot = int(hier.position[rank]) * width
        flat[start:start + size] = staged[slot:slot + size]
        start += size
