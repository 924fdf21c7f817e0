"""What the speculation policy measured, kept on the actor's node between runs (speculation.remember).

A nightly job runs the same models on the same machines every night. What a step costs is a fact
about the machine and the models; the acceptance and completion lengths a shard starts from are
facts about the job. Two JSON files per node, under BATCHSPEC_POLICY_MEMORY (default:
BATCHSPEC_CACHE/policy, i.e. ~/.cache/batchspec/policy; "off" turns it off on the node):

    costs-<hash>.json  step costs by concurrency and (vllm) the clean steps per arm, (rows,
                       seconds), the step lines were fitted on, with what a prompt token cost.
                       Keyed by what changes them: the backend and its version, the device, the
                       actor's threads and CPUs/GPUs, and the spec's model section (storage
                       options left out). Any job with that key reads it.
    job-<hash>.json    the acceptance estimate and recent completion lengths. Keyed by the costs key
                       plus the job's name, generation settings, prompt column and template (not
                       the input path: a nightly job's input moves, its data does not).

Only measurements are kept: token counts and seconds, never a prompt. Costs go on being refreshed
from every call; a remembered acceptance counts as at most PRIOR_TRIALS trials, so the first call
of a run outweighs it. Remembered steps join the run's own (the newest policy.planner.KEEP_POINTS
per arm are fitted), so a remembered run's first decisions rest on the hundreds of steps the last
run took, not on its look's few dozen; with a plain engine its look still times the plain arm,
so that both arms hold this run's steps (ActorPolicy.needs_plain_look). A run that decides "off"
from memory measures nothing and would decide from the same numbers every night: so remembered
costs are used for MAX_AGE_DAYS after the run that last measured them (their file keeps its
measured_at), then the job measures again as if new. On vllm no decision rests on a remembered acceptance: every run measures each
shard's own on its look rows, so an "off" is never carried over unchecked. A file that cannot be
read is ignored with one warning; writes go through a temporary file and a rename, so a killed
actor leaves the last good file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from ..policy import Acceptance, Costs
from .memory_keys import digest, memory_keys, memory_root, readable

log = logging.getLogger("batchspec.worker")

PRIOR_TRIALS = 64.0  # weight of a remembered acceptance: one call of 96 rows observes ~2,000 trials
MAX_AGE_DAYS = 7.0  # a nightly job that stays off measures again once a week
NEW_TOKENS_KEPT = 256  # the window Policy.expected_new_tokens averages over


class Remembered(NamedTuple):
    """What PolicyMemory.load gives back (empty where nothing was kept), for ActorPolicy.start_from."""
    costs: dict[int, Costs]
    prior: Acceptance | None
    new_tokens: list[int]
    source: str | None  # which run measured it: "job ... at ..."
    points: dict[int, list[tuple[float, float]]]  # vllm: clean steps per arm (k: 0 plain), (rows, seconds)
    prefill_row_token_s: tuple[float, float] | None  # vllm: a prompt token's cost per row (target, draft)


def _steps(points: dict[int, list[tuple[float, float]]] | None, prefill: tuple[float, float] | None) -> dict:
    """The clean steps and prompt costs as the costs file holds them."""
    return {"points": {str(k): [list(p) for p in kept] for k, kept in (points or {}).items()},
            "prefill_row_token_s": list(prefill) if prefill else None}


def _measured(costs: dict[int, Costs], steps: dict) -> dict:
    """The costs file's measurements as plain data: what is written, and whether a run changed them."""
    return {"costs": {b: asdict(c) for b, c in costs.items()}, "steps": steps}


