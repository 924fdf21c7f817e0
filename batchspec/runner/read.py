"""Read a shard and turn its rows into prompts or error rows: the first stage of a shard's work.

A row problem (null, empty, not text, invalid UTF-8, a failed template, a duplicate or null id)
makes that row an error row, never fails the shard; only a file that cannot be read, or lacks a
required column, fails it (ShardReadError)."""

from __future__ import annotations

import hashlib
import string
from typing import TYPE_CHECKING

import pyarrow as pa

from ..errors import error_line
from ..spec import JobSpec
from .objects import parquet_file
from .plan import Shard
from .work import RowInput

if TYPE_CHECKING:
    from ..engine.api import Backend


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class ShardReadError(RuntimeError):
    """The shard's file cannot be read or lacks a required column: the shard fails, alone."""


def read_shard(shard: Shard, spec: JobSpec, columns: list[str] | None = None) -> pa.Table:
    """The shard's rows (the columns the job needs, or those named), read with pyarrow through fsspec."""
    import fsspec

    if shard.plan_error:
        raise ShardReadError(f"{shard.path}: {shard.plan_error}")
    columns = columns or needed_columns(spec)
    try:
        fs, path = fsspec.core.url_to_fs(shard.path, **spec.input.storage_options)
        with parquet_file(fs, path) as pf:
            names = pf.schema_arrow.names
            missing = [c for c in columns if c not in names]
            if missing:
                raise ShardReadError(f"{shard.path}: missing column(s) {missing}; the file has {names}")
            groups, first_row, cursor = [], None, 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if cursor + n > shard.row_start and cursor < shard.row_end:
                    groups.append(g)
                    first_row = cursor if first_row is None else first_row
                cursor += n
            # One thread, as OutputStore.read_part (objects.parquet_file).
            table = (pf.read_row_groups(groups, columns=columns, use_threads=False) if groups
                     else pf.schema_arrow.empty_table().select(columns))
    except ShardReadError:
        raise
    except Exception as e:
        raise ShardReadError(f"{shard.path}: cannot read Parquet: {error_line(e)}") from e
    if groups and first_row is not None:  # first_row: where the first group read starts
        table = table.slice(shard.row_start - first_row, shard.rows)
    return table


def tokenized_rows(table: pa.Table, shard: Shard, spec: JobSpec, engine: Backend) -> tuple[list[RowInput], list[RowInput]]:
    """(every row in input order, the rows to generate, shortest prompt first): rows validated and
    tokenized; a prompt that leaves no room in the context becomes an error row."""
    rows = validate_rows(table, shard, spec, engine.tokenizer)
    valid = [r for r in rows if r.error is None]
    for r, ids in zip(valid, engine.tokenize([r.prompt for r in valid if r.prompt is not None]) if valid else []):
        r.token_ids = ids
        if len(ids) >= engine.max_context:
            r.error = f"prompt has {len(ids)} tokens; the model's context is {engine.max_context}" + engine.context_note
    return rows, sorted((r for r in rows if r.error is None), key=lambda r: len(r.token_ids))  # less padding


def needed_columns(spec: JobSpec) -> list[str]:
    cols = [spec.input.prompt_column]
    if spec.input.id_column:
        cols.append(spec.input.id_column)
    if spec.input.template:
        for _, name, _, _ in string.Formatter().parse(spec.input.template):
            if name and name not in cols:
                cols.append(name)
    return cols


def validate_rows(table: pa.Table, shard: Shard, spec: JobSpec, tokenizer) -> list[RowInput]:
    """Turn each input row into a prompt or an error row; never raises for row-level problems."""
    inp = spec.input
    rows: list[RowInput] = []
    seen: dict[str, int] = {}
    for i, (rec, bad) in enumerate(_records(table)):
        row_index = shard.row_start + i
        raw_id = rec.get(inp.id_column) if inp.id_column else f"{shard.shard}:{row_index}"
        row_id = str(raw_id) if raw_id is not None else f"{shard.shard}:{row_index}"
        prompt, error = (None, bad) if bad else _prompt_of(rec, spec, tokenizer)
        if inp.id_column and raw_id is None:
            error = error or f"null id in column '{inp.id_column}'"
        if row_id in seen:
            error = f"duplicate id {row_id!r} (first at row {seen[row_id]})"
            row_id = f"{row_id}#dup{row_index}"  # keep ids unique in the output; the error says why
        else:
            seen[row_id] = row_index
        rows.append(RowInput(row_index, row_id, None if error else prompt, error))
    return rows


def _records(table: pa.Table) -> list[tuple[dict, str | None]]:
    """The rows as dicts, each with the problem that makes it an error row (or None).

    pyarrow does not check UTF-8 when a string column is written, and to_pylist raises on the
    first bad value: that must cost one row, not the shard. Only a table that fails whole is
    converted cell by cell (a bad cell becomes None and names its column)."""
    try:
        return [(rec, None) for rec in table.to_pylist()]
    except Exception:  # UnicodeDecodeError (or an Arrow error) from some cell
        pass
    out = []
    for i in range(table.num_rows):
        rec, bad = {}, []
        for name in table.column_names:
            try:
                rec[name] = table.column(name)[i].as_py()
            except Exception:
                rec[name] = None
                bad.append(name)
        out.append((rec, f"column(s) {', '.join(bad)} not valid UTF-8" if bad else None))
    return out


def _prompt_of(rec: dict, spec: JobSpec, tokenizer) -> tuple[str | None, str | None]:
    value = rec.get(spec.input.prompt_column)
    if value is None:
        return None, "null prompt"
    if spec.input.format == "chat":
        # Arrow unifies struct fields across rows, so a malformed message arrives with role/content None.
        if not isinstance(value, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
            return None, "chat prompt must be a list of {role, content} messages"
        if not value:
            return None, "empty chat prompt"
        try:
            value = tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            return None, f"chat template failed: {error_line(e)}"
    elif isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"prompt is not valid UTF-8 (byte {e.start})"
    elif not isinstance(value, str):
        return None, f"prompt is {type(value).__name__}, not text"
    if not value.strip():
        return None, "empty prompt"
    if spec.input.template:
        try:
            fields = {k: ("" if v is None else v) for k, v in rec.items()}
            fields[spec.input.prompt_column] = value
            value = spec.input.template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            return None, f"prompt template failed: {e}"
    return value, None
