"""What a run has left to do: the shards of the input not done in the output, or a refusal.

Rerun rules (DESIGN.md): a shard is done when its manifest says so and names a part with its
input's row count. A run against an output written by a different spec, or whose done shards'
inputs changed since, is refused unless force=True: the committed parts would be stale.
"""

from __future__ import annotations

import os
import uuid

from ..errors import error_line
from ..spec import JobSpec, same_spec, spec_differences
from .outcome import JobRefused
from .plan import Shard, plan_shards
from .store import COUNTED, OutputStore


def check_paths(spec: JobSpec, probe: bool = False) -> None:
    """Refuse an output inside the input; with probe, also one that cannot be written (tried)."""
    inp, out = spec.input.path.rstrip("/*"), spec.output.path.rstrip("/")
    if out == inp or out.startswith(inp.rstrip("/") + "/"):
        raise JobRefused(f"output {spec.output.path} is inside the input {spec.input.path}; parts would be read as input")
    if probe:
        problem = writable_problem(OutputStore(spec.output.path, spec.output.storage_options))
        if problem:
            raise JobRefused(problem)


def prepare(spec: JobSpec, force: bool = False,
            shards: list[Shard] | None = None) -> tuple[OutputStore, list[Shard], list[Shard], dict]:
    """(store, all shards, shards to run, manifests); raises JobRefused on a stale or unwritable output.
    `shards` is a plan the caller already made (validate's), saving a second read of every footer."""
    check_paths(spec, probe=True)
    store = OutputStore(spec.output.path, spec.output.storage_options)
    if shards is None:
        shards = plan_shards(spec.input.path, spec.input.storage_options, spec.input.max_rows_per_shard)
    try:
        manifests = store.manifests(keep=COUNTED)
        job = store.read_job()
    except Exception as e:  # the probe wrote, but reading failed: permissions, a broken job.json
        raise JobRefused(f"cannot read the output {spec.output.path}: {error_line(e)}") from e
    # One listing of the parts (not a HEAD request per shard on S3), shared by the checks and the todo list.
    done_manifests = store.committed_manifests(manifests)
    committed = [s for s in shards if s.shard in done_manifests]
    if job and not force:
        # A changed spec is refused only where it would mix outputs: with no shard committed (e.g. every
        # shard failed to load the model), the fixed spec simply replaces the old one.
        if committed and not same_spec(job, spec):
            differ = "; ".join(spec_differences(job.get("spec") or {}, spec)) or "the same keys, hashed by another version"
            raise JobRefused(f"{spec.output.path} holds output of a different spec ({differ}); use a new output path, "
                             "or --force to overwrite shard by shard")
        changed = [s.shard for s in committed if manifests[s.shard].get("input") != s.fingerprint]
        if changed:
            raise JobRefused(
                f"input changed for {len(changed)} committed shard(s) ({', '.join(changed[:5])}); their output would be "
                "stale. Use --force to regenerate them")
    done = {s.shard for s in committed if s.has_every_row(manifests[s.shard])}  # store.shard_done, one HEAD fewer
    hashes = [spec.output_hash(), *([job["spec_hash"]] if job and job.get("spec_hash") and same_spec(job, spec) else [])]
    todo = [s for s in shards if force and s.is_stale(manifests.get(s.shard), *hashes) or s.shard not in done]
    return store, shards, todo, manifests


def input_problem(spec: JobSpec, shards: list[Shard], todo: list[Shard]) -> str | None:
    """Why no shard of a job with none done could run, found before Ray starts: every file
    unreadable at plan time, or without a column the job reads (a spec naming a column its input
    lacks). Where only some are, or some shards are done (a rerun of the ones that failed), those
    fail alone as they run, as before. One footer is read (the first runnable shard's); every other
    file's only when that one lacks a column. None when a run can go ahead."""
    from concurrent.futures import ThreadPoolExecutor

    from .objects import parquet_schema
    from .read import needed_columns

    if not todo or len(todo) < len(shards):
        return None
    files = list(dict.fromkeys(s.path for s in todo if not s.plan_error))
    if not files:
        more = f" (and {len(todo) - 1} more shard(s) alike)" if len(todo) > 1 else ""
        return f"no input file of the shards to run can be read: {todo[0].shard}: {todo[0].plan_error}{more}"
    needed = needed_columns(spec)

    def lacking(path: str) -> tuple[list[str], list[str]] | None:
        try:
            names = parquet_schema(path, spec.input.storage_options).names
        except Exception:  # the run finds it out for that shard alone
            return None
        missing = [c for c in needed if c not in names]
        return (missing, names) if missing else None

    first = lacking(files[0])
    if first is None:
        return None
    with ThreadPoolExecutor(max_workers=8) as pool:
        if not all(pool.map(lacking, files[1:])):
            return None
    more = f" (and {len(files) - 1} more file(s) alike)" if len(files) > 1 else ""
    return (f"no input file has every column the job reads: {files[0]} lacks {', '.join(map(repr, first[0]))} "
            f"(its columns: {', '.join(first[1])}){more}; set input.prompt_column, input.id_column or the "
            f"template's fields to columns the files have (`batchspec validate` lists every problem)")


def writable_problem(store: OutputStore) -> str | None:
    """Why nothing can be written at this output, found by trying (None when it can)."""
    if store.is_local:
        path = os.path.abspath(store.root)
        probe = path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            return f"output {store.url} is under {probe}, which is a file, not a directory"
        if not os.access(probe, os.W_OK | os.X_OK):
            return f"output {store.url} cannot be created or written: no write permission on {probe}"
        if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
            return f"output {store.url} is not writable (no write permission)"
        return None
    probe = store.meta_path(f".write-probe-{uuid.uuid4().hex[:8]}")
    try:
        store.fs.pipe_file(probe, b"")
        store.fs.rm(probe)
    except Exception as e:
        return f"output {store.url} is not writable: {error_line(e)}"
    return None
