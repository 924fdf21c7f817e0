"""Learned drafts that read the target's own features: Medusa heads and an EAGLE feature draft.

    medusa  K heads on the target's top-layer feature h_t (the LM head's input). Head i is a
            residual SiLU block and its own vocabulary projection, and predicts token t+1+i (Cai et
            al. 2024, "Medusa"). All k proposals come from one feature at once: no draft forward
            pass at all, so a draft token costs a small fraction of a target step.
    eagle   one decoder layer over fc([embed(x_{t+1}); f_t]) that predicts the target's next
            feature f_{t+1}; the target's own LM head turns it into a token, and the predicted
            feature feeds the next step (Li et al. 2024, "EAGLE"). Drafting runs in feature space,
            k small steps per round.
    eagle3  the same drafting loop over a fused feature: fc over the hidden states entering three
            of the target's layers (low, middle, high), one decoder layer whose attention reads
            [norm(embed(x_{t+1})); norm(h)], its own LM head over a smaller draft vocabulary mapped
            to the target's ids, and its own output fed back as the next h (Li et al. 2025,
            "EAGLE-3"). No feature regression: it is trained on tokens only.

All read features from passes the target makes anyway (prefill and verification, captured at the
LM head's input, or at the chosen layers' inputs for eagle3, by cache.forward_with_features): no
extra target pass.

Checkpoint layouts (what `draft.path` points at; a local dir, an s3:// prefix or a hub id):

    medusa  config.json {"medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size"}
            + medusa_lm_head.safetensors (or .pt), keys "{head}.{block}.linear.weight|bias" for
            the residual blocks and "{head}.{num_layers}.weight" for the projection: the layout
            of the Medusa reference implementation's medusa_head ModuleList.
    eagle   config.json (a Llama config of the draft layer) + model.safetensors or
            pytorch_model.bin: batchspec's layout (fc.*, decoder.*: one LlamaDecoderLayer and a
            final norm), or the EAGLE reference's (fc.*, layers.0.* with no input norm, no final
            norm; its embed_tokens is the target's and is not read).
    eagle3  the EAGLE-3 reference's layout, which vLLM reads too: config.json (a Llama config with
            draft_vocab_size and optionally eagle_aux_hidden_state_layer_ids, top level or under
            eagle_config; default layers 2, n/2, n-3 as vLLM) + model.safetensors or
            pytorch_model.bin with fc.*, midlayer.* (q/k/v over 2x the width, hidden_norm), norm.*,
            lm_head.*, d2t (draft id -> target id offset), t2d; embed_tokens.* if present,
            otherwise the target's embedding. Configs in the speculators format (the layer's
            config under transformer_layer_config) are read too.

Verification is the engine's usual chain (greedy or rejection sampling), so output is exact
whatever the heads propose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import error_line
from . import cache as kv
from .api import ModelLoadError
from .drafts import Proposal, fit_vocab
from .models import resolve_model_path
from .sampling import DRAFT, SamplingParams, logits_to_probs, sample_from
from .sources import config_problem, local_source_problem


class ResBlock(nn.Module):
    """x + SiLU(W x + b), initialised to the identity (W = 0), as in the Medusa paper."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.num_heads, self.num_layers = num_heads, num_layers
        # Any: torch types a ModuleList's items as Module, which neither indexes nor has .weight.
        self.heads: Any = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(num_heads))

    def forward(self, h: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """h [B, H] -> logits [B, k, V] for tokens t+2 .. t+1+k."""
        return torch.stack([head(h) for head in self.heads[: k or self.num_heads]], 1)

    def init_from_lm_head(self, lm_head: nn.Linear) -> None:
        """Start every head's projection at the target's LM head (Medusa-1 does the same)."""
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(lm_head.weight[: head[-1].weight.shape[0]])


class EagleModel(nn.Module):
    """fc over [token embedding; feature], one Llama decoder layer, a final norm. Token embedding
    and LM head are the target's (set by attach(); never saved with the draft)."""

    def __init__(self, config, reference_layout: bool = False):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        # vocab_size 1: the layer never embeds tokens itself (the target does), so no special ids either.
        cfg = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1, "vocab_size": 1, "pad_token_id": None,
                             "bos_token_id": None, "eos_token_id": None})
        self.config = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.decoder = LlamaModel(cfg)
        if reference_layout:
            # The EAGLE reference (cnets1.py): its one layer has no input norm (fc's output goes
            # straight into attention) and there is no final norm before the LM head.
            self.decoder.layers[0].input_layernorm = nn.Identity()
            self.decoder.norm = nn.Identity()  # type: ignore[assignment]  # a module where a norm was
        self.embed: Any = None  # the target's token embedding and LM head, set by attach()
        self.lm_head: Any = None
        self.features: torch.Tensor | None = None  # [B, T, H] fed with the next forward's input_ids
        self.last_hidden: torch.Tensor | None = None

    feature_layers = None  # reads the LM head's input

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as this model's input (EAGLE-1 reads them as they are)."""
        return features

    def attach(self, target: Any) -> EagleModel:
        # Plain attributes, not submodules: the target's weights stay out of this module's state.
        object.__setattr__(self, "embed", target.get_input_embeddings())
        object.__setattr__(self, "lm_head", target.get_output_embeddings())
        return self

    def get_output_embeddings(self):
        return self.lm_head

    def predict(self, input_ids, features, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False) -> torch.Tensor:
        """The predicted next features [B, T, H] for pairs (features[:, t], input_ids[:, t])."""
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.fc.weight.dtype)], -1))
        return self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache).last_hidden_state

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=0, **_):
        """The cache.forward interface: the pairs' features come from self.features."""
        hidden = self.predict(input_ids, self.features, attention_mask, position_ids, past_key_values, use_cache)
        self.last_hidden = hidden
        keep = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return _Out(self.lm_head(keep))


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: a Llama layer whose attention reads [norm(embedding); norm(h)]
    (twice the width) and whose residual is h. Called by LlamaModel like any layer, with the
    embedding and h concatenated as its hidden states."""

    def __init__(self, cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

        base = LlamaDecoderLayer(cfg, layer_idx=0)
        H, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or H // heads
        bias = getattr(cfg, "attention_bias", False)
        base.self_attn.q_proj = nn.Linear(2 * H, heads * head_dim, bias=bias)
        base.self_attn.k_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=bias)
        base.self_attn.v_proj = nn.Linear(2 * H, kv_heads * head_dim, bias=bias)
        self.self_attn, self.mlp = base.self_attn, base.mlp
        self.input_layernorm, self.post_attention_layernorm = base.input_layernorm, base.post_attention_layernorm
        self.hidden_norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.H = H
        # Some checkpoints (vLLM reads the flag; the speculators format defaults it on) make the
        # normed h the residual instead of h itself.
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        embeds, h = hidden_states[..., : self.H], hidden_states[..., self.H:]
        normed = self.hidden_norm(h)
        if self.norm_before_residual:
            h = normed
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, use_cache=use_cache,
                              position_embeddings=position_embeddings, **kwargs)
        h = h + x
        return h + self.mlp(self.post_attention_layernorm(h))


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers when a checkpoint names none (vLLM's default)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3} & set(range(num_layers + 1)))) or (num_layers,)


class Eagle3Model(nn.Module):
    """fc over the target's fused layer features, one Eagle3Layer, a norm and a draft-vocabulary
    LM head; d2t maps a draft id i to target id i + d2t[i]. The token embedding is the target's
    unless the checkpoint carries one."""

    def __init__(self, config, target_vocab: int, feature_layers: tuple[int, ...], target_hidden: int | None = None):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        cfg = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1, "vocab_size": 1, "pad_token_id": None,
                             "bos_token_id": None, "eos_token_id": None})
        self.config = cfg
        H = cfg.hidden_size
        self.feature_layers = tuple(sorted(feature_layers))
        self.draft_vocab = int(getattr(config, "draft_vocab_size", None) or target_vocab)
        self.target_vocab = target_vocab
        self.fc = nn.Linear(len(self.feature_layers) * (target_hidden or H), H, bias=False)
        self.decoder = LlamaModel(cfg)
        self.decoder.layers[0] = Eagle3Layer(cfg)
        # The output before the norm feeds the next step (a module where a norm was).
        self.decoder.norm = nn.Identity()  # type: ignore[assignment]
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        self.d2t: torch.Tensor
        self.own_embed: nn.Embedding | None = None
        self.embed: Any = None  # own_embed or the target's, set by attach()
        self.features: torch.Tensor | None = None
        self.last_hidden: torch.Tensor | None = None

    @classmethod
    def from_target(cls, target: Any, feature_layers: tuple[int, ...],
                    vocab_ids: torch.Tensor | None = None) -> Eagle3Model:
        """A new draft shaped like one of the target's layers, its draft vocabulary the sorted
        target ids `vocab_ids` (all of them when None), its LM head starting at the target's rows
        for those ids and its final norm at the target's: where training starts."""
        import copy

        head = target.get_output_embeddings().weight
        ids = torch.arange(head.shape[0]) if vocab_ids is None else vocab_ids
        cfg = copy.deepcopy(target.config.get_text_config())
        cfg.draft_vocab_size = len(ids)
        model = cls(cfg, head.shape[0], feature_layers)
        with torch.no_grad():
            model.d2t.copy_(ids - torch.arange(len(ids)))
            model.lm_head.weight.copy_(head[ids])
            model.norm.weight.copy_(target.get_decoder().norm.weight)
        return model

    def attach(self, target: Any) -> Eagle3Model:
        object.__setattr__(self, "embed", self.own_embed if self.own_embed is not None else target.get_input_embeddings())
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))

    def predict(self, input_ids, hidden, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False) -> torch.Tensor:
        """The layer's output [B, T, H] (before the norm) for pairs (hidden[:, t], input_ids[:, t]):
        hidden is fuse(target features) or the layer's own previous output."""
        x = torch.cat([self.embed(input_ids).to(hidden.dtype), hidden], -1)
        return self.decoder(inputs_embeds=x, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache).last_hidden_state

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def target_ids(self) -> torch.Tensor | None:
        """The target id of each draft id, or None for the identity map. Read once from d2t (set by
        loading or training before drafting) so drafting never syncs with the device for it."""
        if not hasattr(self, "_target_ids"):
            ids = torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t
            identity = self.draft_vocab == self.target_vocab and not bool(self.d2t.any())
            self._target_ids = None if identity else ids
        return self._target_ids

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V], -inf elsewhere."""
        ids = self.target_ids()
        if ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        full[..., ids.to(logits.device)] = logits
        return full

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep=0, **_):
        hidden = self.predict(input_ids, self.features, attention_mask, position_ids, past_key_values, use_cache)
        self.last_hidden = hidden
        keep = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return _Out(self.to_target(self.draft_logits(keep)))


class _Out:
    def __init__(self, logits):
        self.logits = logits


class MedusaDraft:
    """Proposer over MedusaHeads: k tokens from the feature of the row's last verified token."""

    kind = "medusa"
    needs_features = True
    feature_layers = None

    def __init__(self, heads: MedusaHeads, vocab_size: int, tree_width: int = 1):
        self.heads, self.vocab_size, self.tree_width = heads, vocab_size, tree_width
        self.h: torch.Tensor | None = None  # [B, H] feature whose LM-head token is the pending one

    def prefill(self, prompts, first_tokens, device, features: torch.Tensor) -> None:
        self.h = features[:, -1]  # left padding: the last column is every row's last prompt token

    @torch.inference_mode()
    def propose(self, k: int, lengths: torch.Tensor, params: SamplingParams, uniforms) -> Proposal:
        k, h = min(k, self.heads.num_heads), self._pending()
        logits = fit_vocab(self.heads(h.to(self.heads.heads[0][-1].weight.dtype), k), self.vocab_size)
        if params.greedy:
            if self.tree_width > 1:  # each head's next-best guesses too: verified as a tree
                top = logits.topk(self.tree_width, dim=-1).indices  # [B, k, w]
                return Proposal(top[..., 0], lengths.clamp(max=k), None, siblings=top[..., 1:])
            return Proposal(logits.argmax(-1), lengths.clamp(max=k), None)
        probs = logits_to_probs(logits.float(), params)  # [B, k, V]
        assert uniforms is not None  # given whenever the job samples
        tokens = torch.stack([sample_from(probs[:, j], uniforms[:, j, DRAFT]) for j in range(k)], 1)
        return Proposal(tokens, lengths.clamp(max=k), probs)

    def accept(self, n_accepted: list[int], emitted, proposed: bool, features: torch.Tensor) -> None:
        # features [B, k+1, H] of the columns fed this round; column n produced the row's next token.
        n = torch.tensor(n_accepted, device=features.device).clamp(max=features.shape[1] - 1)
        self.h = features[torch.arange(features.shape[0], device=features.device), n]

    def select(self, keep_idx: torch.Tensor) -> None:
        h = self._pending()
        self.h = h[keep_idx.to(h.device)]

    def _pending(self) -> torch.Tensor:
        if self.h is None:
            raise RuntimeError("a draft proposes and selects rows only after prefill()")
        return self.h


