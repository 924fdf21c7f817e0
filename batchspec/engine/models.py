"""Load a target or draft model from a hub id or a local directory (an s3:// prefix once the runner
has copied it: runner/checkpoints.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .api import ModelLoadError
from .sources import local_source_problem


@dataclass
class LoadedModel:
    # A transformers PreTrainedModel, typed Any: torch types a Module's every attribute as
    # Tensor | Module (Module.__getattr__), so `.config` and `.get_input_embeddings()` would not check.
    model: Any
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    source: str  # what the user asked for (hub id, dir or s3 URI)
    local_path: str  # where it was loaded from


def resolve_device(device: str = "auto") -> torch.device:
    """auto: CUDA when this process sees a GPU, else CPU. An explicit cuda this process cannot see
    is a ModelLoadError: vLLM took `device: cuda` on a CPU machine for a GPU and reserved 21 of its
    24 GiB for KV cache, and the actor was killed and restarted until someone stopped the job."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device is {device!r}, but this process sees no CUDA device "
                             f"(torch {torch.__version__}): use model.device: auto or cpu here, or give the "
                             "actors GPUs (resources.gpus_per_actor: 1) on a machine that has them")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA (where supported), fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32 if device.type == "cpu" else torch.float16
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]


def resolve_model_path(source: str, local_paths: dict[str, str] | None = None) -> str:
    """Where to load `source` from: the local copy the runner made of an s3:// prefix (local_paths:
    source -> directory, from runner.checkpoints.local_checkpoints), else `source` itself (a local
    directory or a hub id). The engine reaches no object store itself."""
    path = (local_paths or {}).get(source, source)
    if path.startswith("s3://"):
        raise ModelLoadError(f"{source} is an s3:// prefix, and the engine loads local directories and hub ids only: "
                             "copy it first with batchspec.runner.checkpoints.local_checkpoints (a job does) and pass "
                             "local_paths, or give a local directory")
    return path


def attention_window(config) -> int | None:
    """The smallest sliding attention window any layer of this model applies, or None.

    Configs declare windows in several ways: `sliding_window` alone (Mistral, Phi-3: every layer),
    `use_sliding_window` + `max_window_layers` (Qwen2/3: the flag off means no window; the config
    then clears sliding_window), `layer_types` naming sliding or chunked layers (Gemma 2/3,
    Cohere 2, SmolLM3, Llama 4's chunked attention), or an older `sliding_window_pattern`.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = [w for w in (getattr(cfg, "sliding_window", None), getattr(cfg, "attention_chunk_size", None))
             if isinstance(w, int) and w > 0]
    if not sizes or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types and not any("sliding" in t or "chunk" in t for t in types):
        return None  # every layer attends fully; the window setting is unused
    return min(sizes)


# Model types whose layers keep a recurrent state (SSM, linear attention, RWKV) instead of, or
# besides, an attention KV cache.
_RECURRENT_TYPES = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "recurrent_gemma", "bamba",
                    "nemotron_h", "granitemoehybrid", "lfm2", "qwen3_next", "falcon_h1", "xlstm", "minimax"}
_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def serving_problem(config) -> str | None:
    """Why the hf engine cannot serve this model, with any draft kind or none (from its config
    alone, so the driver can refuse a job before any actor starts); None when it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(config, "model_type", "?")
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(config, "auto_map", None):
        return f"model type {mt!r} is not a causal language model transformers can load (AutoModelForCausalLM)"
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t not in _ATTENTION_LAYERS})
    if mt in _RECURRENT_TYPES or other:
        what = f"layers of type {', '.join(other)}" if other else "recurrent (state-space) layers"
        # Their state is not an attention cache: left padding leaks into it (batched rows are not
        # exact) and a rejected draft token cannot be cut from it.
        return (f"model type {mt!r} has {what}, which the hf engine's batched decoding cannot keep exact; "
                "serve it with model.backend: vllm")
    return None


def load_model(
    source: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    local_paths: dict[str, str] | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode, on the requested device and dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
    problem = local_source_problem(source)
    if problem:
        raise ModelLoadError(problem)
    path = resolve_model_path(source, local_paths)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dt, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {source!r}: {e}") from e
    model.to(dev).eval()
    if tokenizer.pad_token_id is None:
        # Many base checkpoints ship no pad token; padding positions are masked anyway.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return LoadedModel(model=model, tokenizer=tokenizer, source=source, local_path=str(path))


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(module holding the decoder layer list, attribute name): model.model.layers, transformer.h, ..."""
    n = hf_config(model).get_text_config().num_hidden_layers
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == n:
                return module, name
    raise ModelLoadError(f"cannot find the decoder layers of {type(model).__name__}")


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt, with the tokenizer's special tokens unless the text already starts
    with BOS (a chat template that emits it: Llama 3, Mistral), which would otherwise be doubled."""
    bos = tokenizer.bos_token
    has_bos = [bool(bos) and p.startswith(bos) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for add in (True, False):
        idx = [i for i, h in enumerate(has_bos) if h != add]
        if idx:
            for i, ids in zip(idx, tokenizer([prompts[i] for i in idx], add_special_tokens=add)["input_ids"]):
                out[i] = ids
    return out


def eos_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """Every token id that ends a row: the tokenizer's EOS plus the generation config's list."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), hf_config(model)):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def hf_config(model: torch.nn.Module) -> Any:
    """A transformers model's config (a PretrainedConfig; see LoadedModel.model for the Any)."""
    return model.config


def context_length(model: torch.nn.Module) -> int:
    cfg = hf_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return 2048
