"""What each shard's prediction says against what batchspec's own engines do with that shard.

    python scripts/bench_own_ratio.py --concurrency 64 --repeats 2     # ~6 minutes
    python scripts/bench_own_ratio.py --concurrency 256 --repeats 2

The nightly job's data (scripts/bench_nightly.py: 8 shards of 300 rows, two domains, two length
profiles). Per repetition, each `batchspec submit` in its own process, nothing remembered:

    on      speculation.mode=on, one shard a call (resources.shards_per_call=1)
    off     speculation.mode=off, one shard a call
    auto    the job as it ships (auto, shards packed into one call): each shard's predicted_own

with on and off in alternating order. One shard a call makes each shard's generate_s the time of
its own engine call (not a share of a call by the step lines), on the same kind of actor, Ray and
runner as auto. So the ratio off / on is the side-by-side figure auto's prediction is judged on,
without the floor of a bare process against a Ray actor, or two processes minutes apart
(bench_nightly.py's bare reference). Under `on` the call keeps its control (a plain block every
32 steps), so the ratio slightly understates pure speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nightly as nightly  # noqa: E402


def submit(job: Path, out: Path, *sets: str) -> tuple[dict[str, float], dict[str, float | None]]:
    """One batchspec submit; each shard's generate_s and its predicted_own (None where not predicted)."""
    from batchspec.runner.store import OutputStore

    extra = [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "BATCHSPEC_POLICY_MEMORY": "off"}
    subprocess.run([str(Path(sys.executable).parent / "batchspec"), "submit", str(job), "--quiet",
                    "--set", "model.backend=vllm", "--set", f"output.path={out}", *extra],
                   env=env, check=True, cwd=ROOT, capture_output=True)
    ms = OutputStore(str(out)).manifests().values()
    gen = {Path(m["path"]).stem: m["timings"]["generate_s"] for m in ms}
    pred = {Path(m["path"]).stem: next((d["numbers"]["predicted_own"] for d in m["decisions"]
                                        if d["numbers"].get("predicted_own") is not None), None) for m in ms}
    return gen, pred


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    ap.add_argument("--out", default=None, help="write every figure here as JSON")
    args = ap.parse_args()
    tmp, job = nightly.fresh_job("own-ratio", args.rows, args.concurrency)
    runs: dict[str, list[dict]] = {"on": [], "off": [], "predicted": []}
    print(f"threads: {os.cpu_count()} cores; {args.rows * 8} rows at max_num_seqs {args.concurrency}", flush=True)
    for rep in range(args.repeats):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            gen, _ = submit(job, tmp / f"{mode}-{rep}-{time.time():.0f}", f"speculation.mode={mode}",
                            "resources.shards_per_call=1")
            runs[mode].append(gen)
        runs["predicted"].append(submit(job, tmp / f"auto-{rep}", "speculation.mode=auto")[1])
        print(f"repetition {rep + 1} of {args.repeats} done", flush=True)
    print(f"{'shard':18s} {'on s':>6s} {'off s':>6s} {'off/on':>7s}  predicted (auto, each run)  error")
    errors = []
    for name in sorted(runs["on"][0]):
        on, off = (statistics.median(r[name] for r in runs[m]) for m in ("on", "off"))
        preds = [p[name] for p in runs["predicted"] if p.get(name) is not None]
        err = statistics.median(preds) / (off / on) - 1 if preds else None
        errors += [err] if err is not None else []
        print(f"{name:18s} {on:6.2f} {off:6.2f} {off / on:7.3f}  {', '.join(f'{p:.3f}' for p in preds):26s} "
              + (f"{err:+.1%}" if err is not None else "-"))
    if errors:
        print(f"prediction within 7% of off/on: {sum(abs(e) <= 0.07 for e in errors)} of {len(errors)} shards; "
              f"median error {statistics.median(errors):+.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"concurrency": args.concurrency, **runs}, indent=1))


if __name__ == "__main__":
    main()
