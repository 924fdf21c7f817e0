"""S3 requests per shard: submit, status, rerun and report of a job of many small shards on S3.

    python scripts/bench_s3_requests.py [--shards 1200] [--out bench-s3.json]

A moto S3 server on loopback behind a counting proxy (tests/s3_fault_proxy.py, no faults): every
request is counted by operation (LIST, HEAD, GET, PUT, POST, DELETE). The job is the demo job
(jobs/summarize_legal_small.yaml) with its input and output on S3, `--shards` shards of one row each and
8 new tokens, so the counts are the runner's, not the model's. Each command is a fresh
`batchspec` process; the counts are per command, and per shard.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=1200)
    ap.add_argument("--out", default="bench-s3.json")
    args = ap.parse_args()

    import s3fs
    from s3_fault_proxy import FaultProxy

    from batchspec.demo.corpus import examples

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        proxy = FaultProxy(f"http://127.0.0.1:{port}")
        opts = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench")
        ex = examples("eval", args.shards)
        for i, e in enumerate(ex):
            with fs.open(f"bench/in/prompts-{i:05d}.parquet", "wb") as f:
                pq.write_table(pa.table({"doc_id": [e["doc_id"]], "contract": [e["contract"][:400]]}), f)
        sets = ["--set", "input.path=s3://bench/in/", "--set", "output.path=s3://bench/out/",
                "--set", "generation.max_new_tokens=8"]
        for side in ("input", "output"):
            sets += ["--set", f"{side}.storage_options={json.dumps(opts)}"]
        job = str(ROOT / "jobs/summarize_legal_small.yaml")
        bs = [sys.executable, "-m", "batchspec.cli"]
        commands = {
            "submit": [*bs, "submit", job, "--quiet", *sets],
            "status": [*bs, "status", "s3://bench/out/", "--format", "json",
                       *(x for k, v in opts.items() for x in ("--storage-option", f"{k}={v}"))],
            "rerun (complete)": [*bs, "rerun", job, "--quiet", *sets],
            "report": [*bs, "report", "s3://bench/out/", "--format", "json",
                       *(x for k, v in opts.items() for x in ("--storage-option", f"{k}={v}"))],
        }
        results = {}
        for name, cmd in commands.items():
            before = dict(proxy.operations)
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""})
            counts = {op: proxy.operations.get(op, 0) - before.get(op, 0) for op in sorted(proxy.operations)}
            results[name] = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t, 1), "requests": counts,
                             "per_shard": {op: round(n / args.shards, 2) for op, n in counts.items() if n}}
            print(f"{name:<18} rc {r.returncode} {results[name]['wall_s']:6.1f} s  {counts}"
                  + (f"\n{r.stderr[-1500:]}" if r.returncode else ""), flush=True)
        Path(args.out).write_text(json.dumps({"shards": args.shards, "results": results}, indent=2))
        proxy.stop()
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
