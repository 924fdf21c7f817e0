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


def evaluate(target_dir: Path, draft_dir: Path, n: int = 40) -> dict:
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
    for kind, spec in (("model", DraftSpec("model", path=str(draft_dir))), ("quantized", DraftSpec("quantized")),
                       ("layer_skip", DraftSpec("layer_skip", layers=1)), ("ngram", DraftSpec("ngram"))):
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
    ap.add_argument("--only", choices=("both", "target", "draft"), default="both",
                    help="retrain one model and keep the other (and the tokenizer) already in --out")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    out = Path(args.out)
    tok_dir = build_tokenizer(out / "tokenizer")
    target_dir, draft_dir = out / "legal-target", out / "legal-draft"
    runs = {}
    if args.only in ("both", "target"):
        runs["target"] = train("legal-target", TARGET, tok_dir, target_dir, args.target_steps, args.target_lr, args.seed)
    if args.only in ("both", "draft"):
        runs["draft"] = train("legal-draft", DRAFT, tok_dir, draft_dir, args.draft_steps, args.draft_lr, args.seed)
    ev = evaluate(target_dir, draft_dir)
    print(json.dumps(ev, indent=2))
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        record = path / "batchspec_train.json"
        run = runs.get(role) or {k: v for k, v in json.loads(record.read_text()).items() if k != "evaluation"}
        record.write_text(json.dumps({**run, "evaluation": ev}, indent=2))
        (path / "README.md").write_text(MODEL_CARD.format(role=role, **run, eval_contracts=ev["eval_contracts"]))


if __name__ == "__main__":
    main()
