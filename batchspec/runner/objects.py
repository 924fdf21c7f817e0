"""The files of one output, local or s3://, each written whole: staged in a local temporary file,
then published with one upload (S3 PUT, atomic per object) or one rename (local). fsspec closes,
and so publishes, a file even when the code writing it raised, so nothing is ever streamed straight
to its final key. The conditional writes the lease needs are in runner/conditional.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq


class ObjectFiles:
    """Whole-file writes and reads under one root URL (OutputStore lays its output out on them)."""

    def __init__(self, path: str, storage_options: dict | None = None):
        self.url = path.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.is_local = "file" in _protocols(self.fs)
        self.is_s3 = bool({"s3", "s3a"} & set(_protocols(self.fs)))

    # writes ----------------------------------------------------------------------------------
    def publish(self, local_file: str, dest: str) -> None:
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

    def write_json(self, dest: str, obj: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="batchspec-meta-") as tmp:
            local = os.path.join(tmp, "obj.json")
            with open(local, "wb") as f:
                f.write(json_bytes(obj))
            self.publish(local, dest)

    def delete(self, dest: str) -> None:
        try:
            self.fs.rm(dest)
        except FileNotFoundError:
            pass

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


def json_bytes(obj: Any) -> bytes:
    """How the output's metadata is written: indented, keys sorted, anything else as its str()."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str).encode()


@contextlib.contextmanager
def parquet_file(fs, path: str) -> Iterator[pq.ParquetFile]:
    """A Parquet file of `fs` to read. A local file is opened by pyarrow itself, never through a
    Python file object: pyarrow's threads then hold no Python object that the interpreter's exit
    could leave them to free, which aborts the process ("terminate called without an active
    exception", exit 134; apache/arrow#33975). Measured here (a script that imports torch and
    decodes a part 64 times, threaded): through an fsspec file 4 aborts in 20 runs, from a buffer
    of its bytes 7 in 40, opened by pyarrow 0 in 80. Other filesystems go through fsspec's file."""
    if "file" in _protocols(fs):
        with pq.ParquetFile(path) as pf:
            yield pf
    else:
        with fs.open(path, "rb") as fh:
            yield pq.ParquetFile(fh)


def parquet_schema(url: str, storage_options: dict | None = None) -> pa.Schema:
    """The Arrow schema of the Parquet file at `url` (its footer only), opened as parquet_file does."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    with parquet_file(fs, path) as pf:
        return pf.schema_arrow


def _protocols(fs) -> tuple:
    p = fs.protocol
    return p if isinstance(p, tuple) else (p,)


def _local_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _bytes_tag(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def local_tag(path: str) -> str | None:
    """The tag read_json_tagged gives the file as it is now; None when it is gone."""
    data = _local_bytes(path)
    return None if data is None else _bytes_tag(data)
