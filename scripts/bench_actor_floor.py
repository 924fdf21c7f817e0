"""Bare vLLM plain decoding of the nightly job, in a plain process and inside a Ray actor,
interleaved: what running inside a Ray actor costs, apart from anything batchspec's runner does;
with --batchspec, also `batchspec submit` of the same job under speculation.mode=off (one plain
engine, as the bare ones), so the floor of batchspec's plain decoding splits into its parts.

    python scripts/bench_actor_floor.py --repeats 3 --concurrency 64
    python scripts/bench_actor_floor.py --repeats 3 --concurrency 256 --batchspec

The same child code runs both ways: one LLM(...) without speculation (the job's engine_args), a
warm-up call, one timed LLM.generate over the 2,400 rows of scripts/bench_nightly.py's data. The
actor is a plain @ray.remote(num_cpus=2) class on a fresh local Ray, started with batchspec's
actor environment (RAY_worker_niceness=0). While the actor generates, every thread of its process
is sampled from /proc, so the CPU its non-engine threads take is shown (Linux only). While
batchspec runs, every process on the machine is sampled the same way, and the CPU each took in the
shard actor's generation window (its busiest stretch) is shown: what runs beside the engine.
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


def proc_cpu() -> dict[str, tuple[str, float]]:
    """pid -> (command line, CPU seconds so far) of every process (Linux /proc)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            fields = stat[stat.rindex(")") + 2:].split()
            name = cmd or stat[stat.index("(") + 1:stat.rindex(")")]
            out[pid] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError):
            pass
    return out


def batchspec_off(job: Path, out: Path) -> dict:
    """`batchspec submit` of the job with speculation.mode=off, sampling every process's CPU every
    0.25 s; its shards' generate_s, and what each process took while the shard actor (the process
    that took the most CPU) ran at over 1.5 cores, its generation."""
    from batchspec.runner.store import OutputStore

    env = {**os.environ, "BATCHSPEC_POLICY_MEMORY": "off"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "batchspec"), "submit", str(job), "--quiet",
                             "--set", "model.backend=vllm", "--set", f"output.path={out}",
                             "--set", "speculation.mode=off"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    samples = []
    while proc.poll() is None:
        samples.append((time.time(), proc_cpu()))
        time.sleep(0.25)
    if proc.returncode != 0:
        raise RuntimeError(f"batchspec submit failed:\n{proc.stderr.read()[-3000:]}")
    first, last = samples[0][1], samples[-1][1]
    actor = max(last, key=lambda pid: last[pid][1] - first.get(pid, ("", 0.0))[1])
    busy = [i for i, ((t0, a), (t1, b)) in enumerate(zip(samples, samples[1:]))
            if actor in a and actor in b and (b[actor][1] - a[actor][1]) / (t1 - t0) > 1.5]
    (t0, a), (t1, b) = samples[busy[0]], samples[busy[-1] + 1]
    took = {pid: (name, cpu - a.get(pid, (name, 0.0))[1]) for pid, (name, cpu) in b.items()}
    others = sorted(((cpu, name[:60]) for pid, (name, cpu) in took.items() if pid != actor and cpu >= 0.05), reverse=True)
    gen = sum(m["timings"]["generate_s"] for m in OutputStore(str(out)).manifests().values())
    return {"generate_s": gen, "window_s": round(t1 - t0, 1), "actor_cpu_s": round(took[actor][1], 2),
            "others_cpu_s": round(sum(c for pid, (_, c) in took.items() if pid != actor), 2),
            "top": [(round(c, 2), n) for c, n in others[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    ap.add_argument("--pin", type=int, default=None, help="also run the actor with its engine pinned to this core")
    ap.add_argument("--batchspec", action="store_true", help="also batchspec submit under speculation.mode=off")
    args = ap.parse_args()
    from batchspec.engine.vllm_backend import engine_args
    from batchspec.spec import load_spec

    tmp, job = nightly.fresh_job("actor-floor", args.rows, args.concurrency)
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
    if args.batchspec:
        times["batchspec off"] = []
    print(f"threads: {os.cpu_count()} cores; {args.rows * 8} rows at max_num_seqs {args.concurrency}", flush=True)
    for rep in range(args.repeats):
        times["process"].append(child_result(code.read_text(), str(cfg), what="bare process")["generate_s"])
        line = [f"{rep}: process {times['process'][-1]:.2f} s"]
        for name, extra in variants.items():
            res = child_result(ACTOR, str(cfg), str(code), *extra, what="bare in a Ray actor")
            times[name].append(res["generate_s"])
            line.append(f"{name} {res['generate_s']:.2f} s (threads' CPU-s over {res['sampled_s']} s: "
                        f"{res['actor_threads_cpu_s']})")
        if args.batchspec:
            res = batchspec_off(job, tmp / f"out-{rep}")
            times["batchspec off"].append(res["generate_s"])
            line.append(f"batchspec off {res['generate_s']:.2f} s (in its actor's {res['window_s']} s of generation: "
                        f"actor {res['actor_cpu_s']} CPU-s, every other process {res['others_cpu_s']}: {res['top']})")
        print("; ".join(line), flush=True)
    for name in [*variants, *(["batchspec off"] if args.batchspec else [])]:
        ratios = sorted(x / y for x, y in zip(times[name], times["process"]))
        print(f"median: process {statistics.median(times['process']):.2f} s, {name} {statistics.median(times[name]):.2f} s; "
              f"per pair {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