class EagleDraft:
    """Proposer over EagleModel or Eagle3Model. Its cache holds one entry per (target feature f_t, token x_{t+1})
    pair whose feature the target really computed; each round feeds the pairs verification just
    produced, then drafts on its own predicted features, and forgets those speculative entries
    afterwards (they were built on predictions, not on the target's features)."""

    needs_features = True

    def __init__(self, model: EagleModel | Eagle3Model, vocab_size: int, pad_id: int, tree_width: int = 1):
        self.model, self.vocab_size, self.pad_id, self.tree_width = model, vocab_size, pad_id, tree_width
        self.kind = "eagle3" if isinstance(model, Eagle3Model) else "eagle"
        self.feature_layers = model.feature_layers
        self.state: kv.KVState | None = None
        self.unfed_feats: list[torch.Tensor] = []  # per row [n, H]
        self.unfed_toks: list[list[int]] = []
        self._W = self._k = 0

    @torch.inference_mode()
    def prefill(self, prompts, first_tokens, device, features: torch.Tensor) -> None:
        ids, mask = kv.left_pad(prompts, self.pad_id, device)
        first = torch.tensor(first_tokens, device=device)[:, None]
        following = torch.cat([ids[:, 1:], first], 1)  # the token after each position
        self.state = kv.empty_state(len(prompts), device)
        # Every pair but the last now; the last (f_{P-1}, first token) starts the first round.
        features = self.model.fuse(features)
        if ids.shape[1] > 1:
            self.model.features = features[:, :-1]
            _, self.state = kv.forward(self.model, self.state, following[:, :-1], mask[:, :-1], last_only=True)
        self.unfed_feats = [features[b, -1:] for b in range(len(prompts))]  # fused
        self.unfed_toks = [[t] for t in first_tokens]

    @torch.inference_mode()
    def propose(self, k: int, lengths: torch.Tensor, params: SamplingParams, uniforms) -> Proposal:
        state = kv.started(self.state)
        device = state.mask.device
        toks, mask = kv.left_pad(self.unfed_toks, self.pad_id, device)
        W = toks.shape[1]
        feats = torch.zeros(len(self.unfed_toks), W, self.unfed_feats[0].shape[-1], dtype=self.unfed_feats[0].dtype,
                            device=device)
        for b, f in enumerate(self.unfed_feats):
            feats[b, W - f.shape[0]:] = f
        self.model.features = feats
        logits, self.state = kv.forward(self.model, state, toks, mask, last_only=True)
        tokens, probs, siblings = [], [], []
        tree = params.greedy and self.tree_width > 1
        for j in range(k):
            step = fit_vocab(logits[:, -1], self.vocab_size)
            if tree:  # the chain follows the first choice; the next-best guesses are verified beside it
                top = step.topk(self.tree_width, dim=-1).indices
                token = top[:, 0]
                siblings.append(top[:, 1:])
            elif params.greedy:
                token = step.argmax(-1)
            else:
                assert uniforms is not None  # given whenever the job samples
                p = logits_to_probs(step.float(), params)
                token = sample_from(p, uniforms[:, j, DRAFT])
                probs.append(p)
            tokens.append(token)
            if j < k - 1:  # the predicted feature and the drafted token make the next pair
                hidden = self.model.last_hidden
                assert hidden is not None  # the forward above set it
                self.model.features = hidden[:, -1:]
                ones = torch.ones_like(token)[:, None]
                logits, self.state = kv.forward(self.model, kv.started(self.state), token[:, None], ones, last_only=True)
        self._W, self._k = W, k
        return Proposal(torch.stack(tokens, 1), lengths, torch.stack(probs, 1) if probs else None,
                        siblings=torch.stack(siblings, 1) if siblings else None)

    @torch.inference_mode()
    def accept(self, n_accepted: list[int], emitted: list[list[int]], proposed: bool, features: torch.Tensor) -> None:
        """features [B, k+1, F]: the target's features at [pending, d1 .. dk]. Column j is followed
        by emitted[b][j] (the next accepted draft token, or the target's own token after the last)."""
        B = len(emitted)
        features = self.model.fuse(features)
        if proposed:
            spec_cols = self._k - 1
            if spec_cols > 0:  # drop every entry built on predicted features
                state = kv.started(self.state)
                keep = torch.cat([torch.ones(B, self._W, dtype=torch.bool, device=state.mask.device),
                                  torch.zeros(B, spec_cols, dtype=torch.bool, device=state.mask.device)], 1)
                self.state = kv.rollback(state, keep)
            self.unfed_feats = [features[b, : n_accepted[b] + 1] for b in range(B)]
            self.unfed_toks = [list(emitted[b][: n_accepted[b] + 1]) for b in range(B)]
        else:  # nothing was fed to the draft this round: the new pair joins the unfed ones
            self.unfed_feats = [torch.cat([self.unfed_feats[b], features[b, :1]]) for b in range(B)]
            self.unfed_toks = [self.unfed_toks[b] + [emitted[b][0]] for b in range(B)]

    def select(self, keep_idx: torch.Tensor) -> None:
        state = kv.started(self.state)
        self.state = kv.select_rows(state, keep_idx.to(state.mask.device))
        idx = keep_idx.tolist()
        self.unfed_feats = [self.unfed_feats[i] for i in idx]
        self.unfed_toks = [self.unfed_toks[i] for i in idx]


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _local_dir(source: str, local_paths: dict[str, str] | None) -> Path:
    """A local directory for a local path, an s3:// prefix (the runner's copy, in local_paths) or a
    hub id (snapshot)."""
    problem = local_source_problem(source)
    if problem:
        raise ModelLoadError(problem)
    path = Path(resolve_model_path(source, local_paths)).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source))
    except Exception as e:
        raise ModelLoadError(f"could not fetch draft {source!r}: {error_line(e)}") from e


