"""Fault injection for the reliability tests (tests/test_reliability.py), kept out of the worker.

Inert unless BATCHSPEC_FAULT_FILE names a path: ShardRunner then holds a FaultPlan and tells it
how far each shard got. The file, when it exists, is JSON like

    {"kill": {"prompts-0001": 4}, "sleep": {"prompts-0003": 30}, "crash": {"prompts-0002": 0}}

meaning: SIGKILL the actor once after 4 rows of prompts-0001 (a marker file makes it happen once),
sleep 30 s before generating prompts-0003 (e.g. so a test can kill the driver meanwhile), and
SIGKILL the actor after 0 rows of prompts-0002 on every attempt (a shard whose input crashes the
engine, as an out-of-memory kill would; each attempt adds a line to a marker file).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

FAULT_FILE_ENV = "BATCHSPEC_FAULT_FILE"


@dataclass
class FaultPlan:
    path: str

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        path = os.environ.get(FAULT_FILE_ENV)
        return cls(path) if path else None

    def reached(self, shard: str, rows_done: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            faults = json.load(f)
        if rows_done == 0 and shard in faults.get("sleep", {}):  # hold the shard
            with open(f"{self.path}.{shard}.started", "w") as f:
                f.write(str(os.getpid()))  # which actor holds it (a test kills that actor's node)
            time.sleep(faults["sleep"][shard])
        at = faults.get("kill", {}).get(shard)
        marker = f"{self.path}.{shard}.killed"
        if at is not None and rows_done >= at and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)
        at = faults.get("crash", {}).get(shard)
        if at is not None and rows_done >= at:
            with open(f"{self.path}.{shard}.crashes", "a") as f:
                f.write("crash\n")
            os.kill(os.getpid(), 9)
