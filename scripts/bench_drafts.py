"""Every draft kind on the demo target, side by side: acceptance, tokens per target pass, draft
cost ratio c, and the speedup of speculative over plain decoding at batch 1 and at the demo job's
batch size (8), on the 40 held-out contracts. Greedy, hf engine, fp32 CPU.

    python scripts/bench_drafts.py --threads 2 --repeats 2 --out bench_drafts.json

Speedup = plain seconds / speculative seconds for the same rows, measured interleaved (plain,
then each kind, repeated) so load drifts hit every configuration alike; the figure is the ratio
of the medians. c = draft_step_s / target_step_s from engine.measure_costs at that batch size.
Run it with nothing else on the machine: 2-thread torch slows down badly when a core is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


def kinds() -> dict:
    from batchspec.engine import DraftSpec

    out = {"model": DraftSpec("model", path=str(MODELS / "legal-draft")), "quantized": DraftSpec("quantized"),
           "layer_skip": DraftSpec("layer_skip", layers=1), "ngram": DraftSpec("ngram")}
    for kind in ("medusa", "eagle", "eagle3"):
        if (MODELS / f"legal-{kind}" / "config.json").exists():
            out[kind] = DraftSpec(kind, path=str(MODELS / f"legal-{kind}"))
    for kind in ("medusa", "eagle", "eagle3"):  # tree verification: each position's top 2 / top 3 in one pass
        if kind in out:
            for width in (2, 3):
                out[f"{kind}_tree{width}"] = DraftSpec(kind, path=str(MODELS / f"legal-{kind}"), tree_width=width)
    return out


def main() -> None:
    from batchspec.demo.corpus import examples
    from batchspec.engine import DraftSpec, Engine
    from batchspec.engine.engine import measure_costs
    from batchspec.rates import acceptance_rate, mean_acceptance_length

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--contracts", type=int, default=40)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--out", default="bench_drafts.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = str(MODELS / "legal-target")
    prompts = [e["prompt"] for e in examples("eval", args.contracts)]
    engines = {"plain": Engine.load(target, DraftSpec("none"))}
    engines.update({kind: Engine.load(target, spec) for kind, spec in kinds().items()})
    rows = engines["plain"].tokenize(prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    def run(name: str, batch: int) -> tuple[float, list]:
        engine, outs = engines[name], []
        t = time.perf_counter()
        for i in range(0, len(rows), batch):
            o, _ = engine.generate(rows[i: i + batch], max_new_tokens=64, speculate=name != "plain", draft_length=args.k)
            outs += o
        return time.perf_counter() - t, outs

    results = {"threads": args.threads, "k": args.k, "contracts": len(rows), "repeats": args.repeats, "kinds": {}}
    for batch in sizes:
        times = {name: [] for name in engines}
        outs = {}
        for name in engines:  # warm-up
            run(name, batch)
        for _ in range(args.repeats):
            for name in engines:
                seconds, outs[name] = run(name, batch)
                times[name].append(seconds)
        plain_s = statistics.median(times["plain"])
        for name in engines:
            if name == "plain":
                continue
            o = outs[name]
            acc, drafted = sum(r.stats.accepted_tokens for r in o), sum(r.stats.draft_tokens for r in o)
            rounds = sum(r.stats.spec_rounds for r in o)
            costs = measure_costs(engines[name], batch, ks=(args.k,), repeats=3)
            exact = sum(a.token_ids == b.token_ids for a, b in zip(o, outs["plain"]))
            entry = results["kinds"].setdefault(name, {})
            rate, length = acceptance_rate(acc, drafted), mean_acceptance_length(acc, rounds)
            entry.update({"acceptance": None if rate is None else round(rate, 3),
                          "mean_acceptance_length": None if length is None else round(length, 2),
                          f"c_batch{batch}": round(costs["draft_step_s"] / costs["target_step_s"], 3),
                          f"speedup_batch{batch}": round(plain_s / statistics.median(times[name]), 2),
                          f"exact_vs_plain_batch{batch}": f"{exact}/{len(o)}"})
        results[f"plain_s_batch{batch}"] = round(plain_s, 3)
        print(f"batch {batch}: plain {plain_s:.2f}s", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    cols = ["acceptance", "mean_acceptance_length"] + [f"{m}_batch{b}" for b in sizes for m in ("c", "speedup")]
    print("| kind | " + " | ".join(cols) + " | exact |")
    print("|---" * (len(cols) + 2) + "|")
    for name, e in results["kinds"].items():
        exact = " / ".join(e[f"exact_vs_plain_batch{b}"] for b in sizes)
        print(f"| {name} | " + " | ".join(str(e.get(c)) for c in cols) + f" | {exact} |")


if __name__ == "__main__":
    main()
