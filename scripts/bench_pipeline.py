"""Pipeline overhead: a whole job through Ray (actor pool) against the bare engine, same rows, same batch.

    python scripts/bench_pipeline.py [--shards 4] [--rows 32] [--max-new-tokens 48] [--repeats 2]

Ray is started before timing (as in a long-lived cluster). The job's wall time includes
everything a user waits for: planning, actor start-up (model load + calibration), reading
shards, generation, writing parts and manifests. The bare engine gets the same rows in the
same micro-batches, with the model already loaded. Speculation is fixed (mode on, fixed k) in
both so the policy's choices do not differ between the two. Repetitions alternate.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench-pipeline.json")
    args = ap.parse_args()

    from batchspec.demo.corpus import PROMPT, examples
    from batchspec.demo.setup import build_demo_model
    from batchspec.engine import DraftSpec, Engine
    from batchspec.runner.cluster import init_ray
    from batchspec.runner.job import submit
    from batchspec.spec import spec_from_dict

    model = str(build_demo_model())
    work = Path(tempfile.mkdtemp(prefix="bs-pipeline-"))
    (work / "in").mkdir()
    prompts_all = []
    for s in range(args.shards):
        ex = examples("eval", args.rows, offset=s * args.rows)
        pq.write_table(pa.table({"doc_id": [e["doc_id"] for e in ex], "contract": [e["contract"] for e in ex]}),
                       work / "in" / f"prompts-{s:04d}.parquet")
        prompts_all.append([PROMPT.format(contract=e["contract"]) for e in ex])

    def job_spec(out: str):
        return spec_from_dict({
            "name": "pipeline", "input": {"path": str(work / "in"), "prompt_column": "contract", "id_column": "doc_id",
                                          "template": PROMPT},
            "output": {"path": out}, "model": {"target": model, "draft": {"kind": "ngram"}, "backend": "hf"},  # the engine timed bare
            "generation": {"max_new_tokens": args.max_new_tokens}, "speculation": {"mode": "on", "adaptive": False},
            "resources": {"actors": 1, "cpus_per_actor": 2, "batch_size": args.batch_size},
        })

    engine = Engine.load(model, DraftSpec(kind="ngram"))

    def bare() -> tuple[float, int]:
        t, tokens = time.perf_counter(), 0
        for prompts in prompts_all:
            ids = sorted(engine.tokenize(prompts), key=len)  # the worker also sorts by length
            for i in range(0, len(ids), args.batch_size):
                outs, _ = engine.generate(ids[i:i + args.batch_size], args.max_new_tokens, speculate=True, draft_length=4)
                tokens += sum(o.stats.completion_tokens for o in outs)
        return time.perf_counter() - t, tokens

    in_actor: list[float] = []

    def job(rep: int) -> tuple[float, int]:
        out = work / f"out-{rep}"
        t = time.perf_counter()
        result = submit(job_spec(str(out)))
        wall = time.perf_counter() - t
        assert result.ok, result.failed
        # Time the actor spent inside shards (read, validate, generate, write, manifest): the rest
        # of the wall time is fixed start-up (Ray, actor process, imports, model load).
        in_actor.append(sum(json.loads(p.read_text())["timings"]["total_s"]
                            for p in (out / "_batchspec" / "shards").glob("*.json")))
        shutil.rmtree(out)
        return wall, result.completion_tokens

    init_ray(num_cpus=2)
    bare()  # warm-up
    samples = {"bare engine": [], "batchspec job": []}
    for rep in range(args.repeats):
        samples["bare engine"].append(bare())
        samples["batchspec job"].append(job(rep))
    rows = {name: {"tokens_per_s": statistics.median(tok / wall for wall, tok in s), "wall_s": [w for w, _ in s],
                   "tokens": s[0][1]} for name, s in samples.items()}
    overhead = 1 - rows["batchspec job"]["tokens_per_s"] / rows["bare engine"]["tokens_per_s"]
    bare_s = statistics.median(w for w, _ in samples["bare engine"])
    job_s = statistics.median(w for w, _ in samples["batchspec job"])
    shard_s = statistics.median(in_actor)
    report = {"shards": args.shards, "rows_per_shard": args.rows, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "results": rows, "overhead": overhead,
              "bare_s": bare_s, "job_s": job_s, "in_shards_s": shard_s,
              "per_shard_overhead": shard_s / bare_s - 1, "fixed_startup_s": job_s - shard_s}
    Path(args.out).write_text(json.dumps(report, indent=2))
    for name, r in rows.items():
        print(f"{name:<16} {r['tokens_per_s']:8.1f} tok/s  wall {', '.join(f'{w:.1f}s' for w in r['wall_s'])}  tokens {r['tokens']}")
    print(f"pipeline overhead: {overhead:.1%} (job tokens/s vs bare engine tokens/s)")
    print(f"  of which per-shard work (read, validate, write, manifests) {report['per_shard_overhead']:.1%} "
          f"({shard_s:.1f}s in shards vs {bare_s:.1f}s bare), fixed start-up {report['fixed_startup_s']:.1f}s "
          "(Ray, actor process, imports, model load)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
