"""What a plain call costs on the vllm backend's speculative engine, with and without its draft.

    python scripts/bench_plain_calls.py [--jobs mixed,demo_eagle3] [--rows-per-call 96] [--repeats 6]
    python scripts/bench_plain_calls.py --nightly 64 --rows-per-call 2400 --repeats 2   # the nightly job, one call

At k=0 vLLM still runs a model draft over every new token, to keep the draft's KV cache for a
later k > 0; batchspec skips that in calls that stay plain (docs/policy.md). In one process per
job, interleaved, vLLM's prefix cache emptied before every call (a real job never sends the same
prompt twice), calls of --rows-per-call rows over the job's prompts:

    plain engine           a second engine without speculation (model.vllm_plain_engine)
    k=0, draft skipped     the speculative engine, plain, as batchspec runs it now
    k=0, draft run         the same with the skip turned off (as vLLM runs k=0)
    k=4                    the speculative engine at k=4

Greedy outputs of all four are checked equal. Job names as in scripts/bench_vllm.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(job: Path, rows_per_call: int, repeats: int) -> None:
    from bench_vllm import job_prompts

    from batchspec.engine.vllm_backend import VLLMBackend
    from batchspec.spec import load_spec

    spec = load_spec(str(job))
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"vllm_plain_engine": True})})
    _, ids = job_prompts(spec)
    backend = VLLMBackend.load(spec.model)
    plain_llm, gen = backend.plain_llm, spec.generation
    configs = {"plain engine": (True, True, 0), "k=0, draft skipped": (False, True, 0),
               "k=0, draft run": (False, False, 0), "k=4": (False, True, 4)}
    times = {name: [] for name in configs}
    outputs = {}
    for _ in range(repeats):
        for name, (on_plain_engine, skip, k) in configs.items():
            backend.plain_llm, backend.skips_draft = (plain_llm if on_plain_engine else None), skip
            total, texts = 0.0, []
            for i in range(0, len(ids), rows_per_call):
                backend.llm.reset_prefix_cache()
                plain_llm.reset_prefix_cache()
                t = time.perf_counter()
                outs, _ = backend.generate(ids[i:i + rows_per_call], gen.max_new_tokens, stop=tuple(gen.stop),
                                           speculate=k > 0, draft_length=k)
                total += time.perf_counter() - t
                texts += [o.text for o in outs]
            times[name].append(total)
            outputs.setdefault(name, texts)
    same = all(texts == outputs["plain engine"] for texts in outputs.values())
    print(f"\n{job.stem}: {len(ids)} rows, {rows_per_call} per call, medians of {repeats}; outputs equal: {same}")
    for name, ts in times.items():
        print(f"  {name:<20} {statistics.median(ts):6.3f} s   ({', '.join(f'{t:.3f}' for t in ts)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", default="mixed,demo_eagle3")
    ap.add_argument("--rows-per-call", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--nightly", type=int, default=None, metavar="MAX_NUM_SEQS",
                    help="instead of --jobs: scripts/bench_nightly.py's job (8 shards x 300 rows) at this concurrency")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench_vllm import write_jobs

    with tempfile.TemporaryDirectory() as tmp:
        if args.nightly:
            import bench_nightly

            bench_nightly.write_data(Path(tmp) / "data", 300)
            run(bench_nightly.write_job(Path(tmp), Path(tmp) / "data", args.nightly), args.rows_per_call, args.repeats)
            return
        for _name, job in write_jobs(Path(tmp), args.jobs.split(",")).items():
            run(job, args.rows_per_call, args.repeats)


if __name__ == "__main__":
    main()
