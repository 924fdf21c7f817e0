"""The report's measured saving against side-by-side runs, run next to each other: on the nightly
job (scripts/bench_nightly.py's data and target: three domains, 600 rows, the cost stand-in), or
on any job given with --job, a first `batchspec submit` under
`speculation.mode: auto` (nothing remembered), one under `mode: off`, and bare vLLM plain (one
LLM.generate over every row, the project's engine_args), one after the other, the order turned
each repetition, so each auto run's two references ran within a minute or two of it.

    python scripts/bench_saving.py --concurrency 8 --repeats 3
    python scripts/bench_saving.py --concurrency 64 --repeats 3
    python scripts/bench_saving.py --remembered                       # and the job's next run, right after
                                                                      # the first, from what it remembered
    python scripts/bench_saving.py --job jobs/summarize_legal.yaml --repeats 3   # the demo job, as it is

An auto run's saving (its manifests' `saving`, summed: what the report shows first) is judged two
ways, each as a share of the auto run's generation: against `off - auto`, batchspec's own plain
decoding, which is what the run prices its rows against; and against `bare plain - auto`, the
check issue 39 sets (within 5%). The gap between the two is batchspec's plain decoding against a
bare script's (off / bare). Generation: the shards' actor seconds for batchspec, the timed call
for bare. Greedy outputs are checked identical across the arms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_nightly  # noqa: E402
from bench_vllm import batchspec  # noqa: E402

ARMS = ("auto", "off", "bare")  # turned each repetition; with --remembered, auto is the first run then the next


def one_arm(arm: str, job: Path, shards: dict, tmp: Path, tag: str) -> dict:
    """One run: bare plain, off, a first auto run (its own empty policy memory), or the next auto
    run (`remembered`, from a copy of what this repetition's first run left)."""
    if arm in ("bare", "bare spec"):  # every row in one LLM.generate, as a bare script runs the job
        res = bench_nightly.bare(job, shards, arm == "bare spec", per_shard=False)
        return {"generate_s": res["generate_s"], "completions": res["completions"]}
    out = tmp / f"out-{arm}-{tag}"
    if arm == "off":
        res = batchspec(job, "vllm", out, "speculation.mode=off")
        return {"generate_s": res["generate_s"], "by_id": res["by_id"]}
    memory = tmp / f"memory-{arm}-{tag}"
    if arm == "remembered":
        shutil.copytree(tmp / f"memory-auto-{tag}", memory)
    res = bench_nightly.auto(job, out, memory)
    return {"generate_s": res["generate_s"], "by_id": res["by_id"], "saving": res["saving"]}


def row_ids(job: Path) -> list[str]:
    """The job's row ids in plan order (bare's completions come back in that order)."""
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.read import read_shard
    from batchspec.spec import load_spec

    spec = load_spec(str(job))
    ids = []
    for shard in plan_shards(spec.input.path):
        rows = read_shard(shard, spec).to_pylist()
        col = spec.input.id_column
        ids += [str(r[col]) if col else f"{shard.shard}:{shard.row_start + i}" for i, r in enumerate(rows)]
    return ids


def judge(rep: dict, arm: str, ids: list[str]) -> dict:
    auto, off, bare = rep[arm], rep["off"], rep["bare"]
    gen, saving = auto["generate_s"], auto["saving"]["measured_saving_s"]  # vllm: every shard has one
    low, high = auto["saving"]["saving_interval_s"]
    return {"auto_s": gen, "off_s": off["generate_s"], "bare_s": bare["generate_s"], "saving_s": saving,
            "interval_s": [low, high],
            "error_vs_off": (saving - (off["generate_s"] - gen)) / gen,
            "error_vs_bare": (saving - (bare["generate_s"] - gen)) / gen,
            "covers_off": low <= off["generate_s"] - gen <= high,
            "off_over_bare": off["generate_s"] / bare["generate_s"],
            "bare_spec_s": rep["bare spec"]["generate_s"] if "bare spec" in rep else None,
            "identical": [auto["by_id"].get(i) for i in ids] == bare["completions"] == [off["by_id"].get(i) for i in ids]
            and rep.get("bare spec", bare)["completions"] == bare["completions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256, help="max_num_seqs (256: vLLM's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", type=lambda text: tuple(int(n) for n in text.split(",")), default=bench_nightly.SIZES,
                    help="rows of each domain's shards in the nightly job, comma-separated")
    ap.add_argument("--remembered", action="store_true", help="also the job's next auto run, right after the first")
    ap.add_argument("--out", help="write every repetition's figures here (JSON)")
    ap.add_argument("--bare-spec", action="store_true", help="also bare vLLM speculative (the job's draft and k), "
                    "the other static choice")
    ap.add_argument("--job", type=Path, help="judge this job as it is (its input, its engine settings) instead of "
                    "the nightly job; --concurrency and --sizes are then the job's own")
    args = ap.parse_args()
    if args.job:
        tmp, job = Path(tempfile.mkdtemp(prefix="bench-saving-")), args.job.resolve()
        what = f"{job.name}, as it is"
    else:
        tmp, job = bench_nightly.fresh_job("saving", args.sizes, args.concurrency)
        what = f"nightly job, {sum(args.sizes) * len(bench_nightly.DOMAINS)} rows at max_num_seqs {args.concurrency}"
    shards = bench_nightly.shard_prompts(job)
    ids = row_ids(job)
    print(f"{what}; 2 cores; error: (reported saving - measured) / auto's generation")
    print("| rep | order | auto s | off s | bare plain s | reported saving (95%) | vs off - auto | vs bare plain - auto "
          "| off / bare | identical |\n|---|---|---|---|---|---|---|---|---|---|")
    judged = ("auto", "remembered") if args.remembered else ("auto",)
    reps: dict[str, list[dict]] = {arm: [] for arm in judged}
    for r in range(args.repeats):
        arms = ARMS + (("bare spec",) if args.bare_spec else ())
        turn = list(arms[r % len(arms):] + arms[:r % len(arms)])
        if args.remembered:
            turn.insert(turn.index("auto") + 1, "remembered")
        got = {arm: one_arm(arm, job, shards, tmp, str(r)) for arm in turn}
        for arm in judged:
            j = {"order": turn, **judge(got, arm, ids)}
            reps[arm].append(j)
            low, high = j["interval_s"]
            print(f"| {r + 1}{'' if arm == 'auto' else ' ' + arm} | {', '.join(turn)} | {j['auto_s']:.2f} | {j['off_s']:.2f} "
                  f"| {j['bare_s']:.2f} | {j['saving_s']:+.2f} ({low:+.2f} to {high:+.2f}) | {100 * j['error_vs_off']:+.1f}% "
                  f"| {100 * j['error_vs_bare']:+.1f}% | {j['off_over_bare']:.3f} | {j['identical']} |"
                  + (f" bare spec {j['bare_spec_s']:.2f} s" if j["bare_spec_s"] is not None else ""), flush=True)
    for arm in judged:
        for ref in ("off", "bare"):
            errors = [x[f"error_vs_{ref}"] for x in reps[arm]]
            print(f"{arm} against {ref}: within 5% in {sum(abs(e) <= 0.05 for e in errors)} of {len(errors)}; median "
                  f"{100 * statistics.median(errors):+.1f}%, range {100 * min(errors):+.1f}% to {100 * max(errors):+.1f}%")
        print(f"{arm}: interval covers off - auto in {sum(x['covers_off'] for x in reps[arm])} of {len(reps[arm])}; "
              f"off / bare plain median {statistics.median(x['off_over_bare'] for x in reps[arm]):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"job": str(args.job or "nightly"), "concurrency": args.concurrency,
                                              "repetitions": reps}, indent=1))


if __name__ == "__main__":
    main()
