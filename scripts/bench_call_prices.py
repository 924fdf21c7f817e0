"""How far the cost model is from whole calls: the nightly job's shards on the vllm backend, in
one process as an actor runs them (two engines), a first run and a remembered one; each call's
measured seconds against what the step lines priced its rows at (the "call:" line that
runner/together.py logs), per arm.

    python scripts/bench_call_prices.py                      # at max_num_seqs 64, the policy's margin
    python scripts/bench_call_prices.py --margin -0.12       # lower the bar, so some shards speculate
    python scripts/bench_call_prices.py --concurrency 256 --off   # and the saving each run reported
                                                                  # against a run under mode=off
    python scripts/bench_call_prices.py --job demo --off          # the same on the demo job (96 rows)
    python scripts/bench_call_prices.py --job mixed --off         # ... and bench_vllm.py's mixed job
    python scripts/bench_call_prices.py --job demo --demo-rows 2304 --off   # a demo job of 12 x 192 rows

The step lines are fitted on the steps of calls' drains (the only steps without prompts in them);
a ratio far from 1.00x, and apart between the arms, is a bias in the predictions the decisions
rest on (docs/policy.md). The data is bench_nightly.py's (8 shards, 2,400 rows), or with --job the
demo job as shipped or bench_vllm.py's mixed job (its 48 demo rows and 48 of three contracts each),
at vLLM's default concurrency unless --concurrency is given.

With --off, the same shards also run under `speculation.mode=off` after each auto run, on the
same engines (no process or engine load between them; vLLM's prefix caches emptied before every
run, so no run reuses an earlier one's prompts), and each auto run's reported
saving (its manifests' `saving`, summed) is printed beside the mean off run's generation less its own:
the report's saving against what a side-by-side run of plain decoding measures.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

CALL = re.compile(r"call: (\d+) rows at k=(\d+) took ([\d.]+) s; the step lines priced them at ([\d.]+) s")


class Calls(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: list[tuple[int, int, float, float]] = []

    def emit(self, record):
        if m := CALL.search(record.getMessage()):
            rows, k, took, priced = m.groups()
            self.seen.append((int(rows), int(k), float(took), float(priced)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", choices=("nightly", "demo", "mixed"), default="nightly")
    ap.add_argument("--demo-rows", type=int, default=96, help="--job demo: its rows (96, or a multiple of 192)")
    ap.add_argument("--concurrency", type=int, default=None, help="max_num_seqs (nightly default: 64)")
    ap.add_argument("--rows", type=int, default=300, help="rows per shard (8 shards)")
    ap.add_argument("--margin", type=float, default=None, help="the policy's margin (default: its own, 0.05)")
    ap.add_argument("--off", action="store_true", help="also run the shards under mode=off, before and after")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-call-prices-"))
    os.environ["BATCHSPEC_POLICY_MEMORY"] = str(tmp / "memory")
    import bench_nightly

    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner
    from batchspec.spec import load_spec

    if args.job == "nightly":
        bench_nightly.write_data(tmp / "data", args.rows)
        spec = load_spec(str(bench_nightly.write_job(tmp, tmp / "data", args.concurrency or 64)))
    else:
        import bench_vllm

        spec = load_spec(str(bench_vllm.write_jobs(tmp, [args.job], demo_rows=args.demo_rows)[args.job]))
        if args.concurrency:
            spec = spec.model_copy(update={"model": spec.model.model_copy(
                update={"vllm_args": {**spec.model.vllm_args, "max_num_seqs": args.concurrency}})})
    calls = Calls()
    logging.getLogger("batchspec.worker").addHandler(calls)
    logging.getLogger("batchspec.worker").setLevel(logging.INFO)
    engine = None
    print(f"threads: {os.cpu_count()} cores; job {args.job}; concurrency {args.concurrency or 'vLLM default'}"
          + (f"; rows: 8 x {args.rows}" if args.job == "nightly" else ""))
    generated, saved = {}, {}
    for run in (("first", "off-1", "remembered", "off-2") if args.off else ("first", "remembered")):
        s = spec.model_copy(update={"output": spec.output.model_copy(update={"path": str(tmp / f"out-{run}")})})
        # The off runs use the auto runs' engines (both loaded by the first) and remember nothing.
        os.environ["BATCHSPEC_POLICY_MEMORY"] = "off" if run.startswith("off") else str(tmp / "memory")
        if run.startswith("off"):
            s = s.model_copy(update={"speculation": s.speculation.model_copy(update={"mode": "off"})})
        runner = ShardRunner(s, f"prices-{run}", engine=engine)
        engine = runner.engine
        for llm in (engine.llm, engine.plain_llm):  # no run reuses the prompts an earlier one cached
            if llm is not None:
                llm.reset_prefix_cache()
        if args.margin is not None:
            runner.policy.margin = args.margin
        calls.seen.clear()
        t = time.perf_counter()
        manifests = runner.run_many(plan_shards(s.input.path))
        print(f"{run}: {time.perf_counter() - t:.1f} s")
        for rows, k, took, priced in calls.seen:
            print(f"  call of {rows:5d} rows at k={k}: took {took:6.2f} s, priced {priced:6.2f} s ({took / priced:.2f}x)")
        for m in manifests:
            d = m["decisions"][-1] if m["decisions"] else {"kind": "-", "numbers": {}}
            print(f"    {m['shard']:18s} {d['kind']:10s} predicted {d['numbers'].get('predicted_own')}")
        generated[run] = sum(m["timings"]["generate_s"] for m in manifests)
        saved[run] = [sum(m["saving"][b] for m in manifests if m.get("saving")) for b in ("seconds", "low", "high")]
        print(f"  generation {generated[run]:.2f} s; reported saving {saved[run][0]:+.2f} s "
              f"({saved[run][1]:+.2f} to {saved[run][2]:+.2f})")
    if args.off:
        off = (generated["off-1"] + generated["off-2"]) / 2
        for run in ("first", "remembered"):
            print(f"{run}: reported saving {saved[run][0]:+.2f} s; mode=off (mean of {generated['off-1']:.2f} and "
                  f"{generated['off-2']:.2f} s) less auto: {off - generated[run]:+.2f} s "
                  f"(difference {100 * (saved[run][0] - off + generated[run]) / generated[run]:+.1f}% of generation)")


if __name__ == "__main__":
    main()
