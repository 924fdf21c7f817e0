"""Draft proposers: they guess the next k tokens of every row; the target then verifies them.

Four kinds, one interface (prefill / propose / accept / select):

    model       a separate, smaller checkpoint sharing the target's tokenizer
    quantized   an int8 (CPU) or int8/int4 weight-only (CUDA, torchao) copy of the target itself
    layer_skip  the target's first N layers plus its final norm and head: no extra weights
    ngram       prompt lookup: copy what followed the last matching n-gram earlier in the row

The first three are the same machinery (ModelDraft) around a different module. Each keeps its own
masked KV state (see cache.py) and the tokens it has not fed yet ("unfed"): the token the target
emitted last round, plus the last draft token when the whole draft was accepted (it was proposed
but never fed back into the draft).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import cache as kv
from .api import ModelLoadError
from .models import decoder_layers, hf_config
from .sampling import DRAFT, SamplingParams, logits_to_probs, sample_from
from .sources import vocab_problem


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, k] proposed tokens; entries past a row's length are filler
    lengths: torch.Tensor  # [B] how many tokens each row really proposes (<= k)
    draft_probs: torch.Tensor | None  # [B, k, V] draft distribution (sampling), None = point mass / greedy
    # [B, k, w-1] other candidates at each depth, children of the previous tokens (greedy tree
    # verification, generate._verify_tree); None: a chain
    siblings: torch.Tensor | None = None


class ModelDraft:
    """A causal LM used as the draft: a separate checkpoint, a quantized copy, or a layer-skip view."""

    def __init__(self, model: Any, kind: str, vocab_size: int, pad_id: int):  # model: see LoadedModel.model
        self.model, self.kind, self.vocab_size, self.pad_id = model, kind, vocab_size, pad_id
        # Sibling checkpoints pad their embeddings differently (Qwen2.5-7B: 152,064 rows,
        # 0.5B: 151,936); a target token past the draft's table is fed to the draft as padding.
        # The draft then guesses worse for that row, but verification keeps the output exact.
        self.embed_rows = model.get_input_embeddings().weight.shape[0]
        self.state: kv.KVState | None = None
        self.unfed: list[list[int]] = []
        self._round_cols = 0  # columns appended by the last propose()
        self._last: torch.Tensor | None = None  # [B, k] tokens of the last proposal

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], first_tokens: list[int], device) -> None:
        ids, mask = kv.left_pad(prompts, self.pad_id, device)
        self.state = kv.empty_state(len(prompts), device)
        _, self.state = kv.forward(self.model, self.state, self._feedable(ids), mask, last_only=True)
        self.unfed = [[t] for t in first_tokens]

    @torch.inference_mode()
    def propose(self, k: int, lengths: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> Proposal:
        # uniforms: [B, k, 3] per-position uniforms for the proposed positions (None when greedy)
        state = kv.started(self.state)
        ids, mask = kv.left_pad(self.unfed, self.pad_id, state.mask.device)  # [B, W] right-aligned unfed tokens
        logits, self.state = kv.forward(self.model, state, self._feedable(ids), mask, last_only=True)
        tokens, probs = [], []
        for j in range(k):
            step_logits = self._align(logits[:, -1])  # [B, V]
            if params.greedy:
                token = step_logits.argmax(-1)
            else:
                assert uniforms is not None  # given whenever the job samples
                step_probs = logits_to_probs(step_logits, params)
                token = sample_from(step_probs, uniforms[:, j, DRAFT])
                probs.append(step_probs)
            tokens.append(token)
            if j < k - 1:  # the last draft token is verified, never fed to the draft this round
                ones = torch.ones_like(token)[:, None]
                logits, self.state = kv.forward(self.model, kv.started(self.state), token[:, None], ones, last_only=True)
        self._round_cols = ids.shape[1] + k - 1
        self._last = torch.stack(tokens, 1)
        return Proposal(self._last, lengths, torch.stack(probs, 1) if probs else None)

    def accept(self, n_accepted: list[int], emitted: list[list[int]], proposed: bool) -> None:
        """Roll the draft's cache back to the accepted prefix and queue the unfed tokens."""
        if not proposed:
            for row, toks in zip(self.unfed, emitted):
                row.extend(toks)
            return
        proposal, state = self._last, kv.started(self.state)
        assert proposal is not None  # proposed: propose() kept it
        k = proposal.shape[1]
        W = self._round_cols - (k - 1)
        n = torch.tensor(n_accepted, device=state.mask.device)
        j = torch.arange(1, k, device=n.device)[None, :]  # draft token index of each fed column
        keep = torch.cat([torch.ones(len(n_accepted), W, dtype=torch.bool, device=n.device), j <= n[:, None]], 1)
        self.state = kv.rollback(state, keep)
        last = proposal[:, -1].tolist()
        self.unfed = [([last[b]] if n_accepted[b] == k else []) + [toks[-1]] for b, toks in enumerate(emitted)]

    def select(self, keep_idx: torch.Tensor) -> None:
        state = kv.started(self.state)
        self.state = kv.select_rows(state, keep_idx.to(state.mask.device))
        self.unfed = [self.unfed[i] for i in keep_idx.tolist()]
        if self._last is not None:
            self._last = self._last[keep_idx.to(self._last.device)]

    def _feedable(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.masked_fill(ids >= self.embed_rows, self.pad_id)

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.vocab_size)


