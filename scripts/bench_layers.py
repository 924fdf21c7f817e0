"""Where a batchspec job's generation time goes beyond bare vLLM's, one layer at a time.

    python scripts/bench_layers.py [--jobs demo,mixed] [--repeats 4]     # ~40 s per job and repeat

Every configuration is a fresh process that makes one call over the job's rows, as a job does, so
what is timed is a fresh engine's first call (later calls in one process run faster, and on
repeated prompts vLLM's prefix cache hides their prefill). Interleaved, nothing remembered
(each batchspec run is a first run, measuring its costs in the call):

    bare vLLM spec / plain   scripts/bench_vllm.py's bare script: LLM(...), a warm-up of 2 of
                             the job's prompts, one LLM.generate over every prompt
    backend call             batchspec's vllm backend (its engine, its warm-up) and one call
                             over every prompt as a first run makes it: a step rule that times
                             plain and k steps and keeps the faster (policy.InterleavedSteps), no runner
    runner, no Ray           batchspec's ShardRunner (the actor's code: reading, profiling, the
                             policy's measuring call, per-row stats, commits) in a plain process
    runner in a Ray worker   the same as one task in a worker process of a local Ray, started as
                             batchspec starts its Ray (init_ray, the actors' environment)
    batchspec submit         the whole job, as bench_vllm.py runs it

Every configuration reports its generation seconds (bare and backend: the call; the runner and
batchspec: the shards' generate_s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_vllm import bare, batchspec, child_result, job_prompts, write_jobs

RUNNER = r"""
import json, os, sys, time
os.environ["BATCHSPEC_POLICY_MEMORY"] = "off"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
job, out, where = sys.argv[1:4]

def run(job, out):
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner
    from batchspec.spec import load_spec
    spec = load_spec(job, [f"output.path={out}", "model.backend=vllm"])
    runner = ShardRunner(spec, "bench-layers")
    manifests = runner.run_many(plan_shards(spec.input.path))
    return {"generate_s": sum(m["timings"]["generate_s"] for m in manifests)}

if where == "ray":
    import ray
    from batchspec.runner.cluster import actor_env_vars, init_ray
    init_ray(num_cpus=2, worker_env=actor_env_vars("vllm", 2))
    try:
        res = ray.get(ray.remote(num_cpus=2)(run).remote(job, out))
    finally:
        ray.shutdown()
else:
    res = run(job, out)
print("RESULT" + json.dumps(res))
"""

BACKEND = r"""
import json, sys, time
from batchspec.engine.backend import load_backend
from batchspec.policy import InterleavedSteps
from batchspec.spec import load_spec
spec = load_spec(sys.argv[1])
ids, gen, k = json.loads(open(sys.argv[2]).read()), spec.generation, spec.speculation.num_speculative_tokens
backend = load_backend("vllm", spec.model, k_default=k)
t = time.perf_counter()
backend.generate(ids, gen.max_new_tokens, stop=tuple(gen.stop), draft_length=InterleavedSteps(k, dense=True))
print("RESULT" + json.dumps({"generate_s": time.perf_counter() - t}))
"""

CONFIGS = ("bare vLLM spec", "bare vLLM plain", "backend call", "runner, no Ray", "runner in a Ray worker",
           "batchspec submit")


def one(config: str, job: Path, spec, prompt_ids, ids_file: Path, tmp: Path) -> float:
    """One fresh process of `config`; ids_file: prompt_ids as JSON (too long for argv on a long job)."""
    out = tmp / "out"
    shutil.rmtree(out, ignore_errors=True)
    if config.startswith("bare"):
        return bare(spec, prompt_ids, speculative=config.endswith("spec"))["generate_s"]
    if config == "backend call":
        return child_result(BACKEND, str(job), str(ids_file), what=config)["generate_s"]
    if config.startswith("runner"):
        where = "ray" if "Ray worker" in config else "plain"
        return child_result(RUNNER, str(job), str(out), where, what=config)["generate_s"]
    memory = tmp / "memory"
    shutil.rmtree(memory, ignore_errors=True)
    return batchspec(job, "vllm", out, memory=memory)["generate_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="demo,mixed", help="comma-separated: demo, mixed, demo_eagle3, llama104m")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", help="write the times as JSON here")
    args = ap.parse_args()
    from batchspec.spec import load_spec

    tmp = Path(tempfile.mkdtemp(prefix="bench-layers-"))
    results = {}
    for name, job in write_jobs(tmp, args.jobs.split(","), 64, 0.0, 96).items():
        spec = load_spec(job)
        _, prompt_ids = job_prompts(spec)
        ids_file = tmp / f"{name}-prompt-ids.json"
        ids_file.write_text(json.dumps(prompt_ids))
        times: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for rep in range(args.repeats):
            for config in CONFIGS:
                times[config].append(one(config, job, spec, prompt_ids, ids_file, tmp))
                print(f"{name} rep {rep}: {config:<22} generate {times[config][-1]:.3f} s", flush=True)
        best = min(statistics.median(times["bare vLLM spec"]), statistics.median(times["bare vLLM plain"]))
        print(f"\n{name}: medians of {args.repeats} processes, against the better bare configuration")
        for config, ts in times.items():
            m = statistics.median(ts)
            print(f"  {config:<22} {m:6.3f} s  {m / best:5.2f}x   ({', '.join(f'{t:.3f}' for t in ts)})")
        results[name] = times
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
