"""What the drain tails of an auto run's calls cost on vLLM, and what stepping its two engines in
turn would win back, with bare vLLM only (no batchspec code in the calls): the next step of issue 39.

    python scripts/bench_stream.py [--concurrency 256] [--repeats 2]     # ~6 minutes here

An auto run on two engines (model.vllm_plain_engine, the CPU default) makes four calls where a
bare script makes one: its look (32 rows of each shard at k on the speculative engine, then 32
more plain on the plain engine), then one call per decision (here legal-short at k, the rest
plain, as the nightly job's decisions mostly were). Each call ends in a drain tail, the engine
running ever fewer rows. In one process with both engines, over the nightly job's 2,400 rows
(scripts/bench_nightly.py's data), interleaved, the order turned each repetition:

    one plain call       every row on the plain engine in one LLM.generate (bare plain)
    four calls           the auto run's four calls, one after the other (what batchspec does)
    in turn              the look's two halves as one stream over both engines, stepped in turn
                         (LLM.enqueue, then LLMEngine.step on each engine while it has requests),
                         then the two groups the same way: two tails
    in turn, early       as in turn, but each group is enqueued once 90% of the look's rows have
                         finished (a decision from 90% of the look rows), so its rows fill the
                         look's tail

Greedy outputs of every arrangement are checked identical per row. Generation seconds; threads:
the torch default here (2 cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_nightly  # noqa: E402

CHILD = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
cfg = json.loads(open(sys.argv[1]).read())
from vllm import LLM, SamplingParams
plain, spec = LLM(**cfg["plain"]), LLM(**cfg["spec"])  # plain first, as batchspec's actor starts them
params = SamplingParams(temperature=0.0, max_tokens=cfg["max_new_tokens"], stop=cfg["stop"] or None)
shards = cfg["shards"]
names = list(shards)
look_k = [shards[n][i] for i in range(32) for n in names]
look_plain = [shards[n][i] for i in range(32, 64) for n in names]
on = [ids for n in names if n.startswith("legal-short") for ids in shards[n][64:]]
off = [ids for n in names if not n.startswith("legal-short") for ids in shards[n][64:]]
every = [ids for n in names for ids in shards[n]]

def p(rows):
    return [{"prompt_token_ids": ids} for ids in rows]

def texts(outs):
    return {tuple(o.prompt_token_ids): o.outputs[0].text for o in outs}

def one_call():
    return texts(plain.generate(p(every), params, use_tqdm=False))

def four_calls():
    got = {}
    for llm, rows in ((spec, look_k), (plain, look_plain), (spec, on), (plain, off)):
        got.update(texts(llm.generate(p(rows), params, use_tqdm=False)))
    return got

def stream(phases, early):
    # phases: [[(llm, rows), ...], ...]; a phase's requests go in once `early` of the previous
    # phase's have finished; engines with requests are stepped in turn until all are done.
    got, finished = {}, 0
    def enqueue(phase):
        for llm, rows in phase:
            llm.enqueue(p(rows), params, use_tqdm=False)
        return sum(len(rows) for _, rows in phase)
    current, waiting = enqueue(phases[0]), phases[1:]
    while True:
        busy = [llm for llm in (spec, plain) if llm.llm_engine.has_unfinished_requests()]
        if waiting and finished >= early * current:
            finished, current, waiting = 0, enqueue(waiting[0]), waiting[1:]
            continue
        if not busy:
            break
        for llm in busy:
            for o in llm.llm_engine.step():
                if o.finished:
                    got[tuple(o.prompt_token_ids)] = o.outputs[0].text
                    finished += 1
    return got

PHASES = [[(spec, look_k), (plain, look_plain)], [(spec, on), (plain, off)]]  # the look, then the groups
ARMS = {"one plain call": one_call, "four calls": four_calls,
        "in turn": lambda: stream(PHASES, 1.0), "in turn, early": lambda: stream(PHASES, 0.9)}
plain.generate(p(every[:2]), params, use_tqdm=False)
spec.generate(p(every[:2]), params, use_tqdm=False)
times = {name: [] for name in ARMS}
reference = None
for rep in range(cfg["repeats"]):
    order = list(ARMS)
    order = order[rep % len(order):] + order[:rep % len(order)]
    for name in order:
        plain.reset_prefix_cache(); spec.reset_prefix_cache()
        t = time.perf_counter()
        got = ARMS[name]()
        times[name].append(time.perf_counter() - t)
        if reference is None:
            reference = got
        assert got == reference, f"{name}: outputs differ"
        print(f"rep {rep + 1} {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
print("RESULT" + json.dumps({"times": times, "rows": len(every)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256, help="max_num_seqs of both engines (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    args = ap.parse_args()
    _, job = bench_nightly.fresh_job("stream", args.rows, args.concurrency)
    shards = bench_nightly.shard_prompts(job)
    res = bench_nightly.both_engines(CHILD, job, shards, args.repeats, what="bench_stream child")
    base = res["times"]["one plain call"]
    print(f"{res['rows']} rows at max_num_seqs {args.concurrency}, {args.repeats} repetitions (generation s; "
          f"x: against the one plain call of the same repetition):")
    for name, values in res["times"].items():
        ratios = [v / b for v, b in zip(values, base)]
        print(f"  {name:<16} {', '.join(f'{v:.2f}' for v in values)}   "
              f"x {', '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
