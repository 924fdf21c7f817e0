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

from ..errors import error_line


def safe_name(name: str) -> str:
    """Shard ids become file names: only [A-Za-z0-9._-], never '..', so none escapes the output dir."""
    cleaned = "".join(c if (c.isalnum() or c in "._-") else "_" for c in name).strip("._") or "shard"
    return cleaned.replace("..", "_")


class PlanError(ValueError):
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

    def is_stale(self, manifest: dict | None, spec_hash: str) -> bool:
        """The manifest is missing, or was written from other input or another spec."""
        return not manifest or manifest.get("input") != self.fingerprint or manifest.get("spec_hash") != spec_hash


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


CALL_SHARDS = 8  # on vllm, the shards a call takes at least (where the job has that many per actor)


def plan_calls(todo: list[Shard], backend: str, res, vllm_args: dict) -> list[list[Shard]]:
    """The shards of each actor call, in order. hf: one shard a call. vllm: consecutive shards until
    the call holds at least CALL_SHARDS of them and as many rows as vLLM runs at once (max_num_seqs,
    256 unless vllm_args says), never more than an equal share of the job per actor (of the most
    actors the pool may grow to), so no actor idles while another holds a backlog. Shards with one
    decision share an engine call, and a job of many small files still fills vLLM's batch (200
    files of 2 rows: two calls of 256 and 144 rows, not 25 of 16).
    resources.shards_per_call: that many shards a call, always."""
    if res.shards_per_call or backend != "vllm":
        n = res.shards_per_call or 1
        return [todo[i:i + n] for i in range(0, len(todo), n)]
    share, rows_wanted = -(-len(todo) // res.most_actors), int(vllm_args.get("max_num_seqs", 256))
    calls, call, rows = [], [], 0
    for shard in todo:
        call.append(shard)
        rows += shard.rows
        if len(call) >= share or (len(call) >= CALL_SHARDS and rows >= rows_wanted):
            calls.append(call)
            call, rows = [], 0
    return calls + ([call] if call else [])


BLOCK_ROWS = 256  # a Ray Data block (one task) holds calls until it has this many rows
BLOCKS_PER_ACTOR = 4  # ... and the job has at least this many blocks per actor


def calls_per_block(calls: list[list[Shard]], actors: int) -> int:
    """How many consecutive calls one Ray Data task takes. Each task costs Ray Data ~8 ms to
    schedule here (2 cores), so calls of a few rows go several to a task: until a task holds
    BLOCK_ROWS rows (vLLM's calls already do), while the job keeps BLOCKS_PER_ACTOR tasks per actor
    for the pool to balance. 10,000 shards of 2 rows on one actor: 128 calls a task, not 1."""
    if not calls:
        return 1
    mean_rows = sum(s.rows for call in calls for s in call) / len(calls)
    wanted = max(1, round(BLOCK_ROWS / max(1.0, mean_rows)))
    return max(1, min(wanted, len(calls) // (BLOCKS_PER_ACTOR * max(1, actors))))
