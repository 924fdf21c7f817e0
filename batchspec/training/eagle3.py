"""Distil an EAGLE-3 draft from committed outputs (kind `eagle3`): white-box, on the target's own
features and greedy tokens, computed batch by batch.

An EAGLE-3 draft reads the target's hidden states at three layers (low, middle, high). They are
not in an output, so each training batch's rows (prompt and completion) go through the frozen
target in one prefill pass, whose layer inputs and greedy next tokens are the batch's features and
labels; they live for that batch only, so memory is one batch's features whatever the number of
rows (no hidden-state cache on disk). The loss is the demo trainer's (batchspec.demo.train):
tokens only, each position unrolled `unroll` steps on the layer's own outputs as drafting runs
(training-time test), step j weighted 0.8^j. Every position counts, prompt included: the target's
prediction there is as much its own distribution as in the completion.

Without `--from`, the draft starts new, shaped like one of the target's layers, its vocabulary the
`vocab` ids the target predicts most on the rows' first batches: outputs alone, no corpus. After
each epoch the held-out rows' first-step agreement with the target's greedy token (the
per-token acceptance of a draft's first proposal) picks the epoch kept.
"""

from __future__ import annotations

import copy
import math
import random
import time
from typing import Any

import torch

from .train import Example, _batch


def unrolled_mask(valid: torch.Tensor, step: int) -> torch.Tensor:
    """Attention for step `step` of training-time unrolling, as drafting attends: anchor t's
    query sees the real pairs 0..t (step 0, causal) and its own earlier predictions (steps
    1..step, the same anchor only). valid [B, A]: the real pairs. Returns [B, 1, A, (step+1) A]
    additive (0 visible, min elsewhere)."""
    B, A = valid.shape
    causal = torch.ones(A, A, dtype=torch.bool).tril()[None] & valid[:, None, :].bool()
    blocks = [causal] + [torch.eye(A, dtype=torch.bool)[None].expand(B, A, A)] * step
    seen = torch.cat(blocks, -1)[:, None]
    return torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)


def unrolled_loss(module, ids: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor, teacher: torch.Tensor,
                  to_draft: torch.Tensor, pad: int, unroll: int) -> tuple[torch.Tensor, int, int]:
    """(loss, first-step hits, first-step positions): each pair (fused features at t, token t+1)
    predicts the target's greedy token after t+1, then `unroll - 1` more steps on its own output."""
    from transformers import DynamicCache

    B, T = ids.shape
    A = T - 1  # anchors t: pairs (features at t, token t+1)
    ids_ext = torch.cat([ids, torch.full((B, unroll), pad)], 1)
    real = torch.cat([mask, torch.zeros(B, unroll, dtype=mask.dtype)], 1)
    labels_ext = torch.cat([to_draft[teacher], torch.full((B, unroll), -100)], 1)
    valid0 = mask[:, 1:]
    cache, hidden = DynamicCache(), module.fuse(feats[:, :-1])
    loss, hits, total = torch.zeros(()), 0, 0
    for j in range(unroll):
        x = ids_ext[:, 1 + j: 1 + j + A]
        pos = torch.arange(A)[None].expand(B, A) + j
        hidden = module.predict(x, hidden, attention_mask=unrolled_mask(valid0, j), position_ids=pos,
                                past_key_values=cache, use_cache=True)
        lab = labels_ext[:, 1 + j: 1 + j + A].masked_fill(real[:, 1 + j: 1 + j + A] == 0, -100)
        keep = lab != -100
        logits = module.draft_logits(hidden[keep])
        loss = loss + torch.nn.functional.cross_entropy(logits, lab[keep]) * (0.8 ** j)
        if j == 0:
            hits, total = int((logits.argmax(-1) == lab[keep]).sum()), int(keep.sum())
    return loss, hits, total


