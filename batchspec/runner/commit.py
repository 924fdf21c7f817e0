"""Commit a shard: its rows as one part file (whole or nothing), then its manifest. The last stage."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..errors import error_line
from ..rates import acceptance_rate
from .logs import log_event
from .read import prompt_hash
from .schema import OUTPUT_SCHEMA
from .store import OutputStore, now_iso

if TYPE_CHECKING:
    from ..engine.api import Backend, Completion
    from ..policy import Costs, Decision
    from .plan import Shard
    from .work import RowInput, ShardWork

log = logging.getLogger("batchspec.worker")


def commit_shard(work: ShardWork, store: OutputStore, engine: Backend, job_id: str, worker: str,
                 backend_note: str | None, costs: Costs | None, saving: dict | None = None) -> dict:
    """Write the shard's part (whole or nothing), then its manifest; returns the manifest. saving:
    what speculation saved on its rows, measured in the run (vllm; policy.measured.Saving)."""
    shard, rows_in = work.shard, work.rows_in
    rows_out = [output_row(shard, r, work.results.get(r.row_index), work.attempt, engine, worker) for r in work.rows]
    t1 = time.perf_counter()
    try:
        part = store.write_part(shard.shard, pa.Table.from_pylist(rows_out, schema=OUTPUT_SCHEMA))
    except Exception as e:
        raise RuntimeError(f"cannot write {store.url}/{store.part_name(shard.shard)}: "
                           f"{error_line(e)}") from e
    t_write = time.perf_counter() - t1
    tokens = {key: sum(r[key] for r in rows_out) for key in
              ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "spec_rounds")}
    manifest = {
        **work.base, "status": "done", "backend": engine.name,
        **({"backend_note": backend_note} if backend_note else {}), "rows_in": rows_in, "rows_out": part["rows"],
        "part": part["part"], "part_bytes": part["bytes"], "error_rows": sum(r["finish_reason"] == "error" for r in rows_out),
        "error_kinds": _count_errors(rows_out), "tokens": tokens, "decisions": [d.to_json() for d in work.decisions],
        "timings": {"read_s": work.read_s, "calibrate_s": work.calibrate_s, "generate_s": work.gen_s,
                    "write_s": t_write, "total_s": work.read_s + work.calibrate_s + work.gen_s + t_write},
        "costs": costs.__dict__ if costs else None, "saving": saving, "finished_at": now_iso(),
    }
    store.write_manifest(shard.shard, manifest)
    log_event(log, "shard done", job=job_id, shard=shard.shard, rows=manifest["rows_out"],
              error_rows=manifest["error_rows"], completion_tokens=tokens["completion_tokens"],
              seconds=round(manifest["timings"]["total_s"], 2))
    for r in rows_out_errors(rows_out):
        log_event(log, f"error row: {r['error']}", logging.WARNING, job=job_id, shard=shard.shard,
                  row=r["id"], prompt_sha256=r["prompt_sha256"])
    return manifest


def output_row(shard: Shard, r: RowInput, result: tuple[Completion, Decision, int] | None, attempt: int,
               engine: Backend, worker: str) -> dict:
    """One output row (schema v1, runner/store.py): a completion with its stats, or an error row."""
    base = {"id": r.id, "shard": shard.shard, "row_index": r.row_index, "attempt": attempt, "worker": worker,
            "target_model": engine.target_source, "prompt_sha256": prompt_hash(r.prompt) if r.prompt else None,
            "prompt_tokens": len(r.token_ids)}
    if result is None:
        return {**base, "completion": None, "finish_reason": "error", "error": r.error, "completion_tokens": 0,
                "spec_enabled": False, "draft_kind": None, "num_speculative_tokens": None, "draft_tokens": 0,
                "accepted_tokens": 0, "spec_rounds": 0, "acceptance_rate": None, "ttft_s": 0.0, "latency_s": 0.0,
                "batch_size": 0, "draft_model": None}
    out, decision, batch_size = result
    s = out.stats
    # A vllm call that measured speculative steps and then kept plain ones: its rows were drafted for.
    on = decision.speculate or s.draft_tokens > 0
    k = decision.k if decision.speculate else decision.figures.k
    return {**base, "completion": out.text, "finish_reason": s.finish_reason, "error": None,
            "completion_tokens": s.completion_tokens, "spec_enabled": on, "draft_kind": engine.draft_kind if on else None,
            "num_speculative_tokens": k if on else None, "draft_tokens": s.draft_tokens,
            "accepted_tokens": s.accepted_tokens, "spec_rounds": s.spec_rounds,
            "acceptance_rate": acceptance_rate(s.accepted_tokens, s.draft_tokens) if on else None,
            "ttft_s": s.ttft_s, "latency_s": s.latency_s, "batch_size": batch_size,
            "draft_model": engine.draft_source if on else None}


def rows_out_errors(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["finish_reason"] == "error"]


def _count_errors(rows: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for r in rows_out_errors(rows):
        kind = r["error"].split(" (")[0].split(";")[0]
        kind = "duplicate id" if kind.startswith("duplicate id") else kind
        kind = "prompt too long" if kind.startswith("prompt has") else kind
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def earlier_errors(previous: dict) -> list[dict]:
    """A shard's failures before this attempt, oldest first: its manifest's own list, and its last
    attempt's error when that failed. Kept in every later manifest, so a shard committed on its
    rerun still says why it failed before (`status`, `report`)."""
    kept = list(previous.get("earlier_errors") or [])
    if previous.get("status") == "failed" and previous.get("error"):
        kept.append({"job_id": previous.get("job_id"), "error": previous["error"], "at": previous.get("finished_at")})
    return kept


def fail_shard(store: OutputStore, job_id: str, worker: str, shard: Shard, e: Exception, base: dict | None = None) -> dict:
    """The shard's failed manifest, written when the store can be reached at all; returned either way.
    base: the attempt's manifest so far (ShardWork.base), whose attempt count and earlier errors it keeps."""
    error = error_line(e)
    log_event(log, f"shard failed: {error}", logging.ERROR, job=job_id, shard=shard.shard)
    kept = {k: base[k] for k in ("attempts", "earlier_errors") if base and k in base}
    manifest: dict[str, Any] = {"shard": shard.shard, "job_id": job_id, "status": "failed", "error": error,
                "input": shard.fingerprint, "worker": worker, "finished_at": now_iso(), **kept}
    try:
        store.write_manifest(shard.shard, manifest)
    except Exception as write_error:
        manifest["error"] += f" (and its manifest could not be written: {type(write_error).__name__})"
    return manifest


def committed_already(store: OutputStore, shard: Shard, spec_hash: str, job_id: str) -> tuple[bool, dict]:
    """(whether the shard is committed for this spec and input, its manifest or {}). It can be,
    since the driver planned it: a call retried after its actor died past this shard's commit, or
    a run that planned while the run it forced away still committed. Such a shard is not
    generated again."""
    previous = store.read_json(store.manifest_path(shard.shard)) or {}
    done = store.shard_done(shard, previous, spec_hash)
    if done:
        log_event(log, "shard already committed, not generated again", job=job_id, shard=shard.shard,
                  by=previous.get("job_id"))
    return done, previous
