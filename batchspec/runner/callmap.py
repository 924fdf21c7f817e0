"""What each shard actor of the Ray Data pool runs (CallMap, map_batches' callable), and how a
call that kills its actor is retried and at last failed (CrashLedger).

Failure rules (every call comes back exactly once, as manifests or as failed(call, reason)):
1. A call that raises fails only its own shards; the actor keeps working.
2. An actor whose constructor raised fails every call it gets, in one line, and does not hang.
3. An actor killed mid-call is restarted by Ray and its block retried on it, on another node if
   its node is gone, for as long as it takes (calls of the block committed before the death are
   not generated again). Ray's own retry count cannot tell a lost node from an input that crashes
   the engine: a SIGKILLed node is not known dead for some seconds, and every restart placed on it
   in that time counts as a death (three in 8 s here), so the node's shards failed. The restarted
   actor counts instead, in a ledger under the output (CrashLedger): only a block it actually ran
   again counts. After ATTEMPTS deaths a block of several shards runs shard by shard, and a shard
   that kills its actor ATTEMPTS times alone fails, alone.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..errors import error_line

if TYPE_CHECKING:
    from .store import OutputStore

ATTEMPTS = 3  # a block (then a shard alone) that kills its actor this many times is given up
KILLED = (f"the shard killed its actor {ATTEMPTS} times (out of memory, or a native crash on its input); "
          "the shard actor's log has why")


class CrashLedger:
    """What a block's restarted actors know of its crashes: one small JSON file per block of calls
    that killed an actor, in the output's `_batchspec/crashes/<job_id>/`, written (through the
    store, whole or not at all) only by an actor that was restarted, so a run without crashes
    writes nothing. {"deaths": n, "running": shard run alone when the actor died, or null,
    "alone": {shard: deaths while run alone}}."""

    def __init__(self, store: OutputStore, job_id: str):
        self.store, self.job_id = store, job_id

    def _path(self, calls: list) -> str:
        key = hashlib.sha256(json.dumps(calls, sort_keys=True).encode()).hexdigest()[:24]
        return self.store.meta_path("crashes", self.job_id, f"{key}.json")

    def read(self, calls: list) -> dict:
        return self.store.read_json(self._path(calls)) or {"deaths": 0, "running": None, "alone": {}}

    def write(self, calls: list, entry: dict) -> None:
        self.store.write_json(self._path(calls), entry)


class CallMap:
    """The map_batches callable: one shard worker per Ray Data actor; a batch is one block of
    consecutive calls (one Ray Data task), run one after another."""

    def __init__(self, worker_cls: type, init_kwargs: dict, ledger: CrashLedger):
        import ray

        # Restarted after a death: its first block is the block that was running then, retried.
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.ledger = ledger
        self.worker: Any = None
        self.dead = ""
        try:
            self.worker = worker_cls(**init_kwargs)
        except Exception as e:  # raised, Ray Data would restart the actor and fail the whole job
            self.dead = f"shard actor died: {error_line(e)}"

    def __call__(self, batch: dict) -> dict:
        calls = [json.loads(text) for text in batch["call"]]
        results: list[tuple[list[dict], str]]
        if self.worker is None:
            results = [([], self.dead)] * len(calls)
        elif self.restarted:
            results = self._retried(calls)
        else:
            results = [self._run(call) for call in calls]
        self.restarted = False
        return {"index": [int(i) for i in batch["index"]], "manifests": [json.dumps(m) for m, _ in results],
                "error": [error for _, error in results]}

    def _run(self, call: list) -> tuple[list[dict], str]:
        try:
            return self.worker.run(call), ""
        except Exception as e:  # the call's shards fail; the actor keeps working
            return [], error_line(e)

    def _retried(self, calls: list[list]) -> list[tuple[list[dict], str]]:
        """A block that killed the actor before: whole while it has killed it fewer than ATTEMPTS
        times (its calls committed by then are not generated again), then shard by shard; a shard
        that kills it ATTEMPTS times alone fails."""
        entry = self.ledger.read(calls)
        entry["deaths"] += 1
        if entry["running"] is not None:
            entry["alone"][entry["running"]] = entry["alone"].get(entry["running"], 0) + 1
            entry["running"] = None
        if entry["deaths"] < ATTEMPTS:
            self.ledger.write(calls, entry)
            return [self._run(call) for call in calls]
        alone = sum(len(call) for call in calls) == 1
        out = []
        for call in calls:
            manifests: list[dict] = []
            for shard in call:
                sid = shard["shard"] if isinstance(shard, dict) else shard
                if alone or entry["alone"].get(sid, 0) >= ATTEMPTS:
                    manifests.append({"shard": sid, "status": "failed", "error": KILLED})
                    continue
                self.ledger.write(calls, {**entry, "running": sid})
                got, error = self._run([shard])
                manifests += got or [{"shard": sid, "status": "failed", "error": error}]
            out.append((manifests, ""))
        self.ledger.write(calls, entry)
        return out