def _state_dict(folder: Path, stems: tuple[str, ...]) -> dict:
    from safetensors.torch import load_file

    for stem in stems:
        for suffix in (".safetensors", ".pt", ".bin"):
            f = folder / f"{stem}{suffix}"
            if f.exists():
                return load_file(str(f)) if suffix == ".safetensors" else torch.load(str(f), map_location="cpu",
                                                                                     weights_only=True)
    raise ModelLoadError(f"no weights in {folder} (looked for {', '.join(s + '.safetensors|.pt|.bin' for s in stems)})")


def _checked_config(folder: Path, source: str, kind: str) -> dict:
    cfg = json.loads((folder / "config.json").read_text())
    problem = config_problem(kind, cfg)
    if problem:
        raise ModelLoadError(f"{source}: {problem}")
    return cfg


def load_medusa(source: str, target: Any, local_paths: dict[str, str] | None = None) -> MedusaHeads:
    """Heads in the Medusa reference layout: config.json names medusa_num_heads and
    medusa_num_layers (published configs carry nothing else: width and vocabulary come from the
    weights), medusa_lm_head.pt or .safetensors holds "{head}.{block}.linear.*" and
    "{head}.{num_layers}.weight". A file may hold more heads than its config names
    (FasterDecoding/medusa-vicuna-7b-v1.3: 5 in the file, 2 in the config): the config decides."""
    folder = _local_dir(source, local_paths)
    cfg = _checked_config(folder, source, "medusa")
    K, L = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    weights = _state_dict(folder, ("medusa_lm_head", "model"))
    weights = {k.removeprefix("medusa_head.").removeprefix("heads."): v for k, v in weights.items()}
    weights = {k: v for k, v in weights.items() if k.split(".")[0].isdigit() and int(k.split(".")[0]) < K}
    proj = weights.get(f"0.{L}.weight")
    if proj is None:
        raise ModelLoadError(f"{source}: no projection 0.{L}.weight for medusa_num_layers={L}")
    vocab, hidden = proj.shape
    head = target.get_output_embeddings().weight
    if hidden != head.shape[1]:
        raise ModelLoadError(f"{source}: Medusa heads of width {hidden}, but the target's features have {head.shape[1]}")
    heads = MedusaHeads(hidden, vocab, K, L)
    try:
        heads.heads.load_state_dict(weights)
    except RuntimeError as e:
        raise ModelLoadError(f"{source}: Medusa weights do not match its config: {str(e).splitlines()[0]}") from e
    return heads.to(device=head.device, dtype=head.dtype).eval()