class PolicyMemory:
    """Load and save one job's policy memory on this node (module docstring)."""

    def __init__(self, root: Path, costs_key: dict, job_key: dict):
        self.root, self.costs_key, self.job_key = root, costs_key, job_key
        self.costs_path = root / f"costs-{digest(costs_key)}.json"
        self.job_path = root / f"job-{digest(job_key)}.json"
        self._costs_loaded: tuple[dict, str, str] | None = None  # (costs as loaded, measured by, at)

    @classmethod
    def for_spec(cls, spec, backend: str) -> PolicyMemory | None:
        """The memory of this job on this node, or None when remembering is off (spec or node)."""
        root = memory_root()
        if root is None or not spec.speculation.remember:
            return None
        return cls(root, *memory_keys(spec, backend))

    def _read(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("policy memory %s could not be read (%s); measuring as for a new job", path, e)
            return None

    def load(self) -> Remembered:
        """What was kept; empty, with one warning, where unreadable or malformed. Costs and steps
        measured over MAX_AGE_DAYS ago are dropped: the run measures them again."""
        costs: dict[int, Costs] = {}
        points: dict[int, list[tuple[float, float]]] = {}
        prior, new_tokens, source = None, [], None
        prefill: tuple[float, float] | None = None
        try:
            data = self._read(self.costs_path)
            age = datetime.now(UTC) - datetime.fromisoformat(data["measured_at"]) if data else None
            if age is not None and age > timedelta(days=MAX_AGE_DAYS):
                log.info("policy memory %s was measured %.1f days ago (more than %g); measuring again",
                         self.costs_path.name, age.total_seconds() / 86400, MAX_AGE_DAYS)
            elif data:
                costs = {int(b): Costs.from_json(c) for b, c in data["costs"].items()}
                steps = data.get("steps") or {}
                points = {int(k): [(float(r), float(s)) for r, s in kept] for k, kept in steps.get("points", {}).items()}
                if steps.get("prefill_row_token_s"):
                    target, draft = steps["prefill_row_token_s"]
                    prefill = (float(target), float(draft))
                source = f"job {data['job_id']} at {data['measured_at']}"
                self._costs_loaded = (_measured(costs, _steps(points, prefill)), data["job_id"], data["measured_at"])
            data = self._read(self.job_path)
            if data:
                a = data["acceptance"]
                if a["trials"] > 0:
                    scale = min(1.0, PRIOR_TRIALS / a["trials"])
                    prior = Acceptance(accepted=a["accepted"] * scale, trials=a["trials"] * scale)
                new_tokens = [int(n) for n in data["new_tokens"]][-NEW_TOKENS_KEPT:]
                source = source or f"job {data['job_id']} at {data['measured_at']}"
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("policy memory under %s is malformed (%s: %s); measuring as for a new job",
                        self.root, type(e).__name__, e)
            self._costs_loaded = None
            return Remembered({}, None, [], None, {}, None)
        return Remembered(costs, prior, new_tokens, source, points, prefill)

    def save(self, costs: dict[int, Costs], prior: Acceptance, new_tokens: list[int], job_id: str,
             points: dict[int, list[tuple[float, float]]] | None = None,
             prefill_row_token_s: tuple[float, float] | None = None) -> None:
        """Write both files (atomically each). Costs (and steps) this run left as they were keep the
        stamp of the run that measured them, which is what their age counts from. A failure to write
        is a warning, never a failed shard."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if costs:
                data = _measured(costs, _steps(points, prefill_row_token_s))
                loaded, by, at = self._costs_loaded or (None, job_id, now)
                if data != loaded:
                    by, at = job_id, now
                self._write(self.costs_path, {"job_id": by, "measured_at": at, "key": readable(self.costs_key), **data})
                self._costs_loaded = (data, by, at)
            if prior.trials > 0 or new_tokens:
                key = {**self.job_key, "costs": readable(self.costs_key)}
                self._write(self.job_path, {"job_id": job_id, "measured_at": now, "key": key,
                                            "acceptance": {"accepted": prior.accepted, "trials": prior.trials},
                                            "new_tokens": new_tokens[-NEW_TOKENS_KEPT:]})
        except OSError as e:
            log.warning("policy memory could not be written under %s (%s); the next run measures again",
                        self.root, e)

    @staticmethod
    def _write(path: Path, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
