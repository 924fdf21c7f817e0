"""A nightly job whose data changes under the same job name: what the policy's memory costs then.

    python scripts/bench_drift.py [--repeats 3]        # ~3.5 minutes per repetition

The policy memory (runner/memory.py) keys a job's acceptance by its name and settings, not its
input path, so a run on new data starts from the old data's acceptance. Here the demo job runs
once on its legal contracts (the memory's first run), then, on 96 prompts of random tokens under
the same job name (where the demo draft's acceptance falls from ~0.9 to ~0.3), interleaved:

    remembered     the job's next run on the new data, starting from the legal run's memory
    night after    the run after that, starting from the memory the remembered run left
    first run      the same with nothing remembered (it measures plain against k=4 in its call)
    plain          speculation.mode=off: the best a run on this data can do

and then back on the legal contracts (the data the draft follows), interleaved too:

    back after 1   the legal job's run after one night of random tokens (the remembered run's memory)
    back after 2   ... after two (the night after's memory)
    back after 3   ... after three (the memory of a third random-token night, run as "night 3")
    legal plain    speculation.mode=off on the legal contracts
    legal on       speculation.mode=on: what speculating throughout gives there

With --in-process, instead: what checking a remembered "off" (docs/policy.md) costs and gives,
in one process on one vLLM engine, so that Ray and process placement do not add their spread.
Each configuration is a new actor's ShardRunner on the demo job's four shards (one call), with
the policy memory a first measuring run on the legal contracts left, its acceptance then set to
0.35 (what a random-token night leaves) with the check due or not:

    legal|noise plain      speculation.mode=off
    legal on               speculation.mode=on
    legal|noise off        off from the remembered 0.35, check not due (what every run did before)
    legal|noise checking   the check: speculates until the call's own steps say

vllm backend, 2 CPU threads as vLLM binds them. Reported: the shards' generation seconds (medians),
each configuration's decisions, and whether every run's rows equal the plain run's.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]


def write_noise(dest: Path, shards: int = 4, rows: int = 24, tokens: int = 60) -> None:
    """Contracts of random tokens (decoded with the demo tokenizer), in the demo's columns."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / "models/legal-target")
    rng = random.Random(1)
    dest.mkdir(parents=True)
    for s in range(shards):
        table = [{"doc_id": f"noise-{s}-{i}",
                  "contract": tok.decode([rng.randrange(100, tok.vocab_size) for _ in range(tokens)])}
                 for i in range(rows)]
        pq.write_table(pa.Table.from_pylist(table), dest / f"noise-{s:04d}.parquet")


def in_process(tmp: Path, repeats: int) -> None:
    """--in-process (module docstring)."""
    import json
    import os

    os.environ["BATCHSPEC_POLICY_MEMORY"] = str(tmp / "memory")
    from batchspec.engine.backend import load_backend
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner
    from batchspec.spec import load_spec

    write_noise(tmp / "noise")
    data = {"legal": str(ROOT / "jobs/data/legal"), "noise": str(tmp / "noise")}
    base = load_spec(ROOT / "jobs/summarize_legal.yaml", ["model.backend=vllm"])
    engine = load_backend("vllm", base.model, k_default=base.speculation.num_speculative_tokens)
    runs = 0

    def run(name: str, mode: str = "auto", acceptance: float | None = None, due: bool = True):
        nonlocal runs
        runs += 1
        what, _, _ = name.partition(" ")
        spec = load_spec(ROOT / "jobs/summarize_legal.yaml", [
            "model.backend=vllm", f"input.path={data[what]}", f"output.path={tmp / f'out-{runs}'}",
            f"speculation.mode={mode}"])
        if acceptance is not None:  # the job's memory as a random-token night leaves it
            job_file = next((tmp / "memory").glob("job-*.json"))
            saved = json.loads(job_file.read_text())
            saved["acceptance"] = {"accepted": 64 * acceptance, "trials": 64.0}
            job_file.write_text(json.dumps(saved))
        runner = ShardRunner(spec, f"{name.replace(' ', '-')}-{runs}", engine=engine)
        manifests = runner.run_many(plan_shards(spec.input.path))
        assert all(m["status"] == "done" for m in manifests), manifests
        rows = {r["id"]: r["completion"] for m in manifests for r in runner.store.read_part(m["shard"]).to_pylist()}
        return sum(m["timings"]["generate_s"] for m in manifests), rows, [d["reason"] for d in manifests[0]["decisions"]]

    run("legal first")  # the memory every configuration starts from: costs and acceptance on the legal data
    configs = {"legal plain": ("off", None), "legal on": ("on", None), "legal off": ("auto", 0.35, False),
               "legal checking": ("auto", 0.35, True), "noise plain": ("off", None), "noise off": ("auto", 0.35, False),
               "noise checking": ("auto", 0.35, True)}
    results: dict[str, list] = {name: [] for name in configs}
    for rep in range(repeats):
        for name, args in configs.items():
            results[name].append(run(name, *args))
        print(f"rep {rep}: " + "  ".join(f"{n} {results[n][-1][0]:.3f}" for n in configs), flush=True)
    print(f"\nin one process, one vLLM engine; generation seconds, medians of {repeats}")
    for name in configs:
        times = [t for t, _, _ in results[name]]
        plain = results[f"{name.partition(' ')[0]} plain"]
        ratio = statistics.median(times) / statistics.median(t for t, _, _ in plain)
        same = sum(rows == plain[0][1] for _, rows, _ in results[name])
        print(f"  {name:<15} {statistics.median(times):.3f} s = {ratio:.2f}x plain  ({', '.join(f'{t:.3f}' for t in times)})"
              f"  rows equal to plain: {same}/{repeats}")
        print(f"      {' | '.join(results[name][0][2])}")


