"""Train the demo pair: a small legal-summarization target and a smaller draft, on CPU.

    python -m batchspec.demo.train --out models          # seeded; step counts fixed, not time-based

Both models share one byte-level BPE tokenizer (2048 tokens) trained on the training split of
batchspec.demo.corpus. Each step draws 32 fresh training contracts (seeds never repeat, so there
is no overfitting to manage), and the loss covers only the summary and its EOS: the prompt is
context to copy from, not text to imitate, and it is where the copying happens (party names,
dates, amounts). AdamW, linear warmup, cosine decay to 10%. The models are evaluated through the
real loading path and the real engine: greedy exact match of the summary on held-out contracts
(eval split), and the draft's acceptance against the target.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from pathlib import Path

import torch

from .corpus import examples

# Shapes: the target needs a few layers for induction/copy heads; the draft is as small as still
# copies well, so its step costs a fraction of the target's.
TARGET = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768)
DRAFT = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)


def build_tokenizer(out: Path) -> Path:
    from ..testing import build_tokenizer as build

    corpus = [e["prompt"] + " " + e["summary"] for e in examples("train", 4000)]
    return build(out, vocab_size=2048, corpus=corpus)


def batch_tensors(tok, batch: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, labels [B, T]; labels are -100 except on the summary and EOS."""
    seqs, labels = [], []
    for e in batch:
        p = tok(e["prompt"], add_special_tokens=False)["input_ids"]
        s = tok(" " + e["summary"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + s)
        labels.append([-100] * len(p) + s)
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), tok.pad_token_id)
    lab = torch.full((len(seqs), T), -100)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, (x, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(x)] = torch.tensor(x)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return ids, mask, lab


