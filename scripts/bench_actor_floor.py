"""Bare vLLM plain decoding of the nightly job, in a plain process and inside a Ray actor,
interleaved: what running inside a Ray actor costs, apart from anything batchspec's runner does.

    python scripts/bench_actor_floor.py --repeats 3 --concurrency 64

The same child code runs both ways: one LLM(...) without speculation (the job's engine_args), a
warm-up call, one timed LLM.generate over the 2,400 rows of scripts/bench_nightly.py's data. The
actor is a plain @ray.remote(num_cpus=2) class on a fresh local Ray, started with batchspec's
actor environment (RAY_worker_niceness=0). While the actor generates, every thread of its process
is sampled from /proc, so the CPU its non-engine threads take is shown (Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nightly as nightly  # noqa: E402
from bench_vllm import child_result  # noqa: E402

# Runs bench_nightly.BARE's timed call (everything before its per-shard calls) inside a Ray actor,
# sampling the actor's threads from a thread of the driver while it runs.
ACTOR = r'''
import json, os, sys, threading, time
os.environ["RAY_worker_niceness"] = "0"
import ray
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
code = open(sys.argv[2]).read()

@ray.remote(num_cpus=2)
class Bare:
    def pid(self):
        return os.getpid()
    def run(self, path, pin):
        import contextlib, io
        if pin is not None:  # this thread and those it starts (the engine's) on one core
            os.sched_setaffinity(0, {pin})
        buf = io.StringIO()
        sys.argv = ["bare", path]
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "bare", "exec"), {"__name__": "__main__"})
        return buf.getvalue()

def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[tid] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError):
            pass
    return out

actor = Bare.remote()
pid = ray.get(actor.pid.remote())
result = actor.run.remote(sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else None)
first, t0 = threads(pid), time.time()
samples = [(t0, first)]
while not ray.wait([result], timeout=0.5)[0]:
    samples.append((time.time(), threads(pid)))
line = [l for l in ray.get(result).splitlines() if l.startswith("RESULT")][0]
res = json.loads(line[6:])
# CPU per thread name over the last 80% of the samples (mostly generation)
a, b = samples[len(samples) // 5], samples[-1]
by_name = {}
for tid, (name, cpu) in b[1].items():  # a thread started since (the engine's OpenMP pool): all of its CPU
    by_name[name] = by_name.get(name, 0.0) + cpu - (a[1][tid][1] if tid in a[1] else 0.0)
res["actor_threads_cpu_s"] = {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v > 0.01}
res["sampled_s"] = round(b[0] - a[0], 1)
print("RESULT" + json.dumps(res))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    ap.add_argument("--pin", type=int, default=None, help="also run the actor with its engine pinned to this core")
    args = ap.parse_args()
    from batchspec.engine.vllm_backend import engine_args
    from batchspec.spec import load_spec

    tmp = Path(tempfile.mkdtemp(prefix="bench-actor-floor-"))
    nightly.write_data(tmp / "data", args.rows)
    job = nightly.write_job(tmp, tmp / "data", None if args.concurrency == 256 else args.concurrency)
    spec = load_spec(str(job))
    engine = engine_args(spec.model, spec.speculation.num_speculative_tokens, on_gpu=False)
    engine.pop("per_request_spec_decode_metrics", None)
    engine["speculative_config"] = None
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"engine": engine, "shards": nightly.shard_prompts(job),
                               "max_new_tokens": spec.generation.max_new_tokens, "stop": spec.generation.stop}))
    code = tmp / "bare.py"
    code.write_text(nightly.BARE.split("apart = {}")[0] + 'print("RESULT" + json.dumps({"generate_s": gen}))\n')
    variants = {"actor": ()} | ({f"actor pinned to core {args.pin}": (str(args.pin),)} if args.pin is not None else {})
    times: dict[str, list[float]] = {"process": [], **{name: [] for name in variants}}
    print(f"threads: {os.cpu_count()} cores; {args.rows * 8} rows at max_num_seqs {args.concurrency}", flush=True)
    for rep in range(args.repeats):
        times["process"].append(child_result(code.read_text(), str(cfg), what="bare process")["generate_s"])
        line = [f"{rep}: process {times['process'][-1]:.2f} s"]
        for name, extra in variants.items():
            res = child_result(ACTOR, str(cfg), str(code), *extra, what="bare in a Ray actor")
            times[name].append(res["generate_s"])
            line.append(f"{name} {res['generate_s']:.2f} s (threads' CPU-s over {res['sampled_s']} s: "
                        f"{res['actor_threads_cpu_s']})")
        print("; ".join(line), flush=True)
    for name in variants:
        ratios = sorted(x / y for x, y in zip(times[name], times["process"]))
        print(f"median: process {statistics.median(times['process']):.2f} s, {name} {statistics.median(times[name]):.2f} s; "
              f"per pair {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