def fit_vocab(logits: torch.Tensor, V: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary of V ids (checkpoints pad embeddings differently):
    cut the extra columns, or give the missing ids probability zero."""
    if logits.shape[-1] > V:
        return logits[..., :V]
    if logits.shape[-1] < V:
        pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
        return torch.cat([logits, pad], -1)
    return logits


class NgramDraft:
    """Prompt lookup decoding (Saxena 2023): find the row's last n tokens earlier in the row and
    propose the tokens that followed them. Strong when outputs copy from inputs (summaries,
    extraction), free to run, and a point-mass draft for rejection sampling."""

    kind = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.history: list[list[int]] = []

    def prefill(self, prompts: list[list[int]], first_tokens: list[int], device) -> None:
        self.history = [list(p) + [t] for p, t in zip(prompts, first_tokens)]
        self.device = device

    def propose(self, k: int, lengths: torch.Tensor, params: SamplingParams, uniforms) -> Proposal:
        found = [self._lookup(h, k) for h in self.history]
        tokens = torch.zeros(len(found), k, dtype=torch.long)
        for b, f in enumerate(found):
            tokens[b, :len(f)] = torch.tensor(f, dtype=torch.long)
        got = torch.tensor([len(f) for f in found], dtype=torch.long, device=lengths.device)
        return Proposal(tokens.to(self.device), torch.minimum(lengths, got), None)

    def _lookup(self, seq: list[int], k: int) -> list[int]:
        arr = np.asarray(seq)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            suffix = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # windows ending before the suffix
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match
                return arr[start:start + k].tolist()
        return []

    def accept(self, n_accepted: list[int], emitted: list[list[int]], proposed: bool) -> None:
        for row, toks in zip(self.history, emitted):
            row.extend(toks)

    def select(self, keep_idx: torch.Tensor) -> None:
        self.history = [self.history[i] for i in keep_idx.tolist()]


# ---------------------------------------------------------------------------------------------
# Building the draft modules


def check_tokenizers_compatible(target_tok, draft_tok, draft_source: str) -> None:
    """Raise ModelLoadError unless the draft's tokenizer maps every string to the target's ids."""
    problem = vocab_problem(target_tok.get_vocab(), draft_tok.get_vocab(), draft_source)
    if problem:
        raise ModelLoadError(problem)


def layer_skip_view(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The target's first `layers` decoder layers plus its final norm and head, sharing weights
    (self-speculation as in LayerSkip / Draft & Verify; no extra memory but the draft's KV cache)."""
    total = hf_config(model).get_text_config().num_hidden_layers
    if not 1 <= layers < total:
        raise ModelLoadError(f"layer_skip layers must be between 1 and {total - 1} for this target, got {layers}")
    holder, name = decoder_layers(model)
    # Shallow copies of every module on the path from the root to the layer list, so the target
    # keeps its own full list while both share the same parameters.
    path = _path_to(model, holder)
    cfg = copy.deepcopy(hf_config(model))
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    view = parent = _shallow(model, cfg)
    for attr in path:
        child = _shallow(getattr(parent, attr), cfg)
        parent._modules[attr] = child
        parent = child
    parent._modules[name] = torch.nn.ModuleList(list(getattr(holder, name))[:layers])
    return view


def _shallow(module: torch.nn.Module, config) -> torch.nn.Module:
    """A copy of module that shares its children and parameters but has its own child table and,
    if it carries one, the shortened config (only these copies see it; the target keeps its own)."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    if hasattr(clone, "config"):
        clone.config = config
    return clone


def _path_to(root: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    if root is target:
        return []
    for name, child in root.named_children():
        if any(m is target for m in child.modules()):
            return [name] + _path_to(child, target)
    raise ValueError("module not found")


def quantized_copy(model: torch.nn.Module, bits: int = 8) -> torch.nn.Module:
    """A compressed copy of the target to use as its own draft.

    CPU: dynamic int8 (int8 weights, activations quantized per batch; fbgemm/onednn kernels).
    CUDA: torchao weight-only int8 or int4, when torchao is installed.
    """
    device = next(model.parameters()).device
    if device.type == "cpu":
        if bits != 8:
            raise ModelLoadError(f"quantized draft with {bits} bits is not supported on CPU; use bits: 8")
        from torch.ao.quantization import quantize_dynamic

        clone = copy.deepcopy(model).float()
        _conv1d_to_linear(clone)
        return quantize_dynamic(clone, {torch.nn.Linear}, dtype=torch.qint8).eval()
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise ModelLoadError("quantized drafts on CUDA need torchao (pip install torchao)") from e
    clone = copy.deepcopy(model)
    quantize_(clone, Int8WeightOnlyConfig() if bits == 8 else Int4WeightOnlyConfig())
    return clone.eval()


def _conv1d_to_linear(model: torch.nn.Module) -> None:
    """GPT-2 style Conv1D (weight [in, out]) -> nn.Linear, so dynamic quantization applies."""
    from transformers.pytorch_utils import Conv1D

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                lin = torch.nn.Linear(child.weight.shape[0], child.weight.shape[1])
                lin.weight.data = child.weight.data.t().contiguous()
                lin.bias.data = child.bias.data
                setattr(module, name, lin)
