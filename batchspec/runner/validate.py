"""`batchspec validate`: check a job without generating anything.

Checks the spec (already parsed by the caller), lists the shards, checks each input file's columns
and their types, resolves the target and draft (config + tokenizer, no weights), and checks the
output path against the input and against an existing job there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import error_line
from ..spec import JobSpec
from .checkpoints import checkpoint_sources
from .plan import PlanError, Shard, plan_shards


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
    import fsspec
    import pyarrow.parquet as pq

    from .job import JobRefused, check_paths, pick_backend, prepare
    from .worker import needed_columns

    v = Validation()
    try:
        check_paths(spec, probe=True)
    except JobRefused as e:
        v.problems.append(str(e))
    try:
        v.shards = plan_shards(spec.input.path, spec.input.storage_options, spec.input.max_rows_per_shard)
    except PlanError as e:
        v.problems.append(str(e))
    schemas: dict[str, list] = {}
    for s in v.shards:
        if s.plan_error:
            v.problems.append(f"shard {s.shard}: {s.plan_error}")
            continue
        if s.path in schemas:
            continue
        fs, path = fsspec.core.url_to_fs(s.path, **spec.input.storage_options)
        with fs.open(path, "rb") as fh:
            schema = pq.ParquetFile(fh).schema_arrow
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


def _repeated_ids(shards: list[Shard], spec: JobSpec) -> list[str]:
    """Notes on ids that will not be unique in the output (only the id column is read): repeated
    within a shard, where the worker makes every later occurrence an error row ("duplicate id"), or
    null, where it makes the row an error row; and ids in more than one shard, where both rows are
    generated and a join of the output back to its input by id then doubles rows."""
    from collections import Counter

    from .worker import ShardReadError, read_shard

    first_shard: dict[str, str] = {}
    repeated: dict[str, list[str]] = {}
    within: dict[str, tuple[str, int]] = {}  # shard -> (an id repeated in it, rows that will be errors)
    nulls: dict[str, int] = {}
    for s in shards:
        try:
            ids = read_shard(s, spec, [spec.input.id_column]).column(0).to_pylist()
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


def learned_draft_problem(path: str, kind: str) -> None:
    """Raise when a learned draft's checkpoint (a local dir or a hub id) has no config.json, or one
    that does not fit the kind (engine.sources.config_problem, the loaders' own check). Its config
    is not a transformers model config (Medusa's has no model_type), so AutoConfig cannot be it."""
    from transformers.utils import cached_file

    from ..engine.sources import config_problem

    problem = config_problem(kind, json.loads(open(cached_file(path, "config.json")).read()))
    if problem:
        raise ValueError(problem)


def _settled(role: str, source: str, storage_options: dict, problems: list[str]) -> bool:
    """What every check does first: an s3:// prefix must hold a config.json (checked without
    copying weights onto the driver: actors fetch them), a local path must be a checkpoint
    directory. True when that settles the source (checked, or its problem recorded)."""
    from ..engine.sources import local_source_problem

    if source.startswith("s3://"):
        import fsspec

        fs, root = fsspec.core.url_to_fs(source, **storage_options)
        if not fs.exists(f"{root.rstrip('/')}/config.json"):
            raise FileNotFoundError(f"no config.json under {source}")
        return True
    problem = local_source_problem(source)
    if problem:
        problems.append(f"{role} model: {problem}")
    return problem is not None


def local_path_problems(spec: JobSpec) -> list[str]:
    """The part of resolve_models that needs neither transformers nor the network: local paths that
    are not checkpoint directories (word for word as resolve_models words them). Instant, so a
    typo is refused before Ray starts, while the full check runs beside Ray's start."""
    from ..engine.sources import local_source_problem

    return [f"{role} model: {problem}" for role, source in checkpoint_sources(spec.model)
            if (problem := local_source_problem(source))]


def resolve_models(spec: JobSpec, backend: str = "hf", notes: list[str] | None = None) -> list[str]:
    """Load configs and tokenizers (no weights) of the target and a model draft; list problems
    (and, into `notes`, what the user should know: a sliding window limits speculation)."""
    if backend == "vllm":
        quick = local_model_problems(spec, notes)
        if quick is not None:
            return quick
    from transformers import AutoConfig, AutoTokenizer

    from ..engine.drafts import check_tokenizers_compatible
    from ..engine.models import ModelLoadError, attention_window, serving_problem

    m, problems, toks = spec.model, [], {}
    for role, source in checkpoint_sources(spec.model):
        try:
            if _settled(role, source, m.storage_options, problems):  # s3:// prefixes end here
                continue
            if role == "draft" and m.draft.kind != "model":  # learned drafts: their own config.json layouts
                learned_draft_problem(source, m.draft.kind)
                continue
            config = AutoConfig.from_pretrained(source, trust_remote_code=m.trust_remote_code)
            if role == "target" and backend == "vllm":
                _note_vllm_target(config.to_dict(), spec, notes)
            if role == "target" and backend == "hf":
                problem = serving_problem(config)
                if problem:
                    problems.append(f"target model {source!r}: {problem}")
                window = attention_window(config)
                if window is not None and m.draft.kind != "none" and notes is not None:
                    notes.append(f"target attends within a {window}-token window: rows whose prompt + max_new_tokens "
                                 f"exceed {window} tokens run without speculation (exact either way)")
            if role == "target" or m.draft.kind == "model":  # learned drafts use the target's tokenizer
                toks[role] = AutoTokenizer.from_pretrained(source, trust_remote_code=m.trust_remote_code)
        except Exception as e:
            problems.append(_unresolved(role, source, e))
    if len(toks) == 2:
        try:
            check_tokenizers_compatible(toks["target"], toks["draft"], m.draft.path)
        except ModelLoadError as e:
            problems.append(str(e))
    return problems


def _unresolved(role: str, source: str, e: Exception) -> str:
    return f"{role} model {source!r} cannot be resolved: {error_line(e)}"


def _note_vllm_target(config: dict, spec: JobSpec, notes: list[str] | None) -> None:
    """What a vllm job should know about its target before it runs: on CPU actors, latent
    attention (DeepSeek's MLA) was not exact in the architecture matrix (docs/engine.md). Auto
    picks hf there (engine/backend.py); this is for model.backend: vllm."""
    from ..engine.backend import LATENT_ON_CPU
    from .checkpoints import latent_attention

    note = f"target uses latent attention: {LATENT_ON_CPU}; model.backend: hf is exact for it"
    if notes is not None and latent_attention(config) and spec.resources.gpus_per_actor == 0 and note not in notes:
        notes.append(note)  # once, though the quick check may hand over to the full one after reading it


def local_model_problems(spec: JobSpec, notes: list[str] | None = None) -> list[str] | None:
    """resolve_models for the vllm backend without importing transformers (and with it torch: ~3.5 s
    of the driver's start-up on two cores, where nothing else on the vllm driver needs them). It
    covers local checkpoint directories whose tokenizers are tokenizer.json files, and s3:// prefixes;
    for anything else (a hub id, a tokenizer without tokenizer.json) it returns None and the full
    check runs. Configs are read as JSON: vLLM checks the model type itself when an actor loads it."""
    from ..engine.sources import config_problem, vocab_problem

    m, problems, vocabs = spec.model, [], {}
    for role, source in checkpoint_sources(spec.model):
        try:
            if _settled(role, source, m.storage_options, problems):
                continue
            folder = Path(source).expanduser()
            tokenizer_file = folder / "tokenizer.json"
            needs_tokenizer = role == "target" or m.draft.kind == "model"
            if not folder.is_dir() or needs_tokenizer and not tokenizer_file.is_file():
                return None
            config = json.loads((folder / "config.json").read_text())
            if role == "target":
                _note_vllm_target(config, spec, notes)
            if role == "draft" and m.draft.kind != "model":
                problem = config_problem(m.draft.kind, config)
                if problem:
                    raise ValueError(problem)
            if needs_tokenizer:
                from tokenizers import Tokenizer

                vocabs[role] = Tokenizer.from_file(str(tokenizer_file)).get_vocab(with_added_tokens=True)
        except Exception as e:
            problems.append(_unresolved(role, source, e))
    if len(vocabs) == 2:
        problem = vocab_problem(vocabs["target"], vocabs["draft"], m.draft.path)
        if problem:
            problems.append(problem)
    return problems
