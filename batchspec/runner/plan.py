"""Plan: list the input Parquet files and cut them into shards.

A shard is a whole file, or a row range of a file with more than max_rows_per_shard rows (cut at
row-group boundaries where possible). Shard ids come from the file name, e.g. "prompts-0003" or
"prompts-0003-r2" for its third slice, so a person can tell which input a part came from, and the
same input always gives the same ids. Each file gets a fingerprint (path, size, etag or mtime)
so a rerun can tell whether the input of a committed shard changed.
"""

from __future__ import annotations

import posixpath
from dataclasses import asdict, dataclass

import fsspec
import pyarrow.parquet as pq

from ..errors import BatchspecError, error_line


def safe_name(name: str) -> str:
    """Shard ids become file names: only [A-Za-z0-9._-], never '..', so none escapes the output dir."""
    cleaned = "".join(c if (c.isalnum() or c in "._-") else "_" for c in name).strip("._") or "shard"
    return cleaned.replace("..", "_")


class PlanError(BatchspecError, ValueError):
    """The input cannot be planned (nothing there, not reachable); str() says what to check."""


@dataclass
class Shard:
    shard: str  # id, also the part name's stem
    path: str  # fsspec path of the input file (with protocol, e.g. s3://bucket/key)
    row_start: int
    row_end: int  # exclusive; -1 when the file's footer could not be read (the shard will fail)
    fingerprint: dict
    plan_error: str | None = None  # set when the file could not even be opened at plan time

    @property
    def rows(self) -> int:
        return max(self.row_end - self.row_start, 0)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Shard:
        return cls(**data)

    def has_every_row(self, manifest: dict) -> bool:
        """The manifest holds as many rows as this shard's input has now."""
        return manifest.get("rows_out") == self.rows

    def is_stale(self, manifest: dict | None, *spec_hashes: str) -> bool:
        """The manifest is missing, or was written from other input or another spec (a hash not
        among the spec's: this version's, and the one its output recorded before paths were normalised)."""
        return not manifest or manifest.get("input") != self.fingerprint or manifest.get("spec_hash") not in spec_hashes


def list_input_files(path: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, list[str], str]:
    """(filesystem, sorted Parquet file paths, root) for a file, a directory/prefix or a glob."""
    try:
        fs, root = fsspec.core.url_to_fs(path, **(storage_options or {}))
    except Exception as e:  # bad protocol, missing s3fs, malformed URL
        raise PlanError(f"cannot open input {path}: {e}") from e
    try:
        if any(ch in root for ch in "*?["):
            files = fs.glob(root)
            root = root.split("*")[0].rsplit("/", 1)[0]
        elif fs.isdir(root):
            files = [f for f in fs.find(root) if f.endswith((".parquet", ".pq"))]
        elif fs.exists(root):
            files = [root]
            root = posixpath.dirname(root)
        else:
            raise PlanError(f"input {path} does not exist")
    except PlanError:
        raise
    except Exception as e:  # permission, endpoint unreachable, ...
        raise PlanError(f"cannot list input {path}: {error_line(e)}") from e
    files = sorted(f for f in files if not posixpath.basename(f).startswith(("_", ".")))
    if not files:
        raise PlanError(f"no Parquet files under {path}")
    return fs, files, root


def fingerprint(fs, path: str) -> dict:
    info = fs.info(path)
    fp = {"path": path, "size": int(info.get("size") or 0)}
    etag = info.get("ETag") or info.get("etag")
    if etag:
        fp["etag"] = str(etag).strip('"')
    else:
        mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
        fp["mtime"] = str(mtime)
    return fp


def _file_ids(files: list[str], root: str) -> list[str]:
    """Id stems from file names; where two files share a name, from their paths below the root."""
    stems = [posixpath.splitext(posixpath.basename(f))[0] for f in files]
    if len(set(stems)) == len(stems):
        return [safe_name(s) for s in stems]
    rel = [posixpath.splitext(posixpath.relpath(f, root) if root else f)[0] for f in files]
    return [safe_name(r.replace("/", "_")) for r in rel]


def plan_shards(path: str, storage_options: dict | None = None, max_rows_per_shard: int | None = None) -> list[Shard]:
    """The shards of every input file, in the listing's order. Each file's footer is read on one of
    a few threads: on S3 one file after another is a round trip or three each (a rerun of 1,200
    files spent minutes here)."""
    from concurrent.futures import ThreadPoolExecutor

    fs, files, root = list_input_files(path, storage_options)
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]

    def shards_of(stem: str, f: str) -> list[Shard]:
        url = f if proto in ("file", "local") else f"{proto}://{f}"
        fp = fingerprint(fs, f)
        try:
            with fs.open(f, "rb") as fh:
                meta = pq.ParquetFile(fh).metadata
        except Exception as e:  # corrupt or truncated file: this shard fails alone, the plan goes on
            return [Shard(stem, url, 0, -1, fp, plan_error=f"unreadable Parquet file: {error_line(e)}")]
        return [Shard(stem if end - start == meta.num_rows else f"{stem}-r{i}", url, start, end, fp)
                for i, (start, end) in enumerate(_slices(meta, max_rows_per_shard))]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return [s for group in pool.map(shards_of, _file_ids(files, root), files) for s in group]


def _slices(meta, max_rows: int | None) -> list[tuple[int, int]]:
    """Row ranges of at most max_rows, cut at row-group boundaries, or inside a row group too big."""
    total = meta.num_rows
    if not max_rows or total <= max_rows:
        return [(0, total)]
    cuts, start, cursor = [], 0, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        if cursor + n - start > max_rows and cursor > start:
            cuts.append((start, cursor))
            start = cursor
        cursor += n
        while cursor - start > max_rows:  # a single row group larger than max_rows
            cuts.append((start, start + max_rows))
            start += max_rows
    if cursor > start:
        cuts.append((start, cursor))
    return cuts


def input_fingerprint(shards: list[Shard]) -> dict:
    """{path: fingerprint} over all input files (job.json records it)."""
    return {s.path: s.fingerprint for s in shards}
