"""A client's sync: ask every worker it has used since its last sync for its errors and the values
the client wants, gather the answers as they come, and reply once all have.

A split tensor is fetched part by part from its workers (the client puts the parts together);
a replicated one from its first worker. Each worker's reply also carries its running totals of
busy and waiting time, which the client uses to measure a pipeline's bubble.
"""

from __future__ import annotations

from paratrain.frontend import wire
from paratrain.frontend.peers import ClientState, WorkerState


class SyncReplies:
    """Mixed into Dispatcher."""

    def _start_sync(self, client: ClientState, token: int, fetch: list) -> None:
        sync = client.sync
        sync["token"], sync["order"], sync["stats"] = token, fetch, {}
        table, by_worker = client.table, {}
        for handle in fetch:
            reason = None
            if handle in table.refused:
                reason = table.refused[handle]
            elif not isinstance(handle, int) or handle not in table.where or table.meta.get(handle) is None:
                reason = f"handle {handle!r} is not a tensor of this client"
            if reason is not None:
                sync["fetched"][handle] = {"meta": [handle, None, reason]}
                continue
            placement = table.where[handle]
            holders = placement.workers if placement.split is not None else placement.workers[:1]
            shape, dtype = table.meta[handle]
            sync["fetched"][handle] = {"meta": [handle, dtype, list(shape), len(holders), placement.split],
                                       "holders": list(holders), "parts": {}}
            for worker in holders:
                by_worker.setdefault(worker, []).append(handle)
        for worker in client.dirty | set(by_worker):
            if not self._is_alive(worker):
                sync["errors"].append([-1, "sync", [], worker, f"worker {worker} is lost (no heartbeat)"])
                for handle in by_worker.get(worker, []):
                    sync["fetched"][handle] = {"meta": [handle, None, f"worker {worker} is lost"]}
                continue
            self._send(self.workers[worker].identity,
                       {"t": "sync", "slot": table.slot, "token": token, "fetch": by_worker.get(worker, [])})
            sync["waiting"].add(worker)
        client.dirty = set()
        self._finish_sync_if_done(client)

    def _worker_synced(self, worker: WorkerState, header: dict, frames: list) -> None:
        client = self.by_slot.get(header.get("slot"))
        if client is None or client.sync is None or client.sync["token"] != header.get("token"):
            return  # the client left meanwhile
        sync = client.sync
        sync["errors"].extend(wire.field(header, "errors", list))
        sync["stats"][worker.rank] = header.get("stats") or {}
        tensor_frames = iter(frames)
        for meta in wire.field(header, "fetched", list):
            entry = sync["fetched"].get(meta[0])
            frame = next(tensor_frames) if meta[1] is not None else None
            if meta[1] is None:
                sync["fetched"][meta[0]] = {"meta": [meta[0], None, meta[2]]}
            elif entry is not None and "parts" in entry:
                entry["parts"][worker.rank] = frame
        sync["waiting"].discard(worker.rank)
        self._finish_sync_if_done(client)

    def _finish_sync_if_done(self, client: ClientState) -> None:
        sync = client.sync
        if sync["waiting"]:
            return
        metas, frames = [], []
        for handle in sync["order"]:
            entry = sync["fetched"].get(handle, {"meta": [handle, None, "not fetched"]})
            metas.append(entry["meta"])
            if entry["meta"][1] is not None:
                frames.extend(entry["parts"][worker] for worker in entry["holders"])
        errors = sorted(sync["errors"], key=lambda error: error[0])
        self._send(client.identity, {"t": "synced", "token": sync["token"], "errors": errors, "fetched": metas,
                                     "stats": sync.get("stats", {})}, frames)
        client.sync = None

