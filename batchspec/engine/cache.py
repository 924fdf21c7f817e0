"""KV state for a batch of rows that advance by different amounts each round.

Cache invariant: every row shares one cache width S. Slot (b, c) holds a real token of row b iff
mask[b, c] == 1; every other slot (left padding, draft tokens the target rejected) is garbage that
attention never reads. Positions are passed explicitly (position_ids), so a hole does not shift
the positions of the tokens after it. Example, k = 3, row 0 accepted 1 draft token, row 1 all 3:

    columns appended this round:   pending d1 d2 d3
    row 0 mask                      1      1  0  0     -> next_pos += 2
    row 1 mask                      1      1  1  1     -> next_pos += 4

Trailing columns that are holes in every row are cropped, so the cache grows by the batch's
maximum accepted length per round, not by k + 1.

Works with any HF causal LM that accepts a 2-D attention_mask with holes, position_ids and a
croppable DynamicCache (Llama, Qwen2, Mistral without sliding window, GPT-2, ...).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class KVState:
    cache: DynamicCache  # mutated in place by the model's forward (HF API); everything else is replaced
    mask: torch.Tensor  # [B, S] long, 1 = real token
    next_pos: torch.Tensor  # [B] long, position id of the next token fed to the row


def empty_state(batch: int, device: torch.device) -> KVState:
    return KVState(
        cache=DynamicCache(),
        mask=torch.zeros(batch, 0, dtype=torch.long, device=device),
        next_pos=torch.zeros(batch, dtype=torch.long, device=device),
    )


def started(state: KVState | None) -> KVState:
    """A draft's cache, which its prefill() starts: proposing, accepting or selecting rows before
    it is a caller's error."""
    if state is None:
        raise RuntimeError("a draft proposes, accepts and selects rows only after prefill()")
    return state


def forward(
    model: torch.nn.Module,
    state: KVState,
    input_ids: torch.Tensor,  # [B, T]
    input_mask: torch.Tensor,  # [B, T] 1 = real token, 0 = hole (only left of a row's real tokens)
    last_only: bool = False,
) -> tuple[torch.Tensor, KVState]:
    """Append T columns to every row; return logits [B, T, V] (or [B, 1, V] if last_only)."""
    positions = (state.next_pos[:, None] + input_mask.cumsum(1) - 1).clamp_min(0)  # [B, T]
    mask = torch.cat([state.mask, input_mask], dim=1)  # [B, S + T]
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1 if last_only else 0,
        **{_cache_kwarg(model): state.cache},
    )
    return out.logits, KVState(state.cache, mask, state.next_pos + input_mask.sum(1))


@contextlib.contextmanager
def capture_head_input(model: Any):
    """Collect what the model's LM head reads during the block: the top-layer hidden states after
    the final norm, the features learned drafts (Medusa, EAGLE) draft from and train on. Taken at
    the head's input, so it holds for any architecture. Yields a list; its last item is [B, T, H]."""
    captured: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        hook.remove()


@contextlib.contextmanager
def capture_layer_inputs(model: torch.nn.Module, layers: tuple[int, ...]):
    """Collect the hidden states entering decoder layers `layers` during the block (index n, one
    past the last layer, is the last layer's output before the final norm): EAGLE-3's fused
    low/middle/high features, numbered as its reference implementation and vLLM number them.
    Yields a function returning the last forward's states concatenated in the given order,
    [B, T, len(layers) * H]."""
    from .models import decoder_layers

    holder, name = decoder_layers(model)
    blocks = getattr(holder, name)
    found: dict[int, torch.Tensor] = {}

    def grab_input(i):
        return lambda _m, args, kwargs: found.__setitem__(i, args[0] if args else kwargs["hidden_states"])

    def grab_output(i):
        return lambda _m, _args, _kwargs, out: found.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = []
    for i in layers:
        if not 0 <= i <= len(blocks):
            raise ValueError(f"feature layer {i} outside the target's 0..{len(blocks)}")
        hooks.append(blocks[i].register_forward_pre_hook(grab_input(i), with_kwargs=True) if i < len(blocks)
                     else blocks[-1].register_forward_hook(grab_output(i), with_kwargs=True))
    try:
        yield lambda: torch.cat([found[i] for i in layers], -1)
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def capture_features(model: torch.nn.Module, layers: tuple[int, ...] | None = None):
    """The features a learned draft reads: the LM head's input (layers None) or the inputs of the
    given decoder layers. Yields a function returning the last forward's [B, T, F]."""
    if layers:
        with capture_layer_inputs(model, layers) as features:
            yield features
    else:
        with capture_head_input(model) as captured:
            yield lambda: captured[-1]


