"""The draft kinds, in one table: what each needs, which backends serve it, what it keeps.

The spec's `model.draft.kind`, the backend choice (engine/backend.py), the hf engine's loader, the
CLI help and docs/engine.md's table all read this table; nothing else spells out a list of kinds.
Pure data: `batchspec --help` and the driver import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

VllmSupport = Literal["yes", "gpu", "no"]  # gpu: vLLM serves it on GPU actors only


@dataclass(frozen=True)
class DraftKind:
    name: str
    summary: str  # one line, for the CLI help and the docs table
    needs_path: bool  # draft.path is required (a checkpoint of its own)
    hf: bool  # batchspec's own engine serves it
    vllm: VllmSupport
    learned: bool = False  # reads the target's hidden features (engine/learned.py)
    keeps_kv_cache: bool = False  # holds a KV cache of its own, rolled back on rejection (engine/cache.py)
    trees: bool = False  # draft.tree_width > 1 verifies a tree (hf backend, greedy)


# Order is the spec's (and so the JSON Schema's) enum order.
DRAFT_KINDS: tuple[DraftKind, ...] = (
    # vLLM's CPU build has no online weight quantization, so it serves "quantized" on GPU only (as fp8).
    DraftKind("quantized", "the target's own weights, quantized (int8 on CPU; int8/int4 with torchao on CUDA)",
              needs_path=False, hf=True, vllm="gpu", keeps_kv_cache=True),
    DraftKind("model", "a separate small causal LM sharing the target's tokenizer", needs_path=True, hf=True,
              vllm="yes", keeps_kv_cache=True),
    DraftKind("layer_skip", "the target's first layers as its own draft (self-speculation)", needs_path=False,
              hf=True, vllm="no", keeps_kv_cache=True),
    DraftKind("ngram", "prompt lookup: the continuation of the longest suffix seen before", needs_path=False,
              hf=True, vllm="yes"),
    DraftKind("eagle", "an EAGLE-1 feature draft (one decoder layer over the target's features)", needs_path=True,
              hf=True, vllm="yes", learned=True, keeps_kv_cache=True, trees=True),
    DraftKind("eagle3", "an EAGLE-3 draft (features of three target layers)", needs_path=True, hf=True,
              vllm="yes", learned=True, keeps_kv_cache=True, trees=True),
    DraftKind("medusa", "Medusa heads on the target's last hidden state", needs_path=True, hf=True, vllm="yes",
              learned=True, trees=True),
    DraftKind("mtp", "the target's own multi-token-prediction layers (vllm backend only)", needs_path=False,
              hf=False, vllm="yes"),
    DraftKind("none", "no draft: plain decoding", needs_path=False, hf=True, vllm="yes"),
)

BY_NAME = {k.name: k for k in DRAFT_KINDS}
NAMES = tuple(k.name for k in DRAFT_KINDS)
HF_KINDS = tuple(k.name for k in DRAFT_KINDS if k.hf)
LEARNED_KINDS = tuple(k.name for k in DRAFT_KINDS if k.learned)
NEEDS_PATH = tuple(k.name for k in DRAFT_KINDS if k.needs_path)


def vllm_kinds(gpu: bool) -> tuple[str, ...]:
    """The kinds the vllm backend serves on GPU actors (gpu) or on CPU ones."""
    return tuple(k.name for k in DRAFT_KINDS if k.vllm == "yes" or (gpu and k.vllm == "gpu"))


def markdown_table() -> str:
    """docs/engine.md's table of draft kinds (a test keeps the page in step with this)."""
    mark = {True: "yes", False: "-"}
    lines = ["| kind | what it is | needs draft.path | hf | vllm | own KV cache | trees |",
             "|---|---|---|---|---|---|---|"]
    for k in DRAFT_KINDS:
        vllm = {"yes": "yes", "gpu": "GPU only", "no": "-"}[k.vllm]
        lines.append(f"| `{k.name}` | {k.summary} | {mark[k.needs_path]} | {mark[k.hf]} | {vllm} | "
                     f"{mark[k.keeps_kv_cache]} | {mark[k.trees]} |")
    return "\n".join(lines)
