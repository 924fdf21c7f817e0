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

Since the per-shard policy (issue 39) a remembered acceptance decides nothing on vllm: each run's
look measures every shard's own, so this measures what a run on changed data pays for its look.

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


def main() -> None:
    from bench_vllm import batchspec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    job = ROOT / "jobs/summarize_legal_small.yaml"
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
