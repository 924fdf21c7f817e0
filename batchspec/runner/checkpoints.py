"""Model checkpoints named by s3:// prefixes, copied once into a local cache before an engine loads.

    paths = local_checkpoints(spec.model)   # {"s3://bucket/models/t": "~/.cache/batchspec/models/3f0c..."}
    backend = load_backend("vllm", spec.model, local_paths=paths)

Why here and not in the engine: the engine imports torch and transformers only (DESIGN.md: a
backend never imports Ray, pyarrow or fsspec); reaching object stores, with the job's storage
options, is the runner's side, as it is for the input and output. The engine is handed local
directories and keeps the names the job gave (an output row's target_model says the s3:// URI).

A file lock plus an atomic rename means two actors on one machine never see, or write, a
half-copied checkpoint; a complete copy is reused by every later actor and run on the machine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("batchspec.runner")

# Files a checkpoint needs; anything else under the prefix (optimizer states, logs) is skipped.
_CHECKPOINT_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".tiktoken", ".py", ".jinja", ".md")


def cache_root() -> Path:
    """batchspec's cache on this machine: fetched checkpoints, the policy's memory, bench results."""
    return Path(os.environ.get("BATCHSPEC_CACHE", Path.home() / ".cache" / "batchspec"))


def checkpoint_sources(spec_model) -> list[tuple[str, str]]:
    """(role, source) of the checkpoints a spec.ModelSpec names: the target, and a draft that has a path."""
    d = spec_model.draft
    return [("target", spec_model.target)] + ([("draft", d.path)] if d.path and d.kind != "ngram" else [])


def local_checkpoints(spec_model) -> dict[str, str]:
    """{s3:// source: local directory} for the checkpoints of a spec.ModelSpec, each fetched into
    the cache unless a complete copy is there; local directories and hub ids are not listed."""
    return {source: str(fetch_prefix(source, spec_model.storage_options))
            for _, source in checkpoint_sources(spec_model) if source.startswith("s3://")}


def fetch_prefix(uri: str, storage_options: dict | None = None) -> Path:
    """Copy the checkpoint files under an s3:// prefix into the cache; return the directory."""
    import fsspec
    from filelock import FileLock

    from ..engine.api import ModelLoadError

    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    dest = cache_root() / "models" / key
    if (dest / ".complete").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + ".lock"):
        if (dest / ".complete").exists():  # another actor finished while we waited
            return dest
        fs, root = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        files = [f for f in fs.find(root) if f.endswith(_CHECKPOINT_SUFFIXES)]
        if not any(f.endswith("config.json") for f in files):
            raise ModelLoadError(f"no config.json under {uri}: is this a Hugging Face checkpoint prefix?")
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=key + ".tmp"))
        for f in files:
            rel = f[len(root.rstrip("/")) + 1:]
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(staging / rel))
        (staging / ".complete").write_text(uri)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)  # atomic on one filesystem: readers see all or nothing
    log.info("fetched model %s into cache %s", uri, dest)
    return dest


def read_config(source: str, storage_options: dict | None = None) -> dict | None:
    """A checkpoint's config.json as a dict, without transformers: from a local directory, an s3://
    prefix (through fsspec, with the spec's storage options), or a hub id (through huggingface_hub,
    which uses its cache and honours HF_HUB_OFFLINE). None when it cannot be read: whoever asks
    decides without it, and the model check that follows words the problem."""
    import json

    try:
        if source.startswith("s3://"):
            import fsspec

            fs, root = fsspec.core.url_to_fs(source, **(storage_options or {}))
            with fs.open(f"{root.rstrip('/')}/config.json", "rb") as f:
                return json.loads(f.read())
        folder = Path(source).expanduser()
        if folder.is_dir():
            return json.loads((folder / "config.json").read_text())
        from ..engine.sources import local_source_problem

        if local_source_problem(source):
            return None
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(source, "config.json")).read_text())
    except Exception:
        return None


def latent_attention(config: dict | None) -> bool:
    """Whether a config.json (or its text_config) describes multi-head latent attention (DeepSeek's MLA)."""
    config = config or {}
    return bool((config.get("text_config") or config).get("kv_lora_rank"))
