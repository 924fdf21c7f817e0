"""The output store: part files and manifests under one output path, local or s3://.

    <output>/data/part-<shard>.parquet         one per committed shard, never partial
    <output>/_batchspec/job.json               spec snapshot (secrets masked), hashes, versions
    <output>/_batchspec/shards/<shard>.json    status, attempts, rows, errors, policy, timings
    <output>/_batchspec/_SUCCESS               written last, when every shard is committed

Every write is staged in a local temporary file and then published with one upload (S3 PUT, which
is atomic per object) or one rename (local). fsspec closes, and so publishes, a file even when the
code writing it raised, so nothing is ever streamed straight to its final key.

Parts sit in data/, apart from the metadata, so every reader opens <output>/data (or the glob
<output>/data/*.parquet) as a plain directory of Parquet files: polars refuses a directory that
holds any other file, _batchspec/ included. Outputs written before data/ existed (parts at the
top) are still read and counted as committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import error_line
from .plan import safe_name

if TYPE_CHECKING:
    from .plan import Shard

SCHEMA_VERSION = 1

# Output row, schema v1 (also schemas/output-v1.schema.json; a test keeps both in sync).
OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("completion", pa.string()),  # null for error rows
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
    pa.field("error", pa.string()),  # why the row is an error row, else null
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("spec_enabled", pa.bool_(), nullable=False),
    pa.field("draft_kind", pa.string()),  # null when speculation is off for the row
    pa.field("num_speculative_tokens", pa.int32()),  # k the shard's policy chose; null when off
    pa.field("draft_tokens", pa.int32(), nullable=False),  # proposed
    pa.field("accepted_tokens", pa.int32(), nullable=False),
    pa.field("spec_rounds", pa.int32(), nullable=False),
    pa.field("acceptance_rate", pa.float64()),  # accepted / draft tokens; null when off
    pa.field("ttft_s", pa.float64(), nullable=False),
    pa.field("latency_s", pa.float64(), nullable=False),
    pa.field("batch_size", pa.int32(), nullable=False),
    pa.field("attempt", pa.int32(), nullable=False),
    pa.field("worker", pa.string(), nullable=False),
    pa.field("target_model", pa.string(), nullable=False),
    pa.field("draft_model", pa.string()),
    pa.field("prompt_sha256", pa.string()),  # null when the prompt could not be read
], metadata={"batchspec.schema_version": str(SCHEMA_VERSION)})


def output_schema_json() -> dict:
    """OUTPUT_SCHEMA as a small JSON document (what schemas/output-v1.schema.json holds)."""
    return {
        "title": "batchspec output row",
        "version": SCHEMA_VERSION,
        "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in OUTPUT_SCHEMA],
    }


# What the runner and `status` read of a manifest to count its shard (store.manifests(keep=...)).
COUNTED = ("shard", "status", "part", "rows_out", "error_rows", "error", "attempts", "input", "spec_hash", "tokens")


class OutputStore:
    def __init__(self, path: str, storage_options: dict | None = None):
        self.url = path.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        self.is_s3 = bool({"s3", "s3a"} & set(_protocols(self.fs)))

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

    def writable_problem(self) -> str | None:
        """Why nothing can be written at this output, found by trying (None when it can)."""
        if self.is_local:
            path = os.path.abspath(self.root)
            probe = path
            while not os.path.exists(probe):
                probe = os.path.dirname(probe)
            if not os.path.isdir(probe):
                return f"output {self.url} is under {probe}, which is a file, not a directory"
            if not os.access(probe, os.W_OK | os.X_OK):
                return f"output {self.url} cannot be created or written: no write permission on {probe}"
            if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
                return f"output {self.url} is not writable (no write permission)"
            return None
        probe = self.meta_path(f".write-probe-{uuid.uuid4().hex[:8]}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm(probe)
        except Exception as e:
            return f"output {self.url} is not writable: {error_line(e)}"
        return None

    # writes ----------------------------------------------------------------------------------
    def _publish(self, local_file: str, dest: str) -> None:
        """One upload or one rename: the destination appears whole or not at all."""
        parent = dest.rsplit("/", 1)[0]
        if self.is_local:
            os.makedirs(parent, exist_ok=True)
            staged = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
            self.fs.put_file(local_file, staged)
            os.replace(staged, dest)
        else:
            self.fs.put_file(local_file, dest)
            self.fs.invalidate_cache(parent)

    def write_part(self, shard: str, table: pa.Table) -> dict:
        with tempfile.TemporaryDirectory(prefix="batchspec-part-") as tmp:
            local = os.path.join(tmp, "part.parquet")
            pq.write_table(table, local, compression="zstd")
            size = os.path.getsize(local)
            self._publish(local, self.part_path(shard))
        return {"part": self.part_name(shard), "rows": table.num_rows, "bytes": size}

    def write_json(self, dest: str, obj: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="batchspec-meta-") as tmp:
            local = os.path.join(tmp, "obj.json")
            with open(local, "w") as f:
                json.dump(obj, f, indent=2, sort_keys=True, default=str)
            self._publish(local, dest)

    def create_exclusive(self, dest: str, obj: Any) -> bool:
        """Write dest only if it does not exist (a hard link locally, If-None-Match: * on S3).
        Returns False when it already exists."""
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        if self.is_local:
            with _folder_lock(dest):  # not between another writer's compare and its replace
                return self._link_new(dest, data)
        try:
            self.fs.pipe_file(dest, data, mode="create")
            return True
        except Exception:
            self.fs.invalidate_cache(dest)
            if self.fs.exists(dest):
                return False
            raise

    @staticmethod
    def _link_new(dest: str, data: bytes) -> bool:
        # Written whole under a private name, then linked into place: link() fails if dest
        # exists, and a reader never sees dest half written.
        folder = dest.rsplit("/", 1)[0]
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".create-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, dest)
                return True
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: O_EXCL, briefly visible empty
                try:
                    fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
        finally:
            os.unlink(tmp)

    def delete(self, dest: str) -> None:
        try:
            self.fs.rm(dest)
        except FileNotFoundError:
            pass

    def delete_if(self, dest: str, tag: str | None) -> bool:
        """Delete dest only if it is still the version read_json_tagged tagged (False when it is
        not): under the folder's lock locally, a DELETE with If-Match on S3. Without a tag, as
        delete."""
        if tag is None:
            self.delete(dest)
            return True
        if self.is_local:
            with _folder_lock(dest):
                if _local_tag(dest) != tag:
                    return False
                os.unlink(dest)
                return True
        if not self.is_s3:
            self.delete(dest)
            return True
        bucket, key, _ = self.fs.split_path(dest)
        try:
            self._s3("delete_object", Bucket=bucket, Key=key, IfMatch=tag)
        except FileNotFoundError:
            return False
        except Exception as e:
            if _precondition_failed(e):
                return False
            # A store that refuses conditional deletes (older S3-compatible servers): as delete.
            self.delete(dest)
        finally:
            self.fs.invalidate_cache(dest)
        return True

    def _s3(self, method: str, **kwargs):
        """One S3 API call through the store's s3fs client (its endpoint, credentials, retries)."""
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def write_manifest(self, shard: str, manifest: dict) -> None:
        self.write_json(self.manifest_path(shard), manifest)

    def write_job(self, job: dict) -> None:
        self.write_json(self.meta_path("job.json"), job)

    def mark_success(self, summary: dict) -> None:
        self.write_json(self.meta_path("_SUCCESS"), summary)

    def clear_success(self) -> None:
        self.delete(self.meta_path("_SUCCESS"))

    # reads -----------------------------------------------------------------------------------
    def read_json(self, path: str) -> dict | None:
        # One whole-object GET: a buffered open() on S3 pins the ETag it saw and fails when the
        # object is replaced between its HEAD and its ranged read, which a live lease's
        # heartbeat does every few seconds.
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def read_json_tagged(self, path: str) -> tuple[dict | None, str | None]:
        """The object and a tag of the version read, for replace_json_if and delete_if: its ETag
        on S3, from the same GET as its bytes; locally a hash of the bytes read; None on other
        stores (which then cannot compare)."""
        if self.is_local:
            data = _local_bytes(path)
            return (None, None) if data is None else (json.loads(data), _bytes_tag(data))
        if not self.is_s3:
            return self.read_json(path), None
        from fsspec.asyn import sync

        async def get(bucket: str, key: str) -> tuple[bytes, str]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await response["Body"].read(), response["ETag"]
            finally:
                response["Body"].close()

        bucket, key, _ = self.fs.split_path(path)
        try:
            data, etag = sync(self.fs.loop, get, bucket, key)
        except FileNotFoundError:
            return None, None
        return json.loads(data), etag

    def replace_json_if(self, dest: str, obj: Any, tag: str | None) -> bool:
        """Replace dest only if it is still the version read_json_tagged tagged, else return
        False: a conditional PUT (If-Match) on S3, whose 412 returns False; locally the compare
        and the rename under the folder's lock, which every conditional writer of the output's
        metadata takes. Without a tag (other stores) the write is unconditional, as write_json's."""
        if self.is_local and tag is not None:
            with _folder_lock(dest):
                if _local_tag(dest) != tag:
                    return False
                self.write_json(dest, obj)
                return True
        if tag is None or not self.is_s3:
            self.write_json(dest, obj)
            return True
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        try:
            self.fs.pipe_file(dest, data, IfMatch=tag)
            return True
        except OSError as e:
            if _precondition_failed(e):
                self.fs.invalidate_cache(dest)
                return False
            raise

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
        out = {}  # a cat per 1,000: on S3 their GETs run concurrently (1,200 one by one took 66 s)
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
        # One thread, and ParquetFile rather than pq.read_table: decoding a Python file object in
        # pyarrow's threads can leave a column reader to be freed on one of them while the
        # interpreter shuts down, which aborts the process ("terminate called without an active
        # exception", exit 134; pyarrow 26, apache/arrow#33975). read_table aborted a script 9 times
        # in 10; threaded ParquetFile.read() 6 in 20 in a script that had imported torch.
        with self.fs.open(self._part_of(shard, manifest), "rb") as f:
            return pq.ParquetFile(f).read(columns=list(columns) if columns else None, use_threads=False)


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


@contextlib.contextmanager
def _folder_lock(dest: str):
    """An exclusive flock on dest's folder for a compare-and-write among the processes that share
    this filesystem (the folder, not dest: dest is replaced by rename, and a lock on the file
    replaced would guard nothing). Where flock is unsupported the write goes on unlocked."""
    folder = os.path.dirname(dest) or "."
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _local_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _bytes_tag(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _local_tag(path: str) -> str | None:
    """The tag read_json_tagged gives the file as it is now; None when it is gone."""
    data = _local_bytes(path)
    return None if data is None else _bytes_tag(data)


def _precondition_failed(e: BaseException | None) -> bool:
    """An S3 conditional write refused (HTTP 412), as s3fs raises it: an OSError over botocore's
    ClientError with the code PreconditionFailed."""
    for _ in range(8):  # down the exception's chain
        if e is None:
            return False
        response = getattr(e, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if code in ("PreconditionFailed", "412") or "pre-condition" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _protocols(fs) -> tuple:
    p = fs.protocol
    return p if isinstance(p, tuple) else (p,)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