def save_medusa(heads: MedusaHeads, out: Path, base: str) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    first = heads.heads[0][-1].weight
    (out / "config.json").write_text(json.dumps({
        "medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers, "hidden_size": first.shape[1],
        "vocab_size": first.shape[0], "base_model_name_or_path": base, "batchspec_draft": "medusa",
        # The residual blocks have biases (as in the reference); vLLM drops them unless told.
        "medusa_fc_bias": True}, indent=2))
    save_file({k: v.contiguous() for k, v in heads.heads.state_dict().items()}, str(out / "medusa_lm_head.safetensors"))


def load_eagle(source: str, target: Any, local_paths: dict[str, str] | None = None) -> EagleModel:
    """batchspec's layout (fc.*, decoder.*), or the EAGLE reference's (fc.*, layers.0.* without an
    input norm, no final norm, embed_tokens.* which the target's embedding replaces), read from
    model.safetensors or pytorch_model.bin."""
    from transformers import LlamaConfig

    folder = _local_dir(source, local_paths)
    _checked_config(folder, source, "eagle")
    config = LlamaConfig.from_pretrained(folder)
    head = target.get_output_embeddings().weight
    if config.hidden_size != head.shape[1]:
        raise ModelLoadError(f"{source}: EAGLE layer of width {config.hidden_size}, but the target's features have "
                             f"{head.shape[1]}")
    weights = _state_dict(folder, ("model", "pytorch_model"))
    reference = any(k.startswith("layers.") for k in weights)
    if reference:
        weights = {("decoder." + k if k.startswith("layers.") else k): v for k, v in weights.items()
                   if not k.startswith("embed_tokens.")}
    model = EagleModel(config, reference_layout=reference)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.startswith("decoder.embed_tokens")]
    if missing or unexpected:
        raise ModelLoadError(f"{source}: not an EAGLE checkpoint (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device=head.device, dtype=head.dtype).eval().attach(target)


def save_eagle(model: EagleModel, out: Path, base: str) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update({"batchspec_draft": "eagle", "base_model_name_or_path": base})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("decoder.embed_tokens")}
    save_file(state, str(out / "model.safetensors"))


