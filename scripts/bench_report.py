"""`report`, `status` and `rerun` over a large output: wall time and peak RSS, each in a fresh process.

    python scripts/bench_report.py --rows 10000000 --parts 2000 [--repeats 2] [--out bench-report.json]
    python scripts/bench_report.py --rows 24000 --parts 1200 --rerun   # the 1,200-shard output
    python scripts/bench_report.py --nights 30 --rows 20000 --parts 100  # night over night: 30 outputs of 100 shards

The output is synthetic but follows the contract (docs/output.md): schema-v1 parts written by
pyarrow with the writer's schema, one manifest per shard as the runner writes it, job.json with
the shard list and the spec. No model runs; the rows' counters are drawn so that every report
figure has something to add up (speculating and plain shards, error rows, a measured saving on
some shards). Completions are ~60-character strings, so a reader that loads them pays for it.

`--rerun` also times `batchspec rerun` of the (complete) output, which must be a no-op; it
needs the job's input, so the script writes a matching one-row-group input per shard.

`--nights N` writes N such outputs under dt=2026-11-01/ ... (each --rows rows in --parts shards)
and times `batchspec report ROOT` over all of them, night over night (issue 60's goal: 30 nights
of 100 shards in 10 s and 1 GiB).
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ("the parties agree that the term of this agreement shall begin on the effective date and continue "
         "until terminated by either party upon written notice with cause as defined herein").split()


def write_output(root: Path, rows: int, parts: int, with_input: bool, seed: int = 0) -> None:
    from batchspec.runner.schema import OUTPUT_SCHEMA
    from batchspec.spec import spec_from_dict

    spec_hash = spec_from_dict(spec_dict(root)).output_hash()
    rng = np.random.default_rng(seed)
    pool = np.array([" ".join(rng.choice(WORDS, 10)) for _ in range(2000)], dtype=object)
    (root / "out" / "data").mkdir(parents=True, exist_ok=True)
    (root / "out" / "_batchspec" / "shards").mkdir(parents=True, exist_ok=True)
    (root / "in").mkdir(exist_ok=True)
    per = [rows // parts + (i < rows % parts) for i in range(parts)]
    shards = []
    for i, n in enumerate(per):
        shard = f"prompts-{i:05d}"
        shards.append(shard)
        spec_on = i % 3 != 2  # two shards in three speculate
        error = rng.random(n) < 0.002
        completion = rng.integers(8, 97, n).astype(np.int32)
        rounds = np.where(spec_on, np.maximum(1, completion // 3), 0).astype(np.int32)
        drafted = (rounds * 4).astype(np.int32)
        accepted = np.minimum(drafted, (completion - rounds).clip(0)).astype(np.int32)
        ttft = rng.gamma(2.0, 0.05, n)
        latency = ttft + completion * rng.uniform(0.004, 0.012, n)
        ids = [f"doc-{i:05d}-{j:06d}" for j in range(n)]
        table = pa.table({
            "id": ids, "shard": [shard] * n, "row_index": np.arange(n, dtype=np.int64),
            "completion": pa.array(np.where(error, None, pool[rng.integers(0, len(pool), n)]), pa.string()),
            "finish_reason": np.where(error, "error", np.where(completion == 96, "length", "stop")),
            "error": pa.array(np.where(error, "prompt too long for the context", None), pa.string()),
            "prompt_tokens": rng.integers(40, 400, n).astype(np.int32), "completion_tokens": completion,
            "spec_enabled": np.full(n, spec_on), "draft_kind": [("model" if spec_on else None)] * n,
            "num_speculative_tokens": pa.array([4 if spec_on else None] * n, pa.int32()),
            "draft_tokens": drafted, "accepted_tokens": accepted, "spec_rounds": rounds,
            "acceptance_rate": pa.array(np.where(drafted > 0, accepted / np.maximum(drafted, 1), np.nan),
                                        pa.float64(), mask=drafted == 0),
            "ttft_s": ttft, "latency_s": latency, "batch_size": np.full(n, 64, np.int32),
            "attempt": np.ones(n, np.int32), "worker": ["node-a:1"] * n, "target_model": ["models/target"] * n,
            "draft_model": [("models/draft" if spec_on else None)] * n,
            "prompt_sha256": [f"{(i * 7919 + j) % 2**64:016x}" * 4 for j in range(n)],
        }, schema=OUTPUT_SCHEMA)
        pq.write_table(table, root / "out" / "data" / f"part-{shard}.parquet")
        fingerprint = {"path": str(root / "in" / f"{shard}.parquet"), "size": 0, "mtime": "0"}
        if with_input:
            pq.write_table(pa.table({"id": ids, "prompt": ["x"] * n}), root / "in" / f"{shard}.parquet")
            st = (root / "in" / f"{shard}.parquet").stat()
            fingerprint = {"path": str(root / "in" / f"{shard}.parquet"), "size": st.st_size, "mtime": str(st.st_mtime)}
        total_s = float(latency.sum() / 64)
        manifest = {
            "shard": shard, "status": "done", "attempts": 1, "backend": "vllm", "part": f"data/part-{shard}.parquet",
            "rows_in": n, "rows_out": n, "error_rows": int(error.sum()), "error_kinds": {}, "input": fingerprint,
            "path": fingerprint["path"], "row_start": 0, "row_end": n, "job_id": "synthetic", "spec_hash": spec_hash,
            "worker": "node-a:1", "started_at": "2026-12-05T00:00:00+00:00", "finished_at": "2026-12-05T00:01:00+00:00",
            "timings": {"read_s": 0.01, "generate_s": total_s, "write_s": 0.01, "calibrate_s": 0.0, "total_s": total_s},
            "tokens": {"completion_tokens": int(completion.sum()), "accepted_tokens": int(accepted.sum()),
                       "draft_tokens": int(drafted.sum()), "spec_rounds": int(rounds.sum()), "prompt_tokens": 0},
            "decisions": [{"kind": "on" if spec_on else "off", "speculate": spec_on, "k": 4 if spec_on else 0,
                           "at_row": 0, "alpha": 0.8, "predicted_speedup": 1.2, "numbers": {},
                           "reason": "on: synthetic" if spec_on else "off: synthetic"}],
        }
        if spec_on:
            manifest["saving"] = {"seconds": 0.1, "low": 0.05, "high": 0.15, "rows": n, "steps": 10, "basis": "synthetic"}
        (root / "out" / "_batchspec" / "shards" / f"{shard}.json").write_text(json.dumps(manifest))
    job = {"name": "synthetic", "job_id": "synthetic", "status": "succeeded", "shards": shards,
           "spec": spec_dict(root), "spec_hash": spec_hash, "runs": [{"job_id": "synthetic", "wall_s": 600.0, "status": "succeeded"}]}
    (root / "out" / "_batchspec" / "job.json").write_text(json.dumps(job))
    (root / "out" / "_batchspec" / "_SUCCESS").write_text("{}")


def spec_dict(root: Path) -> dict:
    return {"name": "synthetic", "input": {"path": str(root / "in"), "prompt_column": "prompt", "id_column": "id"},
            "output": {"path": str(root / "out")}, "model": {"target": "models/target"}, "cost": {"gpu_hour_usd": 2.0}}


def timed(cmd: list[str]) -> dict:
    """Run cmd in a fresh process through a small parent that reports the child's peak RSS."""
    probe = ("import resource,subprocess,sys,time,json;t=time.perf_counter();"
             "r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,stderr=subprocess.PIPE);"
             "print(json.dumps({'rc':r.returncode,'wall_s':time.perf_counter()-t,"
             "'peak_rss_mib':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024,"
             "'stderr':r.stderr.decode()[-400:]}))")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_commands(commands: dict[str, list[str]], repeats: int) -> tuple[dict[str, list[dict]], dict]:
    """Each command `repeats` times in turn, each in a fresh process: every run, and per command
    the median wall time, the largest peak RSS and the exit codes."""
    results: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, cmd in commands.items():
            r = timed(cmd)
            results[name].append(r)
            print(f"{name:<15} rc {r['rc']}  {r['wall_s']:6.1f} s  peak {r['peak_rss_mib']:7.0f} MiB"
                  + (f"  {r['stderr'].strip()[-200:]}" if r["rc"] else ""), flush=True)
    summary = {name: {"wall_s_median": statistics.median(r["wall_s"] for r in rs),
                      "peak_rss_mib_max": max(r["peak_rss_mib"] for r in rs), "rc": [r["rc"] for r in rs]}
               for name, rs in results.items()}
    return results, summary