def main() -> None:
    from bench_vllm import batchspec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--in-process", action="store_true", help="instead: the check of a remembered off, in one process")
    args = ap.parse_args()
    if args.in_process:
        with tempfile.TemporaryDirectory() as t:
            in_process(Path(t), args.repeats)
        return
    job = ROOT / "jobs/summarize_legal.yaml"
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        write_noise(tmp / "noise")
        legal = tmp / "memory-legal"
        batchspec(job, "vllm", tmp / "out-legal", f"input.path={ROOT / 'jobs/data/legal'}", memory=legal)
        noise = f"input.path={tmp / 'noise'}"
        back = f"input.path={ROOT / 'jobs/data/legal'}"
        # name: (data, settings, the memory it starts from: a copy of the memory this repetition's
        # run of that name left, or of the legal run's; None for nothing remembered)
        configs = {"remembered": (noise, (), "legal"), "night after": (noise, (), "remembered"),
                   "first run": (noise, (), None), "plain": (noise, ("speculation.mode=off",), None),
                   "night 3": (noise, (), "night after"),
                   "back after 1": (back, (), "remembered"), "back after 2": (back, (), "night after"),
                   "back after 3": (back, (), "night 3"),
                   "legal plain": (back, ("speculation.mode=off",), None), "legal on": (back, ("speculation.mode=on",), None)}
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for rep in range(args.repeats):
            for name, (data, sets, start) in configs.items():
                slug = name.replace(" ", "-")
                memory = tmp / f"memory-{rep}-{slug}"
                if start is not None:
                    shutil.copytree(legal if start == "legal" else tmp / f"memory-{rep}-{start.replace(' ', '-')}", memory,
                                    ignore=shutil.ignore_patterns("*.tmp"))
                # The memory a run leaves is copied before the next run writes it (copytree above),
                # so every "back" run starts from what the random-token nights left, not each other.
                r = batchspec(job, "vllm", tmp / f"out-{rep}-{slug}", data, *sets, memory=memory)
                runs[name].append(r)
                print(f"rep {rep}: {name:<12} generate {r['generate_s']:.3f} s  wall {r['wall_s']:.1f} s", flush=True)
        for title, names, ref in (("96 random-token prompts under the demo job's name", list(configs)[:5], "plain"),
                                  ("back on the 96 legal contracts", list(configs)[5:], "legal plain")):
            plain = runs[ref][0]["by_id"]
            best = statistics.median(r["generate_s"] for r in runs[ref])
            print(f"\n{title}; medians of {args.repeats}")
            for name in names:
                rs = runs[name]
                gen = statistics.median(r["generate_s"] for r in rs)
                same = sum(r["by_id"] == plain for r in rs)
                print(f"  {name:<12} generate {gen:.3f} s = {gen / best:.2f}x plain   rows equal to plain: {same}/{len(rs)} runs")
                for reasons in list(rs[0]["decisions"].values())[:1]:
                    print(f"      {' | '.join(reasons)}")


if __name__ == "__main__":
    main()
