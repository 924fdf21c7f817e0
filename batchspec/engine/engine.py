"""Engine: a target model, an optional draft, and text in / completions out. Knows nothing of Ray.

    engine = Engine.load("Qwen/Qwen2.5-0.5B-Instruct", DraftSpec(kind="quantized"))
    out = engine.generate(engine.tokenize(["Summarize: ..."]), max_new_tokens=64, speculate=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..draft_kinds import HF_KINDS, LEARNED_KINDS
from .api import AdaptiveK, BatchResult, Completion, DraftLength, FixedK, SamplingParams
from .drafts import ModelDraft, NgramDraft, check_tokenizers_compatible, layer_skip_view, quantized_copy
from .generate import GenerationConfig, generate
from .models import (
    LoadedModel,
    ModelLoadError,
    attention_window,
    context_length,
    encode_prompts,
    eos_token_ids,
    load_model,
    serving_problem,
)
from .sampling import RowRandom

DRAFT_KINDS = HF_KINDS  # the kinds this engine serves (draft_kinds.py)


@dataclass(frozen=True)
class DraftSpec:
    kind: str = "quantized"  # one of DRAFT_KINDS
    path: str | None = None  # kind=model, medusa, eagle, eagle3: hub id, local dir or s3:// prefix
    bits: int = 8  # kind=quantized
    layers: int | None = None  # kind=layer_skip; default: a quarter of the target's layers
    max_ngram: int = 3  # kind=ngram: longest suffix looked up
    tree_width: int = 1  # kind=medusa, eagle, eagle3: candidates per position; > 1 verifies a tree (greedy)


class Engine:
    """The hf backend (api.Backend)."""

    # What the runner reads of this backend (api.Backend): micro-batches of resources.batch_size,
    # re-decided between them; every round's timing goes to the DraftLength rule.
    name = "hf"
    whole_shard_calls = False
    max_batch = None
    per_round_k = True  # a DraftLength rule sees every round (AdaptiveK, policy.CostModelK)
    learns_costs = False  # costs are calibrated beforehand (measure_costs), then refined every round
    separate_plain = False  # one model runs both arms
    context_note = ""

    def __init__(self, target: LoadedModel, draft: DraftSpec, draft_module: torch.nn.Module | None = None,
                 draft_source: str | None = None):
        self.target = target
        self.draft = draft
        self.draft_module = draft_module
        self.draft_source = draft_source or draft.kind
        tok = target.tokenizer
        self.device = next(target.model.parameters()).device
        self.vocab_size = target.model.get_output_embeddings().weight.shape[0]
        self.eos = eos_token_ids(target.model, tok)
        self.max_context = context_length(target.model)
        # Speculation leaves holes in the target's cache, and sliding windows count cache columns:
        # rows must fit in the window to speculate (generate() checks; see generate._window_slack).
        self.window = attention_window(target.model.config)

    @classmethod
    def load(cls, target: str, draft: DraftSpec = DraftSpec(), device: str = "auto", dtype: str = "auto",
             trust_remote_code: bool = False, local_paths: dict[str, str] | None = None) -> Engine:
        """local_paths: {s3:// source: local directory} for sources the runner copied
        (runner.checkpoints.local_checkpoints); the engine keeps the names it was given."""
        if draft.kind not in DRAFT_KINDS:
            raise ModelLoadError(f"unknown draft kind {draft.kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
        loaded = load_model(target, device, dtype, trust_remote_code, local_paths)
        problem = serving_problem(loaded.model.config)
        if problem:
            raise ModelLoadError(problem)
        module, source = None, None
        if draft.kind == "model":
            if not draft.path:
                raise ModelLoadError("draft kind 'model' needs draft.path (hub id, local dir or s3:// prefix)")
            d = load_model(draft.path, loaded.model.device, loaded.model.dtype, trust_remote_code, local_paths)
            check_tokenizers_compatible(loaded.tokenizer, d.tokenizer, draft.path)
            module, source = d.model, draft.path
        elif draft.kind == "quantized":
            module, source = quantized_copy(loaded.model, draft.bits), f"{target} (int{draft.bits})"
        elif draft.kind == "layer_skip":
            total = loaded.model.config.get_text_config().num_hidden_layers
            n = draft.layers or max(1, total // 4)
            module, source = layer_skip_view(loaded.model, n), f"{target} (first {n} of {total} layers)"
        elif draft.kind == "ngram":
            source = f"ngram (max {draft.max_ngram})"
        elif draft.kind in LEARNED_KINDS:
            from .learned import load_eagle, load_eagle3, load_medusa

            if not draft.path:
                raise ModelLoadError(f"draft kind '{draft.kind}' needs draft.path (its checkpoint)")
            load = {"medusa": load_medusa, "eagle": load_eagle, "eagle3": load_eagle3}[draft.kind]
            module, source = load(draft.path, loaded.model, local_paths), draft.path
        return cls(loaded, draft, module, source)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def target_source(self) -> str:
        return self.target.source

    @property
    def draft_kind(self) -> str:
        return self.draft.kind

    def measure_costs(self, batch_size: int, sample: list[list[int]] | None = None) -> dict:
        """The policy's costs on this device (module function below). `sample` (the shard's prompts,
        which the vllm backend uses) is not needed here: this loop times draft and verify apart, and
        a model draft always proposes k tokens, so random prompts give the same costs."""
        return measure_costs(self, batch_size)

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def new_proposer(self):
        if self.draft.kind == "ngram":
            return NgramDraft(self.draft.max_ngram)
        if self.draft.kind in LEARNED_KINDS:
            from .learned import EagleDraft, MedusaDraft

            if self.draft.kind == "medusa":
                return MedusaDraft(self.draft_module, self.vocab_size, self.draft.tree_width)
            return EagleDraft(self.draft_module, self.vocab_size, self.tokenizer.pad_token_id, self.draft.tree_width)
        if self.draft_module is None:
            return None
        return ModelDraft(self.draft_module, self.draft.kind, self.vocab_size, self.tokenizer.pad_token_id)

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int = 256,
        sampling: SamplingParams = SamplingParams(),
        stop: tuple[str, ...] = (),
        seeds: list[int] | None = None,
        speculate: bool = True,
        draft_length: DraftLength | int | None = None,
        max_new_per_row: list[int] | None = None,
    ) -> tuple[list[Completion], BatchResult]:
        """Generate one batch. draft_length: an int (fixed k), a DraftLength rule, or None (adaptive).

        With a sliding-window target, rows whose prompt + max_new_tokens exceed the window are
        decoded plainly in a batch of their own (exact; see generate._window_slack), the others
        speculatively."""
        caps = list(max_new_per_row or [max_new_tokens] * len(prompt_ids))
        if speculate and self.window is not None:
            fits = [len(p) + m <= self.window for p, m in zip(prompt_ids, caps)]
            if not all(fits):
                parts = []
                for spec in (True, False):
                    idx = [i for i, f in enumerate(fits) if f == spec]
                    if idx:
                        row_seeds = [seeds[i] for i in idx] if seeds is not None else idx  # as if unsplit
                        parts.append((idx, *self._generate([prompt_ids[i] for i in idx], max_new_tokens, sampling, stop,
                                                           row_seeds, spec, draft_length, [caps[i] for i in idx])))
                by_row = sorted((i, c, r) for idx, comps, res in parts for i, c, r in zip(idx, comps, res.rows))
                merged = BatchResult([r for _, _, r in by_row], [t for _, _, res in parts for t in res.rounds],
                                     sum(res.prefill_s for *_, res in parts),
                                     sum(res.draft_prefill_s for *_, res in parts))
                return [c for _, c, _ in by_row], merged
        return self._generate(prompt_ids, max_new_tokens, sampling, stop, seeds, speculate, draft_length, caps)

    def _generate(self, prompt_ids, max_new_tokens, sampling, stop, seeds, speculate, draft_length, caps):
        config = GenerationConfig(max_new_tokens, sampling, self.eos, self.tokenizer.pad_token_id)
        proposer = self.new_proposer() if speculate else None
        if isinstance(draft_length, int):
            draft_length = FixedK(draft_length)
        elif draft_length is None:
            draft_length = AdaptiveK()
        randoms = [RowRandom(s) for s in seeds] if seeds is not None else None
        if randoms is None and not sampling.greedy:
            randoms = [RowRandom(i) for i in range(len(prompt_ids))]
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        result = generate(self.target.model, prompt_ids, config, proposer, draft_length, randoms,
                          make_stop_check(self.tokenizer, stop), sync, caps, self.window)
        completions = [
            Completion(self.decode(row.token_ids, row.stop_string), row.token_ids, row.stats) for row in result.rows
        ]
        return completions, result

    def decode(self, token_ids: list[int], stop_string: str | None = None) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.eos else token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_string is not None and stop_string in text:
            text = text[: text.find(stop_string)]  # the stop string itself is not part of the completion
        return text


def make_stop_check(tokenizer, stops: tuple[str, ...]):
    """Completion ids -> the first stop string now present, or None.

    Only the tail is decoded: a stop string of L characters (at most 4L UTF-8 bytes) spans at most
    4L + 2 byte-level tokens, and any earlier occurrence would already have ended the row.
    """
    stops = tuple(s for s in stops if s)
    if not stops:
        return None
    window = 4 * max(len(s) for s in stops) + 2

    def check(ids: list[int]) -> str | None:
        text = tokenizer.decode(ids[-window:], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        return min(hits)[1] if hits else None

    return check


@torch.inference_mode()
def measure_costs(engine: Engine, batch_size: int, ks: tuple[int, ...] = (1, 2, 4, 8), prompt_tokens: int = 64,
                  repeats: int = 5) -> dict:
    """Time the operations the policy's cost model needs, at this batch size, on this device.

    Returns seconds: target_step_s (one plain decode step), draft_step_s, verify_s {k: one target
    pass over k+1 tokens}, prefill_token_s and draft_prefill_token_s (per prompt token of the batch).
    Each figure is the fastest of `repeats` runs after one warm-up, on random prompts (load from
    other processes only ever adds time, so the minimum is the least noisy estimate).
    """
    import time

    from . import cache as kv

    gen = torch.Generator().manual_seed(0)
    high = engine.vocab_size  # ids every model here can embed: a sibling draft's table may be smaller
    if engine.draft.kind == "model":
        draft: Any = engine.draft_module  # a Module (see LoadedModel.model for the Any)
        high = min(high, draft.get_input_embeddings().weight.shape[0])
    low = 8 if high > 64 else 0  # skip the special tokens at the start of small vocabularies
    ids = torch.randint(low, high, (batch_size, prompt_tokens), generator=gen).to(engine.device)
    ones = torch.ones_like(ids)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return min(times)

    def prefill(model):
        state = kv.empty_state(batch_size, engine.device)
        _, state = kv.forward(model, state, ids, ones, last_only=True)
        return state

    def step_cost(model, width: int) -> float:
        state = prefill(model)
        step = ids[:, :width]

        def run():
            _, s = kv.forward(model, state, step, torch.ones_like(step))
            s.cache.crop(-width)  # restore the prefilled cache for the next repeat
        return timed(run)

    target = engine.target.model
    out = {
        "batch_size": batch_size,
        "prefill_token_s": timed(lambda: prefill(target)) / prompt_tokens,
        "target_step_s": step_cost(target, 1),
        "verify_s": {k: step_cost(target, k + 1) for k in ks},
        "draft_step_s": 0.0,
        "draft_prefill_token_s": 0.0,
    }
    if engine.draft.kind in LEARNED_KINDS:
        out.update(_learned_draft_costs(engine, ids, timed, repeats))
    elif engine.draft_module is not None:
        out["draft_step_s"] = step_cost(engine.draft_module, 1)
        out["draft_prefill_token_s"] = timed(lambda: prefill(engine.draft_module)) / prompt_tokens
    elif engine.draft.kind == "ngram":
        from .drafts import NgramDraft

        lookup = NgramDraft(engine.draft.max_ngram)
        lookup.prefill(ids.tolist(), [0] * batch_size, engine.device)
        lengths = torch.full((batch_size,), 4)
        out["draft_step_s"] = timed(lambda: lookup.propose(4, lengths, SamplingParams(), None)) / 4
    return out


def _learned_draft_costs(engine: Engine, ids: torch.Tensor, timed, repeats: int) -> dict:
    """draft_step_s and draft_prefill_token_s of a learned draft (Medusa, EAGLE, EAGLE-3), which
    reads the target's features: the proposer itself is timed, 4 tokens a call. ids [B, P]."""
    import time

    from . import cache as kv

    batch_size, prompt_tokens = ids.shape
    proposer = engine.new_proposer()
    _, _, feats = kv.forward_with_features(engine.target.model, kv.empty_state(batch_size, engine.device), ids,
                                           torch.ones_like(ids), proposer.feature_layers)
    rows, first = ids.tolist(), [0] * batch_size
    prefill_s = timed(lambda: proposer.prefill(rows, first, engine.device, features=feats))
    lengths = torch.full((batch_size,), 4, device=engine.device)

    def propose() -> float:
        proposer.prefill(rows, first, engine.device, features=feats)
        t = time.perf_counter()
        proposer.propose(4, lengths, SamplingParams(), None)
        return time.perf_counter() - t

    propose()
    return {"draft_prefill_token_s": prefill_s / prompt_tokens, "draft_step_s": min(propose() for _ in range(repeats)) / 4}