EAGLE3_ARCH = "LlamaForCausalLMEagle3"


def _eagle3_config(folder: Path, source: str):
    """The draft layer's LlamaConfig from a reference config.json, or from the speculators format
    (speculators_model_type eagle3: the layer's config nested under transformer_layer_config, the
    EAGLE-3 fields at the top, norm_before_residual on unless it says otherwise, as vLLM reads it)."""
    from transformers import LlamaConfig

    raw = _checked_config(folder, source, "eagle3")
    if raw.get("speculators_model_type") is None:
        return LlamaConfig.from_pretrained(folder)
    fields = dict(raw.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                "fc_norm", "norm_output"):
        if key in raw:
            fields[key] = raw[key]
    fields["norm_before_residual"] = raw.get("norm_before_residual", True)
    return LlamaConfig(**{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})


def load_eagle3(source: str, target: Any, local_paths: dict[str, str] | None = None) -> Eagle3Model:
    """The EAGLE-3 reference layout (the module docstring), as its published checkpoints and vLLM
    have it: midlayer.* (or layers.0.*), fc.*, norm.*, lm_head.*, d2t, t2d, optional embed_tokens;
    the config in the reference form or the speculators one."""
    folder = _local_dir(source, local_paths)
    config = _eagle3_config(folder, source)
    head = target.get_output_embeddings().weight
    n_layers = target.config.get_text_config().num_hidden_layers
    layers = getattr(config, "eagle_aux_hidden_state_layer_ids", None) \
        or (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids") \
        or default_feature_layers(n_layers)
    if any(not 0 <= i <= n_layers for i in layers):
        raise ModelLoadError(f"{source}: EAGLE-3 feature layers {list(layers)} outside the target's 0..{n_layers}")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != head.shape[1]:
        raise ModelLoadError(f"{source}: EAGLE-3 draft for features of width {target_hidden}, but the target's have "
                             f"{head.shape[1]}")
    variant = [f for f in ("norm_before_fc", "fc_norm", "norm_output") if getattr(config, f, False)]
    if variant:
        raise ModelLoadError(f"{source}: EAGLE-3 variant with {', '.join(variant)}, which batchspec's engine does not "
                             "read; set model.backend: vllm to hand it to vLLM")
    weights = _state_dict(folder, ("model", "pytorch_model"))
    if "fc.weight" not in weights or not any(k.startswith(("midlayer.", "layers.0.")) for k in weights):
        raise ModelLoadError(f"{source}: not an EAGLE-3 checkpoint (needs fc.* and midlayer.* or layers.0.*)")
    renamed = {}
    for k, v in weights.items():
        if k.startswith(("midlayer.", "layers.0.")):
            renamed["decoder.layers.0." + k.split(".", 2 if k.startswith("layers.") else 1)[-1]] = v
        elif k != "t2d":
            renamed[k] = v
    model = Eagle3Model(config, head.shape[0], tuple(layers), target_hidden)
    if "embed_tokens.weight" in renamed:
        model.own_embed = nn.Embedding.from_pretrained(renamed.pop("embed_tokens.weight"))
    if "d2t" not in renamed:
        renamed["d2t"] = torch.zeros(model.draft_vocab, dtype=torch.long)
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [m for m in missing if not m.startswith("decoder.embed_tokens")]
    if missing or unexpected:
        raise ModelLoadError(f"{source}: EAGLE-3 weights do not match its config (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    if int((torch.arange(model.draft_vocab) + model.d2t).max()) >= head.shape[0]:
        raise ModelLoadError(f"{source}: d2t maps draft ids past the target's {head.shape[0]}-token vocabulary")
    return model.to(device=head.device, dtype=head.dtype).eval().attach(target)


def save_eagle3(model: Eagle3Model, out: Path, base: str) -> None:
    """The reference layout, readable by load_eagle3 and by vLLM's eagle3 method."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
            "attention_bias", "mlp_bias", "dtype", "norm_before_residual")
    cfg = {k: v for k, v in model.config.to_dict().items() if k in keep}
    cfg.update({"architectures": [EAGLE3_ARCH], "model_type": "llama", "num_hidden_layers": 1,
                "vocab_size": model.target_vocab, "draft_vocab_size": model.draft_vocab, "tie_word_embeddings": False,
                "target_hidden_size": model.fc.weight.shape[1] // len(model.feature_layers),
                # Under eagle_config: vLLM reads the layer count only there.
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(model.feature_layers)},
                "batchspec_draft": "eagle3", "base_model_name_or_path": base})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {}
    for k, v in model.state_dict().items():
        if k.startswith("decoder.layers.0."):
            state["midlayer." + k.removeprefix("decoder.layers.0.")] = v
        elif k == "own_embed.weight":
            state["embed_tokens.weight"] = v
        elif not k.startswith("decoder."):
            state[k] = v
    if model.draft_vocab == model.target_vocab:
        del state["d2t"]  # the identity map: vLLM refuses a d2t then
    else:
        t2d = torch.zeros(model.target_vocab, dtype=torch.bool)
        t2d[torch.arange(model.draft_vocab) + model.d2t.cpu()] = True
        state["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