def bench_nights(root: Path, args: argparse.Namespace) -> None:
    """The trend report over --nights outputs: JSON and HTML, each in a fresh process."""
    t = time.perf_counter()
    for day in range(1, args.nights + 1):
        night = root / f"dt=2026-11-{day:02d}"
        if not (night / "out" / "_batchspec" / "job.json").exists():
            write_output(night, args.rows, args.parts, False, seed=day)
    print(f"{args.nights} nights of {args.parts} shards under {root} in {time.perf_counter() - t:.0f} s", flush=True)
    bs = [sys.executable, "-m", "batchspec.cli", "report", str(root)]
    results, summary = run_commands({"trend_json": [*bs, "--format", "json"],
                                     "trend_html": [*bs, "--format", "html", "--out", str(root / "trend.html")]},
                                    args.repeats)
    Path(args.out).write_text(json.dumps({"nights": args.nights, "rows": args.rows, "parts": args.parts,
                                          "cpus": os.cpu_count(), "summary": summary, "runs": results}, indent=2))
    print(json.dumps(summary, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--parts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rerun", action="store_true", help="also time a rerun of the complete output (writes an input)")
    ap.add_argument("--work", help="reuse (or keep) the synthetic output here")
    ap.add_argument("--out", default="bench-report.json")
    ap.add_argument("--nights", type=int, default=0, help="write this many outputs (dt=...) and time the report over them")
    args = ap.parse_args()
    root = Path(args.work or tempfile.mkdtemp(prefix="bs-report-"))
    if args.nights:
        bench_nights(root, args)
        return
    if not (root / "out" / "_batchspec" / "job.json").exists():
        t = time.perf_counter()
        write_output(root, args.rows, args.parts, args.rerun)
        print(f"wrote {args.rows} rows in {args.parts} parts to {root} in {time.perf_counter() - t:.0f} s", flush=True)
    out = str(root / "out")
    bs = [sys.executable, "-m", "batchspec.cli"]
    commands = {
        "status": [*bs, "status", out, "--format", "json"],
        "report_json": [*bs, "report", out, "--format", "json"],
        "report_html": [*bs, "report", out, "--format", "html", "--out", str(root / "report.html")],
        "report_compare": [*bs, "report", out, "--compare", out, "--format", "json"],
    }
    if args.rerun:
        spec = root / "job.json"
        spec.write_text(json.dumps(spec_dict(root)))
        commands["rerun"] = [*bs, "rerun", str(spec), "--quiet"]
    results, summary = run_commands(commands, args.repeats)
    Path(args.out).write_text(json.dumps({"rows": args.rows, "parts": args.parts, "cpus": os.cpu_count(),
                                          "summary": summary, "runs": results}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