def forward_with_features(
    model: torch.nn.Module, state: KVState, input_ids: torch.Tensor, input_mask: torch.Tensor,
    layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, KVState, torch.Tensor]:
    """forward() for every position, plus the features a learned draft reads ([B, T, F]; see
    capture_features)."""
    with capture_features(model, layers) as features:
        logits, state = forward(model, state, input_ids, input_mask)
    return logits, state, features()


def forward_tree(
    model: torch.nn.Module, state: KVState, input_ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor,
    layers: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, KVState, torch.Tensor]:
    """Append T tree nodes to every row in one pass: node i sees the row's cache and the nodes j
    with tree[i, j] (its ancestors and itself); positions [B, T] are explicit (a node's depth).
    Returns logits [B, T, V], the state with all T columns real (roll the rejected ones back),
    and the features a learned draft reads (capture_features: the LM head's input, or layers')."""
    B, T = input_ids.shape
    S = state.mask.shape[1]
    visible = torch.cat([state.mask.bool()[:, None, None, :].expand(B, 1, T, S),
                         tree.bool()[None, None].expand(B, 1, T, T)], dim=-1)
    dtype = next(model.parameters()).dtype
    mask4d = torch.zeros(B, 1, T, S + T, dtype=dtype, device=input_ids.device).masked_fill(~visible, torch.finfo(dtype).min)
    with capture_features(model, layers) as features:
        out = model(input_ids=input_ids, attention_mask=mask4d, position_ids=positions, use_cache=True,
                    **{_cache_kwarg(model): state.cache})
    mask = torch.cat([state.mask, torch.ones_like(input_ids)], dim=1)
    return out.logits, KVState(state.cache, mask, state.next_pos + T), features()


_CACHE_KWARG: dict[type, str] = {}  # per model class


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.x is renaming `past_key_values` to `cache` model by model (GPT-2 first).
    cls = type(model)
    if cls not in _CACHE_KWARG:
        _CACHE_KWARG[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _CACHE_KWARG[cls]


def rollback(state: KVState, keep: torch.Tensor) -> KVState:
    """Turn the last T appended columns into holes where keep [B, T] is False, then crop.

    keep must mark a prefix of each row's real tokens in those columns (verification keeps the
    accepted prefix), so next_pos simply drops by the number of real tokens removed.
    """
    T = keep.shape[1]
    tail = state.mask[:, -T:]
    new_tail = tail * keep.long()
    mask = torch.cat([state.mask[:, :-T], new_tail], dim=1)
    next_pos = state.next_pos - (tail - new_tail).sum(1)
    return crop_trailing(KVState(state.cache, mask, next_pos))


def crop_trailing(state: KVState) -> KVState:
    """Drop trailing columns that are holes in every row (their KV is garbage for all rows)."""
    live = state.mask.any(dim=0)  # [S]
    width = int(live.nonzero().max()) + 1 if bool(live.any()) else 0
    drop = state.mask.shape[1] - width
    if drop > 0:
        state.cache.crop(-drop)
        state = KVState(state.cache, state.mask[:, :width], state.next_pos)
    return state


def select_rows(state: KVState, keep_idx: torch.Tensor) -> KVState:
    """Keep only the rows keep_idx [B'] (rows that finished leave the batch's work)."""
    state.cache.batch_select_indices(keep_idx)
    mask = state.mask[keep_idx]
    # Columns that were only used by departed rows are now holes everywhere; drop leading ones too.
    live = mask.any(dim=0)
    first = int(live.nonzero().min()) if bool(live.any()) else 0
    if first > 0:
        layers: list[Any] = state.cache.layers  # DynamicCache layers, each with keys and values
        for layer in layers:
            layer.keys = layer.keys[..., first:, :]
            layer.values = layer.values[..., first:, :]
        mask = mask[:, first:]
    return crop_trailing(KVState(state.cache, mask, state.next_pos[keep_idx]))


def left_pad(sequences: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids [B, T], mask [B, T])."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)
