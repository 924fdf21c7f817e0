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


def _frozen_target(target_dir: Path):
    """The trained target, frozen, and a function: ids, mask -> (features [B, T, H], teacher
    tokens [B, T]: the target's own greedy next token at each position)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)

    from ..engine.cache import capture_head_input

    @torch.no_grad()
    def features(ids, mask):
        with capture_head_input(target) as captured:
            logits = target(input_ids=ids, attention_mask=mask).logits
        return captured[-1], logits.argmax(-1)

    return target, features


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
    if kind == "medusa":
        module = MedusaHeads(H, V, heads)
        module.init_from_lm_head(lm_head)
    else:
        module = EagleModel(target.config).attach(target)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, steps // 20)
    t0, losses, accs = time.perf_counter(), [], []
    for step in range(steps):
        data = examples("train", batch, offset=(seed * 1_000_003 + 7_777 + step * batch) % 900_000)
        ids, mask, labels = batch_tensors(tok, data)
        feats, teacher = features(ids, mask)
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
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
        else:
            noisy = feats[:, :-1] + torch.randn_like(feats[:, :-1]) * 0.05 * feats.std()
            out_mask = mask[:, :-1]
            pos = (out_mask.cumsum(1) - 1).clamp_min(0)
            hidden = module.predict(ids[:, 1:], noisy, attention_mask=out_mask, position_ids=pos)
            valid = mask[:, 1:] == 1
            reg = torch.nn.functional.smooth_l1_loss(hidden[valid], feats[:, 1:][valid])
            tok_logits = lm_head(hidden[valid])
            cls = torch.nn.functional.cross_entropy(tok_logits, teacher[:, 1:][valid])
            loss = reg + 0.1 * cls
            hits, total = int((tok_logits.argmax(-1) == teacher[:, 1:][valid]).sum()), int(valid.sum())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(hits / max(total, 1))
        if step % log_every == 0 or step == steps - 1:
            print(f"{kind} step {step}/{steps} loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f} "
                  f"top-1 {sum(accs[-log_every:]) / len(accs[-log_every:]):.3f} {time.perf_counter() - t0:.0f}s", flush=True)
    minutes = (time.perf_counter() - t0) / 60
    module.eval()
    (save_medusa if kind == "medusa" else save_eagle)(module, out, str(target_dir))
    n_params = sum(p.numel() for p in params)
    return {"name": out.name, "kind": kind, "params": n_params, "steps": steps, "lr": lr, "batch": batch, "seed": seed,
            "train_minutes": round(minutes, 1), "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "final_top1": round(sum(accs[-50:]) / len(accs[-50:]), 3)}


LEARNED_CARD = """# {name}

{what}, trained by `python -m batchspec.demo.train --only {kind}` on the frozen demo target
(`models/legal-target`) by self-distillation: the target's own greedy tokens and features on
synthetic training contracts are the labels ({description}). {params:,} trained parameters; the
token embedding and LM head are the target's.

Training: {steps} steps of 32 fresh contracts, AdamW lr {lr}, warmup + cosine, seed {seed}, CPU
({train_minutes} minutes on 2 cores); final top-1 agreement with the target on training
positions {final_top1}. Use it with `model.draft: {{kind: {kind}, path: models/{name}}}` (served
by batchspec's hf engine). Evaluation: `batchspec_train.json`; figures in docs/demo.md.
"""

LEARNED_WHAT = {
    "medusa": ("Four Medusa heads (one residual SiLU block and a vocabulary projection each) for the demo target",
               "head i learns the target's token i+2 positions ahead"),
    "eagle": ("An EAGLE feature draft (fc over [token embedding; feature] and one Llama decoder layer) for the demo "
              "target", "the layer learns the target's next top-layer feature and, through the target's LM head, "
              "its next token"),
}


def evaluate(target_dir: Path, draft_dir: Path, n: int = 40, learned: dict[str, Path] | None = None) -> dict:
    """Greedy exact match on held-out contracts for each model alone, plus acceptance per draft kind."""
    from ..engine import DraftSpec, Engine

    ex = examples("eval", n)
    prompts = [e["prompt"] for e in ex]
    result = {"eval_contracts": n}
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
    ap.add_argument("--only", choices=("both", "target", "draft", "medusa", "eagle"), default="both",
                    help="retrain one model and keep the others (and the tokenizer) already in --out; medusa and "
                         "eagle train a learned draft on the frozen target")
    ap.add_argument("--medusa-steps", type=int, default=1500)
    ap.add_argument("--eagle-steps", type=int, default=1200)
    ap.add_argument("--medusa-lr", type=float, default=3e-3)
    ap.add_argument("--eagle-lr", type=float, default=3e-3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    tok_dir = build_tokenizer(out / "tokenizer")
    target_dir, draft_dir = out / "legal-target", out / "legal-draft"
    learned = {"medusa": out / "legal-medusa", "eagle": out / "legal-eagle"}
    runs = {}
    if args.only in learned:
        kind = args.only
        run = train_learned(kind, target_dir, tok_dir, learned[kind], getattr(args, f"{kind}_steps"),
                            getattr(args, f"{kind}_lr"), args.seed)
        ev = evaluate(target_dir, draft_dir, learned=learned)
        print(json.dumps(ev, indent=2))
        (learned[kind] / "batchspec_train.json").write_text(json.dumps({**run, "evaluation": ev}, indent=2))
        what, description = LEARNED_WHAT[kind]
        (learned[kind] / "README.md").write_text(LEARNED_CARD.format(what=what, description=description, **run))
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
