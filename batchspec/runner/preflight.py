"""The models a job names, checked before anything runs: local paths exist, configs and tokenizers
load, a learned draft's checkpoint fits its kind, the pair shares a tokenizer. Used by the driver
before Ray starts (runner/job.py) and by `batchspec validate` (runner/validate.py)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import error_line
from ..spec import JobSpec
from .checkpoints import checkpoint_sources


def learned_draft_problem(path: str, kind: str) -> None:
    """Raise when a learned draft's checkpoint (a local dir or a hub id) has no config.json, or one
    that does not fit the kind (engine.sources.config_problem, the loaders' own check). Its config
    is not a transformers model config (Medusa's has no model_type), so AutoConfig cannot be it."""
    from transformers.utils import cached_file

    from ..engine.sources import config_problem

    config = cached_file(path, "config.json")
    if config is None:  # cached_file raises for a missing file; None only if told not to
        raise ValueError(f"{path}: no config.json")
    problem = config_problem(kind, json.loads(Path(config).read_text()))
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
    (and, into `notes`, what the user should know: a sliding window limits speculation); a
    distilled draft that failed its check or was made for another target is refused."""
    from ..engine.sources import distilled_draft_problem

    d = spec.model.draft
    distilled = [p for p in [distilled_draft_problem(d.path, spec.model.target) if d.path else None] if p]
    if backend == "vllm":
        quick = local_model_problems(spec, notes)
        if quick is not None:
            return distilled + quick
    from transformers import AutoConfig, AutoTokenizer

    from ..engine.api import ModelLoadError
    from ..engine.drafts import check_tokenizers_compatible
    from ..engine.models import attention_window, serving_problem

    m, problems, toks = spec.model, distilled, {}
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
            check_tokenizers_compatible(toks["target"], toks["draft"], str(m.draft.path))
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

    m, problems, vocabs = spec.model, list[str](), {}
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
        problem = vocab_problem(vocabs["target"], vocabs["draft"], str(m.draft.path))
        if problem:
            problems.append(problem)
    return problems
