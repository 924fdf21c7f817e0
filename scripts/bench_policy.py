"""Does auto mode pick well? Mixed jobs, each run with speculation off, on and auto.

    python scripts/bench_policy.py [--rows 8] [--out bench-policy.json]

Target: the ~104M Llama that `batchspec bench` builds. Each job interleaves
  short shards: ~30-token prompts, up to --max-new-tokens new tokens (decode-dominated), and
  long shards: prompts that fill the 1024-token context but for ~24 tokens (prefill-dominated),
and runs once with the target's int8 copy as draft (high acceptance) and once with an
unrelated random small Llama (acceptance near 0). For every job and mode, shards run one after
another through the same ShardRunner an actor uses (engine loaded and calibrated once per job
and mode, as one actor would); the figure is the summed generation time from the manifests.
The per-shard oracle takes, for each shard, the better of its on and off times.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def make_shards(folder: Path, tokenizer, rows: int, shards_per_kind: int, context: int) -> list[str]:
    from batchspec.testing import synthetic_text

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for s in range(shards_per_kind):
        short = [" ".join(t.split()[:20]) for t in synthetic_text(rows, seed=100 + s)]
        long = []
        for i in range(rows):
            ids = tokenizer(" ".join(synthetic_text(120, seed=1000 * (s + 1) + i)))["input_ids"][: context - 30]
            long.append(tokenizer.decode(ids))
        for kind, texts in (("short", short), ("long", long)):
            name = f"{kind}-{s:04d}"
            pq.write_table(pa.table({"prompt": texts, "doc_id": [f"{name}-{i}" for i in range(rows)]}),
                           folder / f"{name}.parquet")
            names.append(name)
    return names


def run_job(spec_data: dict, inp: Path, out: Path, mode: str) -> dict[str, dict]:
    from batchspec.rates import acceptance_rate
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner
    from batchspec.spec import spec_from_dict

    spec = spec_from_dict({**spec_data, "output": {"path": str(out)}, "speculation": {"mode": mode}})
    runner = ShardRunner(spec, f"policy-{mode}")
    shards = sorted(plan_shards(str(inp)), key=lambda s: (s.shard.split("-")[1], s.shard))  # short/long interleaved
    manifests = {}
    for shard in shards:
        m = runner.run(shard)
        manifests[shard.shard] = {"generate_s": m["timings"]["generate_s"], "decisions": [d["reason"] for d in m["decisions"]],
                                  "completion_tokens": m["tokens"]["completion_tokens"],
                                  "acceptance": acceptance_rate(m["tokens"]["accepted_tokens"], m["tokens"]["draft_tokens"])}
    return manifests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--shards-per-kind", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default="bench-policy.json")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from batchspec.bench import default_target
    from batchspec.runner.checkpoints import cache_root
    from batchspec.testing import build_model

    target = default_target(quick=False)
    tok = AutoTokenizer.from_pretrained(target)
    unrelated = build_model(cache_root() / "bench" / "llama-small-unrelated", "llama", cache_root() / "bench" / "tokenizer",
                            size="small", seed=7)
    work = Path(tempfile.mkdtemp(prefix="bs-policy-"))
    make_shards(work / "in", tok, args.rows, args.shards_per_kind, context=1024)
    base = {"name": "policy", "input": {"path": str(work / "in"), "id_column": "doc_id"},
            "generation": {"max_new_tokens": args.max_new_tokens},
            "resources": {"actors": 1, "batch_size": args.batch_size}}
    jobs = {"mixed, int8 self-draft": {"target": target, "draft": {"kind": "quantized"}},
            "mixed, unrelated draft": {"target": target, "draft": {"kind": "model", "path": str(unrelated)}}}
    report = {}
    for job, model in jobs.items():
        runs = {}
        for mode in ("off", "on", "auto"):
            t = time.perf_counter()
            runs[mode] = run_job({**base, "model": model}, work / "in", work / f"out-{len(report)}-{mode}", mode)
            print(f"{job} / {mode}: {sum(s['generate_s'] for s in runs[mode].values()):.1f}s generation "
                  f"({time.perf_counter() - t:.0f}s with loading and calibration)", flush=True)
        totals = {mode: sum(s["generate_s"] for s in shards.values()) for mode, shards in runs.items()}
        totals["oracle"] = sum(min(runs["on"][s]["generate_s"], runs["off"][s]["generate_s"]) for s in runs["on"])
        best_fixed = min(totals["on"], totals["off"])
        report[job] = {"totals_s": totals, "auto_vs_best_fixed": totals["auto"] / best_fixed,
                       "auto_vs_oracle": totals["auto"] / totals["oracle"], "shards": runs}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{'job':<26}{'off':>8}{'on':>8}{'auto':>8}{'oracle':>8}{'auto/best fixed':>17}{'auto/oracle':>13}")
    for job, r in report.items():
        t = r["totals_s"]
        print(f"{job:<26}{t['off']:>7.1f}s{t['on']:>7.1f}s{t['auto']:>7.1f}s{t['oracle']:>7.1f}s"
              f"{r['auto_vs_best_fixed']:>16.3f}x{r['auto_vs_oracle']:>12.3f}x")
    for job, r in report.items():
        print(f"\n{job}: auto's decisions")
        for shard, s in r["shards"]["auto"].items():
            on, off = r["shards"]["on"][shard]["generate_s"], r["shards"]["off"][shard]["generate_s"]
            print(f"  {shard:<11} on {on:6.2f}s off {off:6.2f}s auto {s['generate_s']:6.2f}s  " + " | ".join(s["decisions"]))


if __name__ == "__main__":
    main()
