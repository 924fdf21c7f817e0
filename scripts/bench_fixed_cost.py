"""What Ray Data costs a small job's whole wall (issue 40's fixed cost), on today's code: `batchspec
submit` as shipped (its calls through Ray Data, runner/dataset.py) against the same submit in the
same code with its calls sent to plain Ray actors of the same ShardWorker (this script's stand-in
for run_calls: the pool the runner had before Ray Data, in a dozen lines), whole process each,
interleaved, the order turned every repetition.

    python scripts/bench_fixed_cost.py --repeats 5                     # the demo job, ~4 minutes
    python scripts/bench_fixed_cost.py --job jobs/summarize_legal_small.yaml --repeats 5 --set model.backend=hf

Each run is its own `python` process from exec to exit (what a nightly scheduler waits for), into
a fresh output. Per run it prints the whole wall and the driver's start-up figures from the
"job succeeded" record: Ray's start, when the first shard actor could generate (ready) and its
engine load. "Ray Data adds" is data - actors within each pair; the goal is <= 1.0 s.

The stand-in is a benchmark's: no crash ledger, no retries on another node, no autoscaling (the
product has one path, Ray Data's). Earlier figures compared a clone of the old pool's commit, which
differed in more than the pool (docs/benchmarks.md, "Ray Data's fixed cost").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def plain_actor_calls(worker_cls, calls, size, actor_options, init_kwargs, ledger, failed, max_size=None,
                      stats=None, per_block=1):
    """runner/dataset.run_calls' contract on plain Ray actors: `size` actors, one call in flight on
    each, manifests yielded as calls finish; a call that raises fails its own shards."""
    import ray

    actor = ray.remote(worker_cls).options(**actor_options)
    actors = [actor.remote(**init_kwargs) for _ in range(min(size, len(calls)))]
    todo = list(enumerate(calls))
    running: dict = {}

    def give(a) -> None:
        if todo:
            i, call = todo.pop(0)
            running[a.run.remote(call)] = (i, a)

    for a in actors:
        give(a)
    while running:
        [done], _ = ray.wait(list(running), num_returns=1)
        i, a = running.pop(done)
        try:
            yield ray.get(done)
        except Exception as e:  # noqa: BLE001 - a benchmark: the call's shards fail, as in the product
            yield failed(calls[i], str(e))
        give(a)


def arm(which: str, job: str, out: str, sets: list[str]) -> None:
    """One run in this process: `batchspec submit` with JSON logs on stderr."""
    if which == "actors":
        import batchspec.runner.dataset as dataset

        dataset.run_calls = plain_actor_calls  # dispatch imports it at call time
    from batchspec.cli import main

    sys.argv = ["batchspec", "submit", job, "--log-format", "json", "--set", f"output.path={out}",
                *(a for s in sets for a in ("--set", s))]
    main()


def one(which: str, job: str, sets: list[str], tmp: Path) -> dict:
    out = tmp / f"out-{which}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--arm", which, "--job", job, "--out-dir", str(out), *(a for s in sets for a in ("--set", s))]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{which} run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    done = [json.loads(line) for line in p.stderr.splitlines() if line.startswith("{") and '"job succeeded"' in line]
    rec = done[-1] if done else {}
    return {"wall_s": wall, **{k.removeprefix("startup_"): rec.get(k) for k in ("startup_ray_s", "startup_ready_s",
                                                                                   "startup_engine_load_s")},
            "job_s": rec.get("seconds")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default="jobs/summarize_legal_small.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], help="passed to batchspec submit --set")
    ap.add_argument("--arm", choices=["data", "actors"], help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        arm(args.arm, args.job, args.out_dir, args.set)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-fixed-cost-"))
    print(f"threads: {os.cpu_count()} cores; {args.job} {' '.join(args.set)}; whole process per run, order turned each repetition")
    print("| rep | arm | wall s | Ray s | first actor ready s | engine load s | ready - Ray - load s |\n|---|---|---|---|---|---|---|")
    runs: dict[str, list[dict]] = {"data": [], "actors": []}
    try:
        one("data", args.job, args.set, tmp)  # a warm-up of the disk cache and Python's bytecode, not timed
        for rep in range(args.repeats):
            for which in (("data", "actors") if rep % 2 == 0 else ("actors", "data")):
                r = one(which, args.job, args.set, tmp)
                runs[which].append(r)
                rest = (r["ready_s"] - r["ray_s"] - r["engine_load_s"]) if None not in (r["ready_s"], r["ray_s"], r["engine_load_s"]) else None
                print(f"| {rep + 1} | {which} | {r['wall_s']:.2f} | {r['ray_s']} | {r['ready_s']} | {r['engine_load_s']} "
                      f"| {'-' if rest is None else f'{rest:.2f}'} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    added = [d["wall_s"] - a["wall_s"] for d, a in zip(runs["data"], runs["actors"])]
    ratio = [d["wall_s"] / a["wall_s"] for d, a in zip(runs["data"], runs["actors"])]
    print(f"\nRay Data adds (data - actors, each pair): {', '.join(f'{x:+.2f}' for x in added)} s; "
          f"median {statistics.median(added):+.2f} s (goal <= 1.0 s); ratio min {min(ratio):.3f} / median "
          f"{statistics.median(ratio):.3f} / max {max(ratio):.3f}")
    for which, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in ("wall_s", "ray_s", "ready_s", "engine_load_s")
               if any(r[k] is not None for r in rs)}
        print(f"  {which}: median " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))


if __name__ == "__main__":
    main()
