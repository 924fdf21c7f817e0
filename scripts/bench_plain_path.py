"""What batchspec's plain decoding costs on vLLM against a bare vLLM process, on the nightly job
(scripts/bench_nightly.py's data and job), side by side, each configuration in its own process,
interleaved per repetition:

    bare plain            LLM(...) without speculation, one timed LLM.generate over every row
    batchspec off         `batchspec submit` with speculation.mode=off: the speculative engine
                          (the draft loaded), every row at k = 0 with the draft's forward skipped
    batchspec off, plain engine   the same with model.vllm_plain_engine: true, so the rows run on
                          a second engine built without speculation

    python scripts/bench_plain_path.py [--concurrency 64] [--repeats 3]

Generation seconds (batchspec: the shards' generate_s summed; one actor) and batchspec's
whole-job wall. Threads: the actor's cpus_per_actor (2); the bare process's torch default here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_nightly  # noqa: E402
from bench_vllm import batchspec  # noqa: E402

CONFIGS = {"batchspec off": ("speculation.mode=off", "model.vllm_plain_engine=false"),
           "batchspec off, plain engine": ("speculation.mode=off", "model.vllm_plain_engine=true")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="vLLM max_num_seqs (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    args = ap.parse_args()
    tmp, job = bench_nightly.fresh_job("plain-path", args.rows, args.concurrency)
    shards = bench_nightly.shard_prompts(job)
    gen: dict[str, list[float]] = {"bare plain": [], **{name: [] for name in CONFIGS}}
    wall: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for rep in range(args.repeats):
        bare = bench_nightly.bare(job, shards, False)
        gen["bare plain"].append(bare["generate_s"])
        for i, (name, sets) in enumerate(CONFIGS.items()):
            res = batchspec(job, "vllm", tmp / f"out-{rep}-{i}", *sets)
            gen[name].append(res["generate_s"])
            wall[name].append(res["wall_s"])
        print(f"repetition {rep + 1}: " + ", ".join(f"{n} {v[-1]:.2f} s" for n, v in gen.items()), flush=True)
    base = statistics.median(gen["bare plain"])
    print(f"\n{args.rows * 8} rows at max_num_seqs {args.concurrency}, medians of {args.repeats} (generation s):")
    for name, values in gen.items():
        extra = f", whole job {statistics.median(wall[name]):.1f} s" if name in wall else ""
        print(f"  {name:<28} {statistics.median(values):6.2f} s = {statistics.median(values) / base:.2f}x bare plain"
              f"   ({', '.join(f'{v:.2f}' for v in values)}){extra}")


if __name__ == "__main__":
    main()
