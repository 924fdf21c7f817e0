"""`batchspec validate`: check a job without generating anything.

Checks the spec (already parsed by the caller), lists the shards, checks each input file's columns
and their types, resolves the target and draft (config + tokenizer, no weights), and checks the
output path against the input and against an existing job there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import error_line
from ..spec import JobSpec
from .objects import parquet_schema
from .plan import PlanError, Shard, plan_shards
from .preflight import resolve_models

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass
class Validation:
    shards: list[Shard] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _column_problem(field_type, fmt: str) -> str | None:
    import pyarrow as pa

    if fmt == "chat":
        return None if pa.types.is_list(field_type) or pa.types.is_large_list(field_type) else \
            f"is {field_type}, but format: chat needs a list of {{role, content}} structs"
    # Dictionary-encoded text is text: what pandas writes for a Categorical column (the worker reads
    # its values as strings; validate used to refuse what submit then ran).
    values = field_type.value_type if pa.types.is_dictionary(field_type) else field_type
    if any(is_(values) for is_ in (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view,
                                   pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view,
                                   pa.types.is_null)):
        return None
    return f"is {field_type}, not text (string)"


def validate_job(spec: JobSpec, check_model: bool = True) -> Validation:
    from .job import JobRefused, pick_backend
    from .read import needed_columns
    from .todo import check_paths, prepare

    v = Validation()
    try:
        check_paths(spec, probe=True)
    except JobRefused as e:
        v.problems.append(str(e))
    try:
        v.shards = plan_shards(spec.input.path, spec.input.storage_options, spec.input.max_rows_per_shard)
    except PlanError as e:
        v.problems.append(str(e))
    schemas: dict[str, pa.Schema] = {}
    for s in v.shards:
        if s.plan_error:
            v.problems.append(f"shard {s.shard}: {s.plan_error}")
            continue
        if s.path in schemas:
            continue
        schema = parquet_schema(s.path, spec.input.storage_options)
        schemas[s.path] = schema
        for col in needed_columns(spec):
            if col not in schema.names:
                v.problems.append(f"{s.path}: missing column '{col}' (columns: {', '.join(schema.names)})")
        if spec.input.prompt_column in schema.names:
            bad = _column_problem(schema.field(spec.input.prompt_column).type, spec.input.format)
            if bad:
                v.problems.append(f"{s.path}: prompt column '{spec.input.prompt_column}' {bad}")
    distinct = {tuple(sorted(zip(sc.names, map(str, sc.types)))) for sc in schemas.values()}
    if len(distinct) > 1:
        v.notes.append(f"input files have {len(distinct)} different schemas; only the job's columns are read")
    if spec.input.id_column and not v.problems:
        v.notes.extend(_repeated_ids(v.shards, spec))
    elif not spec.input.id_column and schemas:
        v.notes.append(_no_id_column(next(iter(schemas.values())).names))
    backend = None
    try:
        backend, why = pick_backend(spec)
        v.notes.append(f"backend: {backend} ({why})")
    except JobRefused as e:
        v.problems.append(str(e))
    if check_model:
        v.problems.extend(resolve_models(spec, backend or "hf", v.notes))
    if not v.problems:
        try:
            _, _, todo, _ = prepare(spec, shards=v.shards)
            v.notes.append(f"{len(todo)} of {len(v.shards)} shard(s) to run at {spec.output.path}")
        except JobRefused as e:
            v.problems.append(str(e))
        except Exception as e:  # output store unreachable
            v.problems.append(f"output {spec.output.path}: {error_line(e)}")
    return v


def _no_id_column(names: list[str]) -> str:
    """What ids rows get without input.id_column, and the input's own id-like columns, if any."""
    own = [n for n in names if n.lower() in ("id", "uid", "uuid", "key") or n.lower().endswith("_id")]
    hint = (f"; the input has {', '.join(repr(n) for n in own)}: --set input.id_column={own[0]} would use it" if own
            else "; set input.id_column to carry your own")
    return ("no input.id_column: each row's id is '<shard>:<row_index>', stable while the input files keep their "
            f"names, rows and order{hint}")


def _repeated_ids(shards: list[Shard], spec: JobSpec) -> list[str]:
    """Notes on ids that will not be unique in the output (only the id column is read): repeated
    within a shard, where the worker makes every later occurrence an error row ("duplicate id"), or
    null, where it makes the row an error row; and ids in more than one shard, where both rows are
    generated and a join of the output back to its input by id then doubles rows."""
    from collections import Counter

    from .read import ShardReadError, read_shard

    id_column = spec.input.id_column
    if id_column is None:  # ids are made from shard and row: unique by construction
        return []
    first_shard: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    within: dict[str, tuple[str, int]] = {}  # shard -> (an id repeated in it, rows that will be errors)
    nulls: dict[str, int] = {}
    for s in shards:
        try:
            ids = read_shard(s, spec, [id_column]).column(0).to_pylist()
        except ShardReadError:  # that shard fails on its own when it runs
            continue
        counts = Counter(str(x) for x in ids if x is not None)
        extra = {key: n - 1 for key, n in counts.items() if n > 1}
        if extra:
            within[s.shard] = (next(iter(extra)), sum(extra.values()))
        if None in ids:
            nulls[s.shard] = ids.count(None)
        for key in counts:
            if first_shard.setdefault(key, s.shard) != s.shard:
                repeated.setdefault(key, [first_shard[key]]).append(s.shard)
    notes = []
    if within:
        shard, (key, rows) = next(iter(within.items()))
        notes.append(f"id '{key}' is repeated within shard {shard}{_more(within, 'shards')}: {rows} row(s) there "
                     f"will be error rows ('duplicate id'); only an id's first row is generated")
    if nulls:
        shard, rows = next(iter(nulls.items()))
        notes.append(f"shard {shard}{_more(nulls, 'shards')} has {rows} row(s) with a null id in "
                     f"'{spec.input.id_column}': they will be error rows")
    if repeated:
        key, where = next(iter(repeated.items()))
        notes.append(f"id '{key}' is in shards {', '.join(where)}{_more(repeated, 'ids')}: ids repeated across "
                     f"shards are generated once per shard; use unique ids to join the output back to its input")
    return notes


def _more(found: dict, what: str) -> str:
    """' (and N more shards)' after the one a note names, when it found more."""
    return f" (and {len(found) - 1} more {what})" if len(found) > 1 else ""
