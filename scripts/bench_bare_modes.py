"""Which bare vLLM is the peer: plain decoding over the nightly data (bench_nightly.py's 2,400
rows, the project's engine_args), one fresh process per run, the variants interleaved:

    A  VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in the calling process, as batchspec's
       actor runs it and as the benchmarks' bare scripts do
    B  A with LD_PRELOAD=torch's libgomp at process start (what vLLM's CPU platform sets in the
       environment for the engine core process it spawns; an in-process core never gets it)
    C  vLLM's default: the engine core in a child process

    python scripts/bench_bare_modes.py [--concurrency 256] [--repeats 2]   # ~5 minutes

Prints each run's generation seconds and the OpenMP runtimes its process mapped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

CHILD = r'''
import json, sys, time
cfg = json.loads(open(sys.argv[1]).read())
from vllm import LLM, SamplingParams
llm = LLM(**cfg["engine"])
p = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], stop=cfg["stop"] or None)
rows = [{"prompt_token_ids": ids} for ids in cfg["rows"]]
llm.generate(rows[:2], p, use_tqdm=False)
t = time.perf_counter()
out = llm.generate(rows, p, use_tqdm=False)
dt = time.perf_counter() - t
libs = sorted({line.split()[-1].rsplit("/", 2)[-2] + "/" + line.split()[-1].rsplit("/", 1)[-1]
               for line in open("/proc/self/maps") if "gomp" in line or "iomp" in line})
print("RESULT" + json.dumps({"s": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in out), "libs": libs}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import bench_nightly
    import torch

    tmp, job = bench_nightly.fresh_job("bare-modes", 300, args.concurrency)
    shards = bench_nightly.shard_prompts(job)
    engine, spec = bench_nightly.bare_args(job, False)
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"engine": engine, "rows": [r for rows in shards.values() for r in rows],
                               "max_new_tokens": spec.generation.max_new_tokens, "stop": spec.generation.stop}))
    gomp = str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")
    variants = {"A": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                "B": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "LD_PRELOAD": gomp},
                "C": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    print(f"threads: {os.cpu_count()} cores; concurrency {args.concurrency}; 2,400 rows")
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for name, env in variants.items():
            child_env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | env
            out = subprocess.run([sys.executable, "-c", CHILD, str(cfg)], env=child_env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                print(f"rep {rep} {name}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(line[len("RESULT"):])
            seconds[name].append(r["s"])
            print(f"rep {rep} {name}: {r['s']:.2f} s, {r['tokens']} tokens, OpenMP runtimes {r['libs']}", flush=True)
    print({name: [round(s, 2) for s in xs] for name, xs in seconds.items()})


if __name__ == "__main__":
    main()
