"""Per-shard overhead: the same rows as few shards and as many, whole-job wall, where the time per
extra shard goes, and the driver's peak RSS.

    python scripts/bench_shards.py --rows 24000 --shards 12 1200 [--repeats 2] [--out bench-shards.json]
    python scripts/bench_shards.py --rows 24000 --shards 12 1200 --base /tmp/base   # against another checkout
    python scripts/bench_shards.py --rows-per-shard 2 --shards 100 1000 10000 --max-new-tokens 1 \\
        --set model.backend=hf --set speculation.mode=off            # the driver's memory, many shards

The demo job (jobs/summarize_legal_small.yaml: the demo pair, vLLM, auto policy unless --set says) over
demo contracts cut into each `--shards` count: `--rows` in all (20 rows a shard at 1,200 of 24,000),
or `--rows-per-shard` each. Each run is a fresh `batchspec submit --quiet` into a fresh output,
timed from outside, with the peak RSS of the driver process (not Ray's or the actors'). Shard counts
alternate within each repetition; with --base, each count runs on this checkout and on the one at
--base in turn. The product path runs throughout: the small-engine settings of the memory sweep
only make the engine cheap, since the driver is what is measured there.

Where the time goes, from the run's own records (job.json and the shard manifests): start-up (Ray,
then the actor's engine load, to the first actor ready), the shards' read, generate and write
seconds summed (measured in the actor; total_s is their sum), and the rest of the wall: what the
actor does around a shard besides those (its manifest, the lease check, the call's decision outside
the engine) plus Ray Data's scheduling and the driver's side of each call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import resource,subprocess,sys,time,json;t=time.perf_counter();"
         "r=subprocess.run(sys.argv[2:],cwd=sys.argv[1],stdout=subprocess.DEVNULL,stderr=subprocess.PIPE);"
         "print(json.dumps({'rc':r.returncode,'wall_s':time.perf_counter()-t,"
         "'driver_peak_mib':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024,"
         "'stderr':r.stderr.decode()[-600:]}))")
PARTS = ("read_s", "generate_s", "write_s")


def write_input(folder: Path, rows: int, shards: int) -> None:
    from batchspec.demo.corpus import examples

    folder.mkdir(parents=True, exist_ok=True)
    ex = examples("eval", rows)
    per = -(-rows // shards)
    for s in range(shards):
        part = ex[s * per:(s + 1) * per]
        pq.write_table(pa.table({"doc_id": [e["doc_id"] for e in part], "contract": [e["contract"] for e in part]}),
                       folder / f"prompts-{s:05d}.parquet")


def breakdown(out: Path) -> dict:
    """Where a finished run's wall went, from its job.json and manifests (seconds)."""
    run = json.loads((out / "_batchspec/job.json").read_text())["runs"][-1]
    sums = dict.fromkeys(PARTS + ("total_s",), 0.0)
    for f in (out / "_batchspec/shards").glob("*.json"):
        for k, v in json.loads(f.read_text()).get("timings", {}).items():
            if k in sums:
                sums[k] += v
    ready = min((a["ready_s"] for a in run["startup"]["actors"]), default=0.0)
    return {"job_wall_s": run["wall_s"], "ray_s": run["startup"]["ray_s"], "first_actor_ready_s": ready,
            **{f"shards_{k}": v for k, v in sums.items()},
            "rest_s": run["wall_s"] - ready - sums["total_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=24000, help="rows in all, cut into each shard count")
    ap.add_argument("--rows-per-shard", type=int, help="rows in each shard instead (the job grows with the count)")
    ap.add_argument("--shards", type=int, nargs="+", default=[12, 1200])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to submit")
    ap.add_argument("--base", help="another checkout of batchspec to run beside this one")
    ap.add_argument("--out", default="bench-shards.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bs-shards-"))
    for n in args.shards:
        write_input(work / f"in-{n}", args.rows_per_shard * n if args.rows_per_shard else args.rows, n)
    trees = {"this": ROOT, **({"base": Path(args.base)} if args.base else {})}
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for n in args.shards:
            for name, tree in trees.items():
                out = work / f"out-{name}-{n}-{rep}"
                cmd = [sys.executable, "-m", "batchspec.cli", "submit", str(ROOT / "jobs/summarize_legal_small.yaml"), "--quiet",
                       "--set", f"input.path={work / f'in-{n}'}", "--set", f"output.path={out}",
                       "--set", f"generation.max_new_tokens={args.max_new_tokens}",
                       *(a for kv in args.set for a in ("--set", kv))]
                r = json.loads(subprocess.run([sys.executable, "-c", PROBE, str(tree), *cmd], capture_output=True,
                                              text=True, check=True, env={**os.environ, "RAY_ADDRESS": ""}).stdout)
                r["shards"] = n
                if r["rc"] == 0:
                    r["breakdown"] = breakdown(out)
                runs.setdefault(f"{name}-{n}", []).append(r)
                print(f"{name:<5} {n:>6} shards  rc {r['rc']}  {r['wall_s']:7.1f} s  driver peak {r['driver_peak_mib']:6.0f} MiB"
                      + (f"\n{r['stderr']}" if r["rc"] else f"  {json.dumps(_rounded(r['breakdown']))}"), flush=True)
                time.sleep(2)
    summary = {k: {"wall_s_median": statistics.median(r["wall_s"] for r in v),
                   "driver_peak_mib_max": max(r["driver_peak_mib"] for r in v)} for k, v in runs.items()}
    for name in trees:
        a, b = summary.get(f"{name}-{min(args.shards)}"), summary.get(f"{name}-{max(args.shards)}")
        if a and b and max(args.shards) > min(args.shards):  # one count: no ratio to take
            extra = max(args.shards) - min(args.shards)
            summary[f"{name}-ratio"] = {"wall_ratio": b["wall_s_median"] / a["wall_s_median"],
                                        "ms_per_extra_shard": (b["wall_s_median"] - a["wall_s_median"]) / extra * 1000,
                                        "driver_mib_growth": b["driver_peak_mib_max"] - a["driver_peak_mib_max"]}
    Path(args.out).write_text(json.dumps({"rows": args.rows, "rows_per_shard": args.rows_per_shard, "sets": args.set,
                                          "cpus": os.cpu_count(), "summary": summary, "runs": runs}, indent=2))
    print(json.dumps(summary, indent=2))


def _rounded(d: dict) -> dict:
    return {k: round(v, 2) for k, v in d.items()}


if __name__ == "__main__":
    main()
