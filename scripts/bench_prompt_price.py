"""What a prompt token costs in vLLM's steps: in a call's fill (prompts alone) against beside rows
decoding, per arm, on a bare engine with batchspec's step hooks (engine/vllm_patches.py).

    python scripts/bench_prompt_price.py --concurrency 64        # ~1 minute per arm

The nightly job's data (scripts/bench_nightly.py), the job's engine arguments; plain and
speculative (k = 4) each in its own process, a warm-up call, then one call per shard over a legal
shard of short prompts and one of long prompts, twice. Every engine step is timed with the prompt
tokens it ran (SchedulerOutput.num_scheduled_tokens of requests not yet decoding) and the rows
decoding in it. Printed per call: the fill's seconds per prompt token (the steps before the first
step without prompts: how batchspec priced prompts before 2026-12-06), and the price the policy
now takes (policy.PromptPrices): each step that ran prompts less what a step without prompts
costs at as many rows decoding (a line fitted on the call's clean steps), over the prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nightly as nightly  # noqa: E402
from bench_vllm import child_result  # noqa: E402

CHILD = r'''
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from batchspec.engine import vllm_patches as patches
from batchspec.policy import PromptPrices, StepLine
cfg = json.loads(open(sys.argv[1]).read())
llm = LLM(**cfg["engine"])
client, _, sched = patches.in_process_core(llm)
steps, scheduled = [], []
patches.keep_schedules(sched, scheduled.append)

def timed(get_output):
    def step():
        prefill, decoding = patches.step_admits_prompts(sched, cfg["concurrency"])
        scheduled.clear()
        t = time.perf_counter()
        out = get_output()
        seconds = time.perf_counter() - t
        prompts = patches.prompt_tokens_scheduled(scheduled[0], decoding) if prefill and scheduled else 0
        steps.append((sum(o.request_id in decoding for o in out.outputs), prompts, seconds, len(out.outputs)))
        return out
    return step

patches.wrap_engine_step(client, timed)
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], stop=cfg["stop"] or None)
first = next(iter(cfg["shards"].values()))
llm.generate([{"prompt_token_ids": ids} for ids in first[:2]], params, use_tqdm=False)
calls = []
for name in list(cfg["shards"]) * 2:
    steps.clear()
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in cfg["shards"][name]], params, use_tqdm=False)
    wall = time.perf_counter() - t
    fill = next(i for i, s in enumerate(steps) if s[1] == 0)
    line = StepLine.fit([(rows, s) for rows, p, s, _ in steps[fill:] if p == 0])
    prices = PromptPrices()
    prices.add({0: [(rows, p, s) for rows, p, s, _ in steps if p]}, {0: line})
    seconds, tokens = prices.work[0]
    fill_tokens = sum(p for _, p, _, _ in steps[:fill])
    calls.append({"shard": name, "wall_s": round(wall, 3), "steps": len(steps),
                  "prompt_steps": sum(1 for s in steps if s[1]), "prompt_tokens": tokens,
                  "fill_us_per_token": round(1e6 * sum(s for _, _, s, _ in steps[:fill]) / fill_tokens, 1),
                  "steps_us_per_token": round(1e6 * seconds / tokens, 1)})
print("RESULT" + json.dumps(calls))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--rows", type=int, default=300, help="rows per shard")
    args = ap.parse_args()
    tmp, job = nightly.fresh_job("prompt-price", args.rows, args.concurrency)
    shards = nightly.shard_prompts(job)
    print(f"{args.rows} rows a call at max_num_seqs {args.concurrency}; the arm at k: the whole step, draft included")
    print(f"{'arm':5s} {'shard':14s} {'wall s':>7s} {'steps':>6s} {'with prompts':>12s} "
          f"{'fill us/token':>14s} {'in all such steps':>18s}")
    for arm, speculative in (("plain", False), ("k=4", True)):
        engine, spec = nightly.bare_args(job, speculative)
        cfg = tmp / f"{arm}.json"
        cfg.write_text(json.dumps({"engine": engine, "concurrency": args.concurrency,
                                   "shards": {n: shards[n] for n in ("legal-short-0", "legal-long-0")},
                                   "max_new_tokens": spec.generation.max_new_tokens, "stop": spec.generation.stop}))
        for c in child_result(CHILD, str(cfg), what=f"bare vLLM {arm}"):
            print(f"{arm:5s} {c['shard']:14s} {c['wall_s']:7.2f} {c['steps']:6d} {c['prompt_steps']:12d} "
                  f"{c['fill_us_per_token']:14.1f} {c['steps_us_per_token']:18.1f}")


if __name__ == "__main__":
    main()
