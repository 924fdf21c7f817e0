"""The rows a draft learns from: each committed row's prompt, rendered again exactly as the runner
rendered it, and the target's completion of it.

A part keeps no prompts (only `prompt_sha256`), so each committed shard's input rows are read
again, through the runner's own reader and renderer (runner/read.py: template, chat template,
ids), and each is paired with its output row by id; the rendered prompt's hash must equal the
one the row recorded, or the input has changed since and the row is left out. What is left out
is counted, never silently dropped:

    error     an error row (no completion)
    changed   the input row is gone or renders to another prompt than the run's
    unread    the shard's input file can no longer be read

A row cut off by max_new_tokens (finish_reason "length") is kept: every token of it is the
target's own. Where a row ended on EOS (finish_reason "stop" in a job without stop strings), the
EOS is learned too; where the job has stop strings the ending token is not known (EOS or the
stop string's last token) and none is learned.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

from ..reports.output import input_group, load
from ..runner.plan import Shard
from ..runner.read import ShardReadError, prompt_hash, read_shard, validate_rows
from ..spec import JobSpec

PART_COLUMNS = ("id", "completion", "finish_reason", "prompt_sha256", "draft_tokens", "accepted_tokens")


@dataclass
class Row:
    output: str
    shard: str
    id: str
    group: str  # the input group the checks report (hive keys below the input root, or the shard)
    prompt: str
    completion: str
    ends_with_eos: bool
    acceptance: float | None  # the row's acceptance_rate in its run (None: it did not speculate)

    @property
    def key(self) -> str:
        """Stable across runs of one output: which rows are held out depends on it alone."""
        return hashlib.sha256(f"{self.shard}\0{self.id}".encode()).hexdigest()


def group_of(path: str, root: str, by: str, shard: str) -> str:
    """by 'shard': the shard; by 'dir': the hive keys below the input root (reports.output.input_group)."""
    return shard if by == "shard" else input_group(path, root)


def unmasked(spec: JobSpec, given: dict) -> JobSpec:
    """The recorded spec with usable storage options: job.json masks every value but the endpoint,
    region and the like ("***"), so those are dropped (the environment's credentials apply) and the
    options given here (--storage-option) override, for the input and the models as for the output."""
    def merged(recorded: dict) -> dict:
        return {**{k: v for k, v in recorded.items() if v != "***"}, **given}

    return spec.model_copy(update={
        "input": spec.input.model_copy(update={"storage_options": merged(spec.input.storage_options)}),
        "model": spec.model.model_copy(update={"storage_options": merged(spec.model.storage_options)})})


def committed_rows(output: str, tokenizer, group_by: str = "dir",
                   storage_options: dict | None = None) -> tuple[JobSpec, list[Row], Counter[str]]:
    """(the output's job spec, its committed rows paired with their prompts, what was left out)."""
    store, job, done, _ = load(output, storage_options)
    spec = unmasked(JobSpec.model_validate(job["spec"]), storage_options or {})
    rows: list[Row] = []
    left: Counter[str] = Counter()
    for name, m in sorted(done.items()):
        shard = Shard(name, m["path"], m["row_start"], m["row_end"], m.get("input") or {})
        part = store.read_part(name, m, columns=PART_COLUMNS).to_pylist()
        try:
            inputs = validate_rows(read_shard(shard, spec), shard, spec, tokenizer)
        except ShardReadError:
            left["unread"] += len(part)
            continue
        prompts = {r.id: r.prompt for r in inputs if r.prompt is not None}
        group = group_of(m["path"], spec.input.path, group_by, name)
        for r in part:
            if r["finish_reason"] == "error" or r["completion"] is None:
                left["error"] += 1
                continue
            prompt = prompts.get(r["id"])
            if prompt is None or prompt_hash(prompt) != r["prompt_sha256"]:
                left["changed"] += 1
                continue
            drafted = r["draft_tokens"] or 0
            rows.append(Row(output, name, r["id"], group, prompt, r["completion"],
                            r["finish_reason"] == "stop" and not spec.generation.stop,
                            r["accepted_tokens"] / drafted if drafted else None))
    return spec, rows, left