def train(name: str, shape: dict, tok_dir: Path, out: Path, steps: int, lr: float, seed: int, batch: int = 32,
          log_every: int = 50) -> dict:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         **shape)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:  # linear warmup, then cosine decay to 10% of the peak
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        # Fresh contracts every step: training seeds [offset, offset + batch) never repeat.
        data = examples("train", batch, offset=(seed * 1_000_003 + step * batch) % 900_000)
        ids, mask, labels = batch_tensors(tok, data)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"{name} step {step}/{steps} loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} "
                  f"lr {lr_at(step):.2e} {time.perf_counter() - t0:.0f}s", flush=True)
    minutes = (time.perf_counter() - t0) / 60
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {"name": name, "params": params, "steps": steps, "lr": lr, "batch": batch, "seed": seed,
            "train_minutes": round(minutes, 1), "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "shape": shape}


def _frozen_target(target_dir: Path, layers: tuple[int, ...] | None = None):
    """The trained target, frozen, and a function: ids, mask -> (features [B, T, F], teacher
    tokens [B, T]: the target's own greedy next token at each position). Features are the LM
    head's input, or the inputs of decoder layers `layers` (EAGLE-3)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)

    from ..engine.cache import capture_features

    @torch.no_grad()
    def features(ids, mask):
        with capture_features(target, layers) as captured:
            logits = target(input_ids=ids, attention_mask=mask).logits
        return captured(), logits.argmax(-1)

    return target, features


def _fit(kind: str, params: list, tok, features, step_loss, steps: int, lr: float, seed: int, batch: int,
         log_every: int) -> tuple[list[float], list[float], float]:
    """The loop the learned-draft trainers share: fresh training contracts each step, the frozen
    target's features and greedy tokens, AdamW with linear warmup and cosine decay to 10%, clipped
    gradients. step_loss(ids, mask, labels, feats, teacher) -> (loss, hits, total). Returns the
    losses, the top-1 agreement per step, and the minutes taken."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    t0, losses, accs = time.perf_counter(), [], []
    for step in range(steps):
        data = examples("train", batch, offset=(seed * 1_000_003 + 7_777 + step * batch) % 900_000)
        ids, mask, labels = batch_tensors(tok, data)
        feats, teacher = features(ids, mask)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        loss, hits, total = step_loss(ids, mask, labels, feats, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(hits / max(total, 1))
        if step % log_every == 0 or step == steps - 1:
            print(f"{kind} step {step}/{steps} loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} "
                  f"top-1 {sum(accs[-log_every:]) / len(accs[-log_every:]):.3f} {time.perf_counter() - t0:.0f}s",
                  flush=True)
    return losses, accs, (time.perf_counter() - t0) / 60


def _run_record(out: Path, kind: str, params: list, steps: int, lr: float, batch: int, seed: int, losses: list,
                accs: list, minutes: float, **extra) -> dict:
    return {"name": out.name, "kind": kind, "params": sum(p.numel() for p in params), "steps": steps, "lr": lr,
            "batch": batch, "seed": seed, **extra, "train_minutes": round(minutes, 1),
            "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "final_top1": round(sum(accs[-50:]) / len(accs[-50:]), 3)}


def train_learned(kind: str, target_dir: Path, tok_dir: Path, out: Path, steps: int, lr: float, seed: int,
                  batch: int = 32, heads: int = 4, log_every: int = 50) -> dict:
    """Self-distillation of a Medusa or EAGLE draft on the frozen target (docs/demo.md).

    medusa: head i on feature f_t learns the target's greedy token at t+2+i (cross-entropy),
            on positions whose next token is part of the summary (where generation happens).
    eagle:  the layer reads (f_t, x_{t+1}) and learns f_{t+1} (smooth L1) and the target's greedy
            token from it through the target's LM head (cross-entropy, weight 0.1), on every
            position; the input features get Gaussian noise (std 0.05 of their scale) so the
            layer tolerates its own predictions when it drafts several steps.
    """
    from transformers import AutoTokenizer

    from ..engine.learned import EagleModel, MedusaHeads, save_eagle, save_medusa

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    target, features = _frozen_target(target_dir)
    lm_head = target.get_output_embeddings()
    H, V = lm_head.weight.shape[1], lm_head.weight.shape[0]
    module: MedusaHeads | EagleModel
    if kind == "medusa":
        module = MedusaHeads(H, V, heads)
        module.init_from_lm_head(lm_head)
    else:
        module = EagleModel(target.config).attach(target)
    params = [p for p in module.parameters() if p.requires_grad]

    def step_loss(ids, mask, labels, feats, teacher):
        if kind == "medusa":
            loss, hits, total = 0.0, 0, 0
            for i, head in enumerate(module.heads):
                T = ids.shape[1] - 1 - i  # positions t with a teacher token at t+1+i
                lab = teacher[:, 1 + i: 1 + i + T]
                valid = (labels[:, 1: 1 + T] != -100) & (mask[:, 1 + i: 1 + i + T] == 1)
                li = head(feats[:, :T][valid])  # only the positions that count: a fifth of them
                loss = loss + torch.nn.functional.cross_entropy(li, lab[valid]) * (0.8 ** i)
                hits += int((li.argmax(-1) == lab[valid]).sum())
                total += int(valid.sum())
            return loss, hits, total
        noisy = feats[:, :-1] + torch.randn_like(feats[:, :-1]) * 0.05 * feats.std()
        out_mask = mask[:, :-1]
        pos = (out_mask.cumsum(1) - 1).clamp_min(0)
        hidden = module.predict(ids[:, 1:], noisy, attention_mask=out_mask, position_ids=pos)
        valid = mask[:, 1:] == 1
        reg = torch.nn.functional.smooth_l1_loss(hidden[valid], feats[:, 1:][valid])
        tok_logits = lm_head(hidden[valid])
        cls = torch.nn.functional.cross_entropy(tok_logits, teacher[:, 1:][valid])
        return reg + 0.1 * cls, int((tok_logits.argmax(-1) == teacher[:, 1:][valid]).sum()), int(valid.sum())

    losses, accs, minutes = _fit(kind, params, tok, features, step_loss, steps, lr, seed, batch, log_every)
    module.eval()
    if isinstance(module, MedusaHeads):
        save_medusa(module, out, str(target_dir))
    else:
        save_eagle(module, out, str(target_dir))
    return _run_record(out, kind, params, steps, lr, batch, seed, losses, accs, minutes)


# EAGLE-3 on the 3-layer demo target: the outputs of layers 1, 2 and 3 (the inputs of layers 1, 2
# and of the final norm) are its low, middle and high features.
EAGLE3_LAYERS = (1, 2, 3)


def draft_vocabulary(features, tok, vocab_size: int, size: int, seed: int, batches: int = 30) -> torch.Tensor:
    """The `size` target ids the target predicts most often on training contracts, sorted (the
    EAGLE-3 draft vocabulary; d2t maps draft id i to the i-th of them)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(batches):
        ids, mask, _ = batch_tensors(tok, examples("train", 32, offset=(seed * 7_919 + 500_000 + i * 32) % 900_000))
        _, teacher = features(ids, mask)
        counts += torch.bincount(teacher[mask == 1], minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:size].sort().values


def train_eagle3(target_dir: Path, tok_dir: Path, out: Path, steps: int, lr: float, seed: int, batch: int = 32,
                 unroll: int = 3, vocab: int = 512, log_every: int = 50) -> dict:
    """EAGLE-3 by self-distillation on the frozen target (docs/demo.md): tokens only, no feature
    regression. Each pair (fused features at t, token x_{t+1}) predicts the target's greedy token
    after x_{t+1}; then the layer's own output replaces the features for `unroll - 1` more steps
    (training-time test: step j at anchor t reads its step j-1 output and x_{t+1+j}, attends as
    drafting does, and predicts the token after x_{t+1+j}), losses weighted 0.8^j. The LM head
    covers the `vocab` ids the target predicts most; positions whose target token lies outside it
    do not count."""
    from transformers import AutoTokenizer

    from ..engine.learned import Eagle3Model, save_eagle3
    from ..training.eagle3 import unrolled_loss

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    target, features = _frozen_target(target_dir, EAGLE3_LAYERS)
    V = target.get_output_embeddings().weight.shape[0]
    ids_of = draft_vocabulary(features, tok, V, vocab, seed)
    to_draft = torch.full((V,), -100, dtype=torch.long)
    to_draft[ids_of] = torch.arange(len(ids_of))
    module = Eagle3Model.from_target(target, EAGLE3_LAYERS, ids_of).attach(target)
    params = [p for p in module.parameters() if p.requires_grad]

    def step_loss(ids, mask, _labels, feats, teacher):
        return unrolled_loss(module, ids, mask, feats, teacher, to_draft, tok.pad_token_id, unroll)

    losses, accs, minutes = _fit("eagle3", params, tok, features, step_loss, steps, lr, seed, batch, log_every)
    module.eval()
    save_eagle3(module, out, str(target_dir))
    return _run_record(out, "eagle3", params, steps, lr, batch, seed, losses, accs, minutes, unroll=unroll,
                       draft_vocab=len(ids_of), layers=list(EAGLE3_LAYERS))


LEARNED_CARD = """# {name}

{what}, trained by `python -m batchspec.demo.train --only {kind}` on the frozen demo target
(`models/legal-target`) by self-distillation: the target's own {labels} on synthetic training
contracts are the labels ({description}). {params:,} trained parameters; {shared}.

Training: {steps} steps of 32 fresh contracts, AdamW lr {lr}, warmup + cosine, seed {seed}, CPU
({train_minutes} minutes on 2 cores); final top-1 agreement with the target on training
positions {final_top1}. Use it with `model.draft: {{kind: {kind}, path: models/{name}}}` ({served}).
Evaluation: `batchspec_train.json`; figures in docs/demo.md.
"""

_HF_ONLY = "served by batchspec's hf engine"
# kind -> (what, description, labels, shared, served)
LEARNED_WHAT = {
    "medusa": ("Four Medusa heads (one residual SiLU block and a vocabulary projection each) for the demo target",
               "head i learns the target's token i+2 positions ahead", "greedy tokens and features",
               "the heads read the target's top-layer feature", _HF_ONLY),
    "eagle": ("An EAGLE feature draft (fc over [token embedding; feature] and one Llama decoder layer) for the demo "
              "target", "the layer learns the target's next top-layer feature and, through the target's LM head, "
              "its next token", "greedy tokens and features", "the token embedding and LM head are the target's",
              _HF_ONLY),
    "eagle3": ("An EAGLE-3 draft (fc over the outputs of the target's three layers, one decoder layer over [token "
               "embedding; fused feature], its own LM head over the 512 ids the target predicts most, mapped to "
               "target ids by d2t) for the demo target, saved in the EAGLE-3 reference layout",
               "tokens only, no feature regression; each position is unrolled 3 steps on the layer's own outputs, "
               "as drafting runs", "greedy tokens",
               "the token embedding is the target's, the LM head its own (initialised from the target's rows)",
               "backend auto: vLLM's eagle3 method when vLLM is installed, else batchspec's hf engine; both read "
               "this layout"),
}


def learned_card(kind: str, run: dict) -> str:
    what, description, labels, shared, served = LEARNED_WHAT[kind]
    return LEARNED_CARD.format(what=what, description=description, labels=labels, shared=shared, served=served,
                               **run)


def evaluate(target_dir: Path, draft_dir: Path, n: int = 40, learned: dict[str, Path] | None = None) -> dict:
    """Greedy exact match on held-out contracts for each model alone, plus acceptance per draft kind."""
    from ..engine.engine import DraftSpec, Engine

    ex = examples("eval", n)
    prompts = [e["prompt"] for e in ex]
    result: dict[str, int | float | None] = {"eval_contracts": n}
    for label, path in (("target", target_dir), ("draft", draft_dir)):
        engine = Engine.load(str(path), DraftSpec(kind="none"))
        outs, _ = engine.generate(engine.tokenize(prompts), max_new_tokens=64, speculate=False)
        exact = sum(o.text.strip() == e["summary"] for o, e in zip(outs, ex))
        result[f"{label}_exact_match"] = exact
    kinds = [("model", DraftSpec("model", path=str(draft_dir))), ("quantized", DraftSpec("quantized")),
             ("layer_skip", DraftSpec("layer_skip", layers=1)), ("ngram", DraftSpec("ngram"))]
    kinds += [(kind, DraftSpec(kind, path=str(path))) for kind, path in (learned or {}).items()
              if (path / "config.json").exists()]
    for kind, spec in kinds:
        engine = Engine.load(str(target_dir), spec)
        outs, _ = engine.generate(engine.tokenize(prompts), max_new_tokens=64, speculate=True, draft_length=4)
        acc, drafted = sum(o.stats.accepted_tokens for o in outs), sum(o.stats.draft_tokens for o in outs)
        rounds = sum(o.stats.spec_rounds for o in outs)
        result[f"acceptance_{kind}"] = round(acc / drafted, 3) if drafted else None
        result[f"mean_acceptance_length_{kind}"] = round(1 + acc / rounds, 2) if rounds else None
    return result


MODEL_CARD = """# {name}

A {params:,}-parameter Llama-style causal LM trained from scratch by `python -m batchspec.demo.train`
(batchspec's demo {role}) on synthetic contracts from `batchspec.demo.corpus` (leases, NDAs,
employment agreements, promissory notes, services agreements with random parties, dates, amounts
and governing law). It writes a one-sentence summary after the prompt
`Summarize the contract.\\n<contract>\\nSummary:`. It knows nothing else: it is a demo model, not
a summarizer for real contracts.

Training: {steps} steps of 32 fresh contracts, AdamW lr {lr}, warmup + cosine, seed {seed},
loss on the summary only, CPU ({train_minutes} minutes on 2 cores). Shape: {shape}.
Evaluation (greedy, {eval_contracts} held-out contracts): see `batchspec_train.json`.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models")
    ap.add_argument("--target-steps", type=int, default=2600)
    ap.add_argument("--draft-steps", type=int, default=2500)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    ap.add_argument("--only", choices=("both", "target", "draft", "medusa", "eagle", "eagle3"), default="both",
                    help="retrain one model and keep the others (and the tokenizer) already in --out; medusa and "
                         "eagle, eagle3 train a learned draft on the frozen target")
    ap.add_argument("--medusa-steps", type=int, default=1500)
    ap.add_argument("--eagle-steps", type=int, default=1200)
    ap.add_argument("--medusa-lr", type=float, default=3e-3)
    ap.add_argument("--eagle-lr", type=float, default=3e-3)
    ap.add_argument("--eagle3-steps", type=int, default=800)
    ap.add_argument("--eagle3-lr", type=float, default=3e-3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    tok_dir = build_tokenizer(out / "tokenizer")
    target_dir, draft_dir = out / "legal-target", out / "legal-draft"
    learned = {kind: out / f"legal-{kind}" for kind in ("medusa", "eagle", "eagle3")}
    runs = {}
    if args.only in learned:
        kind = args.only
        trainer = train_eagle3 if kind == "eagle3" else functools.partial(train_learned, kind)
        run = trainer(target_dir, tok_dir, learned[kind], getattr(args, f"{kind}_steps"), getattr(args, f"{kind}_lr"),
                      args.seed)
        ev = evaluate(target_dir, draft_dir, learned=learned)
        print(json.dumps(ev, indent=2))
        (learned[kind] / "batchspec_train.json").write_text(json.dumps({**run, "evaluation": ev}, indent=2))
        (learned[kind] / "README.md").write_text(learned_card(kind, run))
        return
    if args.only in ("both", "target"):
        runs["target"] = train("legal-target", TARGET, tok_dir, target_dir, args.target_steps, args.target_lr, args.seed)
    if args.only in ("both", "draft"):
        runs["draft"] = train("legal-draft", DRAFT, tok_dir, draft_dir, args.draft_steps, args.draft_lr, args.seed)
    ev = evaluate(target_dir, draft_dir, learned=learned)
    print(json.dumps(ev, indent=2))
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        record = path / "batchspec_train.json"
        run = runs.get(role) or {k: v for k, v in json.loads(record.read_text()).items() if k != "evaluation"}
        record.write_text(json.dumps({**run, "evaluation": ev}, indent=2))
        (path / "README.md").write_text(MODEL_CARD.format(role=role, **run, eval_contracts=ev["eval_contracts"]))


if __name__ == "__main__":
    main()
