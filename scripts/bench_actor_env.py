"""What running inside a Ray actor costs vLLM by itself, with no batchspec code in the call.

    python scripts/bench_actor_env.py [--calls 5] [--pairs 2]     # ~1.5 minutes per pair

The same script body (the demo pair as vLLM's draft_model method, k=4, the 96 demo prompts, one
warm-up call, then --calls timed `LLM.generate` calls over all of them) runs in a plain process
and in a Ray actor (local Ray, num_cpus=2, niceness 0 as batchspec's actors), interleaved --pairs
times. What differs is only the process the engine lives in. It also prints what could differ:
torch threads, OMP_NUM_THREADS (Ray sets it), niceness, CPU affinity, thread count.
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


def demo_prompt_ids() -> list[list[int]]:
    """The demo job's prompts, built as the runner builds them (bench_vllm.job_prompts)."""
    from bench_vllm import job_prompts

    from batchspec.spec import load_spec

    spec = load_spec(ROOT / "jobs/summarize_legal_small.yaml", [f"model.target={ROOT / 'models/legal-target'}",
                                                           f"input.path={ROOT / 'jobs/data/legal'}"])
    return job_prompts(spec)[1]


def timed_calls(ids: list[list[int]], calls: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ROOT / "models/legal-target"), dtype="float32", seed=0, enforce_eager=True,
              kv_cache_memory_bytes=2 << 30,
              speculative_config={"method": "draft_model", "model": str(ROOT / "models/legal-draft"),
                                  "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=64, stop=["\n"])
    prompts = [{"prompt_token_ids": x} for x in ids]
    llm.generate(prompts[:2], params, use_tqdm=False)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    return {"times": times, "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "nice": os.nice(0), "affinity": sorted(os.sched_getaffinity(0)), "threads": len(os.listdir("/proc/self/task"))}


def in_actor(ids: list[list[int]], calls: int) -> dict:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=2, runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})(Runner).remote()
        return ray.get(actor.run.remote(ids, calls))
    finally:
        ray.shutdown()


class Runner:
    def run(self, ids, calls):
        return timed_calls(ids, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--where", choices=["plain", "actor"], help=argparse.SUPPRESS)  # one run, in a child process
    args = ap.parse_args()
    if args.where:
        ids = demo_prompt_ids()
        res = timed_calls(ids, args.calls) if args.where == "plain" else in_actor(ids, args.calls)
        print("RESULT" + json.dumps(res))
        return
    firsts, medians = {"plain": [], "actor": []}, {"plain": [], "actor": []}
    for _ in range(args.pairs):
        for where in ("plain", "actor"):
            out = subprocess.run([sys.executable, __file__, "--where", where, "--calls", str(args.calls)],
                                 capture_output=True, text=True, cwd=ROOT)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
            if not line:
                raise RuntimeError(out.stderr[-3000:])
            r = json.loads(line[0][6:])
            ts = r.pop("times")
            firsts[where].append(ts[0])
            medians[where].append(statistics.median(ts))
            print(f"{where:>6}: {', '.join(f'{t:.3f}' for t in ts)} s  (median {statistics.median(ts):.3f})  {r}", flush=True)
    for where in ("plain", "actor"):
        print(f"{where:>6}: first call {statistics.median(firsts[where]):.3f} s, median call "
              f"{statistics.median(medians[where]):.3f} s (medians over {args.pairs} processes)")
    print(f"actor / plain: first call {statistics.median(firsts['actor']) / statistics.median(firsts['plain']):.2f}x, "
          f"median call {statistics.median(medians['actor']) / statistics.median(medians['plain']):.2f}x")


if __name__ == "__main__":
    main()
