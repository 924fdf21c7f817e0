"""The output store: part files and manifests under one output path, local or s3://.

    <output>/data/part-<shard>.parquet         one per committed shard, never partial
    <output>/_batchspec/job.json               spec snapshot (secrets masked), hashes, versions
    <output>/_batchspec/shards/<shard>.json    status, attempts, rows, errors, policy, timings
    <output>/_batchspec/_SUCCESS               written last, when every shard is committed

Every file is written whole (runner/objects.py: staged locally, then one upload or one rename).

Parts sit in data/, apart from the metadata, so every reader opens <output>/data (or the glob
<output>/data/*.parquet) as a plain directory of Parquet files: polars refuses a directory that
holds any other file, _batchspec/ included. Outputs written before data/ existed (parts at the
top) are still read and counted as committed.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from .conditional import ConditionalFiles
from .objects import parquet_file
from .plan import safe_name

if TYPE_CHECKING:
    from .plan import Shard

# What the runner and `status` read of a manifest to count its shard (store.manifests(keep=...)).
COUNTED = ("shard", "status", "part", "rows_out", "error_rows", "error", "attempts", "input", "spec_hash", "tokens",
           "earlier_errors")


class OutputStore(ConditionalFiles):
    """One output's layout (above) on its whole-file writes (ObjectFiles): parts, manifests, the
    job record and _SUCCESS, and the one answer to "is this shard committed"."""

    # paths -----------------------------------------------------------------------------------
    def part_name(self, shard: str) -> str:
        """The part's path under the output (what manifests record)."""
        return f"data/part-{safe_name(shard)}.parquet"

    def part_path(self, shard: str) -> str:
        return f"{self.root}/{self.part_name(shard)}"

    @staticmethod
    def _legacy_name(shard: str) -> str:
        return f"part-{safe_name(shard)}.parquet"

    def meta_path(self, *parts: str) -> str:
        return "/".join([self.root, "_batchspec", *parts])

    def manifest_path(self, shard: str) -> str:
        return self.meta_path("shards", f"{safe_name(shard)}.json")

    # writes ----------------------------------------------------------------------------------
    def write_part(self, shard: str, table: pa.Table) -> dict:
        with tempfile.TemporaryDirectory(prefix="batchspec-part-") as tmp:
            local = os.path.join(tmp, "part.parquet")
            pq.write_table(table, local, compression="zstd")
            size = os.path.getsize(local)
            self.publish(local, self.part_path(shard))
        return {"part": self.part_name(shard), "rows": table.num_rows, "bytes": size}

    def write_manifest(self, shard: str, manifest: dict) -> None:
        self.write_json(self.manifest_path(shard), manifest)

    def write_job(self, job: dict) -> None:
        self.write_json(self.meta_path("job.json"), job)

    def mark_success(self, summary: dict) -> None:
        self.write_json(self.meta_path("_SUCCESS"), summary)

    def clear_success(self) -> None:
        self.delete(self.meta_path("_SUCCESS"))

    # reads -----------------------------------------------------------------------------------
    def read_job(self) -> dict | None:
        return self.read_json(self.meta_path("job.json"))

    def has_success(self) -> bool:
        return self.fs.exists(self.meta_path("_SUCCESS"))

    def manifests(self, keep: tuple[str, ...] | None = None) -> dict[str, dict]:
        """Every shard manifest, keyed by shard id; only the `keep` fields of each, if given (a
        whole manifest is ~6 KB in memory, its decisions and costs most of it)."""
        folder = self.meta_path("shards")
        self.fs.invalidate_cache(folder)
        try:
            paths = [p for p in self.fs.ls(folder, detail=False) if p.endswith(".json")]
        except FileNotFoundError:
            return {}
        out = {}  # a cat per 1,000: on S3 their GETs run concurrently, not one by one
        for i in range(0, len(paths), 1000):
            for data in self.fs.cat(paths[i:i + 1000], on_error="omit").values():
                m = json.loads(data)
                if m and "shard" in m:
                    out[m["shard"]] = {k: m[k] for k in keep if k in m} if keep else m
        return out

    def committed(self, shard: str, manifest: dict | None, parts: set[str] | None = None) -> bool:
        """The manifest says done, names this shard's part, and the part exists (readers trust this):
        in `parts` (what part_names listed) if given, else asked for (a HEAD request on S3)."""
        if not manifest or manifest.get("status") != "done":
            return False
        if manifest.get("part") not in (self.part_name(shard), self._legacy_name(shard)):
            return False
        if parts is not None:
            return manifest["part"] in parts
        return self.part_info(shard, manifest) is not None

    def committed_manifests(self, manifests: dict[str, dict]) -> dict[str, dict]:
        """The manifests of committed shards, with every part looked up in one listing."""
        parts = part_names(self, manifests)
        return {s: m for s, m in manifests.items() if self.committed(s, m, parts)}

    def shard_done(self, shard: Shard, manifest: dict | None, spec_hash: str | None = None,
                   parts: set[str] | None = None) -> bool:
        """What a run need not redo: committed, with as many rows as the shard's input has now, and,
        given the spec hash, written by this spec from this input. The one answer to "is this shard
        done" for runs; readers without the input (report, status) ask `committed`."""
        if spec_hash is not None and shard.is_stale(manifest, spec_hash):
            return False
        return self.committed(shard.shard, manifest, parts) and shard.has_every_row(manifest or {})

    def _part_of(self, shard: str, manifest: dict | None) -> str:
        """Where the shard's part is: the name its manifest records (an output written before
        data/ records one at the top), else where this version writes it."""
        return f"{self.root}/{(manifest or {}).get('part') or self.part_name(shard)}"

    def part_info(self, shard: str, manifest: dict | None = None) -> dict | None:
        try:
            return self.fs.info(self._part_of(shard, manifest))
        except FileNotFoundError:
            return None

    def read_part(self, shard: str, manifest: dict | None = None, columns: tuple[str, ...] | None = None) -> pa.Table:
        """The shard's part, or only `columns` of it (the others are not read)."""
        # Opened by pyarrow where local, and one thread: a script that reads parts must not abort
        # at its exit (objects.parquet_file). read_table on an fsspec file aborted 9 times in 10.
        with parquet_file(self.fs, self._part_of(shard, manifest)) as pf:
            return pf.read(columns=list(columns) if columns else None, use_threads=False)


def part_names(store: OutputStore, manifests: dict[str, dict]) -> set[str]:
    """The part files under the output, named as manifests name them (data/part-….parquet), from
    one listing of data/ (a LIST request per 1,000 parts on S3); the output's top is listed too
    only when a manifest names a part there (an output written before data/)."""
    legacy = any("/" not in m.get("part", "data/") for m in manifests.values())
    out: set[str] = set()
    for folder, prefix in [("data", "data/"), *([("", "")] if legacy else [])]:
        path = f"{store.root}/{folder}".rstrip("/")
        store.fs.invalidate_cache(path)
        try:
            names = store.fs.ls(path, detail=False)
        except FileNotFoundError:
            continue
        out.update(prefix + n.rstrip("/").rsplit("/", 1)[-1] for n in names if n.endswith(".parquet"))
    return out


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
