"""How steady is the step ratio a first run's look measures, and would stepping its two arms in
turn on their two engines make it steadier than one engine's call after the other's (what the look
does)? Tried 2026-12-06: it did not (docs/benchmarks.md), so the look stays as it was.

    python scripts/bench_look_ratio.py --concurrency 64 --repeats 10     # ~4 minutes

The nightly job's data and engines (scripts/bench_nightly.py; model.vllm_plain_engine, as on CPU),
in one process through batchspec's own backend and step hooks. Every repetition runs, in an order
that alternates:
- a look "one after the other" (the runner's look at 64): 8 rows of each of the 8 shards at k=4
  on the speculative engine, then 8 more of each plain on the plain engine;
- a look "in turn": as many other rows, both engines' rows queued (LLM.enqueue), then one step of
  each engine in turn (LLMEngine.step) until both are done, each arm's steps timed by its own rule;
- a reference: two whole shards (a legal and an out-of-domain one, short prompts) through both
  engines in turn, at the call's full concurrency and then its drain.
Each gives the step ratio at the concurrency (a step at k over a plain step, from lines fitted on
the clean steps, policy.ratio_interval) that a first run's decisions rest on. Printed: each
repetition's three ratios, then each one's spread over the repetitions and its median error
against the median reference. Rows differ between looks; vLLM's prefix caches are emptied first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_nightly as nightly  # noqa: E402


def ratio(backend, rows: list[list[int]], plain_from: int, in_turn: bool, max_new: int, stop, concurrency: int):
    """(ratio, low, high, clean steps per arm, seconds) of one look over rows (the first plain_from at k)."""
    from batchspec.engine.api import SamplingParams
    from batchspec.policy import InterleavedSteps, StepLine, ratio_interval

    for llm in (backend.llm, backend.plain_llm):
        llm.reset_prefix_cache()
    rules = (InterleavedSteps(4, interleave=False), InterleavedSteps(0, interleave=False))
    t = time.perf_counter()
    if in_turn:
        step_in_turn(backend, rows, plain_from, max_new, stop, rules)
    else:
        backend.generate(rows[:plain_from], max_new, SamplingParams(), stop, speculate=True, draft_length=rules[0])
        backend.generate(rows[plain_from:], max_new, SamplingParams(), stop, speculate=False, draft_length=rules[1])
    seconds = time.perf_counter() - t
    spec, plain = StepLine.fit(rules[0].points[4]), StepLine.fit(rules[1].points[0])
    r, low, high = ratio_interval(spec, plain, concurrency)
    return r, low, high, min(spec.points, plain.points), seconds


class ByArm:
    """One step rule for both engines that hands each step to its arm's rule: the backend's step
    hook asks the rule of its call for k (the speculative engine's steps) and tells it every step
    of either engine, the plain engine's at k = 0."""

    settled = False

    def __init__(self, rules):
        self.rules = {rule.k_spec: rule for rule in rules}

    def next_k(self) -> int:
        return max(self.rules)

    def observe_step(self, k: int, *args, **kwargs) -> None:
        self.rules[k].observe_step(k, *args, **kwargs)


def step_in_turn(backend, rows: list[list[int]], plain_from: int, max_new: int, stop, rules) -> None:
    """Rows before plain_from at k on the speculative engine, the rest plain on the plain engine,
    one step of each engine in turn, each engine's steps timed into its own rule."""
    from batchspec.engine.api import SamplingParams
    from batchspec.engine.vllm_backend import vllm_params

    params = vllm_params(SamplingParams(), stop, max_new, None)
    backend.set_k(4)
    backend._rule = ByArm(rules)  # private: a bench of the backend's own step hooks
    try:
        for llm, half in ((backend.llm, rows[:plain_from]), (backend.plain_llm, rows[plain_from:])):
            llm.enqueue([{"prompt_token_ids": ids} for ids in half], params, use_tqdm=False)
        engines = [backend.llm.llm_engine, backend.plain_llm.llm_engine]
        while busy := [e for e in engines if e.has_unfinished_requests()]:
            for engine in busy:
                engine.step()
    finally:
        backend._rule = None


def spread_rows(shards: dict[str, list[list[int]]], per_shard: int, slot: int, slots: int) -> list[list[int]]:
    """per_shard rows of each shard spread over its prompt lengths, a different set for each slot."""
    out = []
    for ids in shards.values():
        ordered = sorted(ids, key=len)
        step = len(ordered) / (per_shard * slots)
        out.extend(ordered[int((i * slots + slot) * step)] for i in range(per_shard))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rows", type=int, default=300, help="rows per shard")
    args = ap.parse_args()
    from batchspec.engine.backend import load_backend
    from batchspec.spec import load_spec

    _, job = nightly.fresh_job("look-ratio", args.rows, args.concurrency)
    spec = load_spec(str(job), ["model.vllm_plain_engine=true"])
    shards = nightly.shard_prompts(job)
    backend = load_backend("vllm", spec.model, k_default=4)
    gen = spec.generation
    stop = tuple(gen.stop)
    per_shard = max(8, -(-args.concurrency // len(shards)))  # the look's share (ActorPolicy.look_sizes)
    reference_rows = shards["legal-short-0"] + shards["scrambled-short-0"]
    found: dict[str, list[float]] = {"in turn": [], "one after the other": [], "reference": []}
    print(f"max_num_seqs {args.concurrency}; a look of {per_shard} rows of each of {len(shards)} shards per arm; "
          f"torch threads {__import__('torch').get_num_threads()}")
    for rep in range(args.repeats):
        order = ("in turn", "one after the other") if rep % 2 == 0 else ("one after the other", "in turn")
        line = [f"rep {rep + 1}"]
        for i, how in enumerate(order):
            rows = spread_rows(shards, per_shard, 2 * (2 * rep + i), 4 * args.repeats)
            rows += spread_rows(shards, per_shard, 2 * (2 * rep + i) + 1, 4 * args.repeats)
            r, low, high, n, s = ratio(backend, rows, len(rows) // 2, how == "in turn", gen.max_new_tokens, stop,
                                       args.concurrency)
            found[how].append(r)
            line.append(f"{how}: {r:.3f} ({low:.2f}-{high:.2f}, {n} steps, {s:.1f} s)")
        r, low, high, n, s = ratio(backend, reference_rows * 2, len(reference_rows), True, gen.max_new_tokens, stop,
                                   args.concurrency)
        found["reference"].append(r)
        line.append(f"reference: {r:.3f} ({low:.2f}-{high:.2f}, {n} steps, {s:.1f} s)")
        print("; ".join(line), flush=True)
    truth = statistics.median(found["reference"])
    print(f"\nmedian reference step ratio at {args.concurrency}: {truth:.3f}")
    for how, ratios in found.items():
        errors = [r / truth - 1 for r in ratios]
        print(f"{how:22s} min {min(ratios):.3f} median {statistics.median(ratios):.3f} max {max(ratios):.3f} "
              f"(max/min {max(ratios) / min(ratios):.2f}); error against the median reference: median "
              f"{statistics.median(errors):+.1%}, largest {max(errors, key=abs):+.1%}")


if __name__ == "__main__":
    main()