def frozen_target(path: str):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def feature_pass(target, layers: tuple[int, ...]):
    """ids, mask -> (the target's inputs of `layers` [B, T, F], its greedy next tokens [B, T]): one prefill pass."""
    from ..engine.cache import capture_features

    @torch.no_grad()
    def features(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with capture_features(target, layers) as captured:
            logits = target(input_ids=ids, attention_mask=mask).logits
        return captured(), logits.argmax(-1)

    return features


def fine_tune_eagle3(target_path: str, start: str | None, tokenizer, train: list[Example], held: list[Example],
                     epochs: int = 8, lr: float = 1e-3, batch: int = 16, seed: int = 0, unroll: int = 3,
                     vocab: int = 512, log=print) -> tuple[Any, dict[str, Any]]:
    """(the EAGLE-3 draft of the best epoch by held-out first-step agreement, what training did)."""
    from ..engine.learned import Eagle3Model, default_feature_layers, load_eagle3

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    target = frozen_target(target_path)
    if start:
        module = load_eagle3(start, target).float().train()
        features = feature_pass(target, module.feature_layers)
    else:
        layers = default_feature_layers(target.config.get_text_config().num_hidden_layers)
        features = feature_pass(target, layers)
        module = Eagle3Model.from_target(target, layers, _vocabulary(features, train, pad, vocab)).attach(target)
    V = target.get_output_embeddings().weight.shape[0]
    to_draft = torch.full((V,), -100, dtype=torch.long)
    to_draft[torch.arange(module.draft_vocab) + module.d2t] = torch.arange(module.draft_vocab)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    order = [e for e in train for _ in range(e.repeats)]
    steps, step = epochs * math.ceil(len(order) / batch), 0
    t0, rng = time.perf_counter(), random.Random(seed)

    def agreement() -> float:
        hits = total = 0
        with torch.no_grad():
            for b in range(0, len(held), batch):
                ids, mask, _ = _batch(held[b: b + batch], pad)
                feats, teacher = features(ids, mask)
                _, h, n = unrolled_loss(module, ids, mask, feats, teacher, to_draft, pad, 1)
                hits, total = hits + h, total + n
        return hits / max(total, 1)

    seen: list[dict[str, Any]] = [{"epoch": 0, "loss": None, "held_out_first_step_agreement": agreement()}]
    best, best_state = seen[0], copy.deepcopy(module.state_dict())
    for epoch in range(1, epochs + 1):
        rng.shuffle(order)
        losses = []
        for b in range(0, len(order), batch):
            ids, mask, _ = _batch(order[b: b + batch], pad)
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 20)) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
            feats, teacher = features(ids, mask)
            loss, _, _ = unrolled_loss(module, ids, mask, feats, teacher, to_draft, pad, unroll)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(loss.item())
            step += 1
        seen.append({"epoch": epoch, "loss": sum(losses) / len(losses), "held_out_first_step_agreement": agreement()})
        log(f"epoch {epoch}/{epochs}: loss {seen[-1]['loss']:.3f}, held-out first-step agreement "
            f"{seen[-1]['held_out_first_step_agreement']:.3f}")
        if seen[-1]["held_out_first_step_agreement"] > best["held_out_first_step_agreement"]:
            best, best_state = seen[-1], copy.deepcopy(module.state_dict())
    module.load_state_dict(best_state)
    return module.eval(), {"steps": steps, "train_s": round(time.perf_counter() - t0, 2), "epochs": seen,
                           "kept_epoch": best["epoch"], "lr": lr, "batch": batch, "seed": seed, "unroll": unroll,
                           "feature_layers": list(module.feature_layers), "draft_vocab": module.draft_vocab,
                           "train_rows": len(train), "rows_seen_twice": sum(e.repeats > 1 for e in train)}


def _vocabulary(features, train: list[Example], pad: int, size: int, batches: int = 30) -> torch.Tensor:
    """The `size` target ids the target predicts most often over the first rows (sorted): the draft's vocabulary."""
    counts: torch.Tensor | None = None
    for b in range(0, min(len(train), batches * 16), 16):
        ids, mask, _ = _batch(train[b: b + 16], pad)
        _, teacher = features(ids, mask)
        got = torch.bincount(teacher[mask == 1])
        counts = got if counts is None else torch.nn.functional.pad(counts, (0, max(0, len(got) - len(counts)))) \
            + torch.nn.functional.pad(got, (0, max(0, len(counts) - len(got))))
    assert counts is not None
    return counts.argsort(descending=True, stable=True)[:size].sort().values
