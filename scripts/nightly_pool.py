"""Pool the repetitions of several `scripts/bench_nightly.py --out` files: issue 39's goals judged
on every repetition at once, beside how much the references themselves move between repetitions.

    python scripts/nightly_pool.py run1.json run2.json ...        # engines: two (+plain), as run
    python scripts/nightly_pool.py run1.json --engines one

One repetition's bare reference is a single timed call per shard (or per kind of shard); on a
2-core machine its plain/spec ratio moves by more than the ±7% a prediction is judged against
(three shards of one kind, same rows' distribution, differ by up to 30% within one repetition).
This prints, per concurrency:

  time       each repetition's auto first / remembered generation over the better bare arm
  reference  per kind of shard, bare plain s / bare spec s (> 1: speculation faster) in every
             repetition, by each reference the run has: "paired" (both engines in one process,
             medians, --paired), "apart" (each bare process's own call per shard), "kind" (each
             kind's rows in one call); the pooled figure is the geometric mean over repetitions
  predicted  the mean of each kind's shards' predicted speedups (numbers.predicted_own) per run,
             pooled the same way, and its error against each pooled reference
  decisions  how many of the kind's shards speculated, first / remembered, per run
  saving     the report's measured saving minus the side-by-side one (bare plain - auto, and
             batchspec off - auto), as a share of auto's generation, every run

Nothing is averaged away silently: every repetition's figure is printed beside the pooled one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_nightly import apart_reference, kind_ratio, mean_predicted, shards_of  # noqa: E402

# bench_nightly.py's blocks, as its docs/benchmarks.md tables name them
LETTERS = {"bare plain": "P", "bare spec": "S", "paired": "R", "auto": "A", "off": "O"}


def gmean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def kind_ratios(run: dict, domains: dict[str, str]) -> dict[str, dict[str, float]]:
    """{reference: {kind: plain s / spec s}} for the references this repetition has."""
    plain, spec = run["bare_plain"], run["bare_spec"]
    sources = {"apart": {"plain": plain.get("apart_s"), "spec": spec.get("apart_s")}}
    if "paired" in run:
        sources["paired"] = run["paired"]["median"]
    out: dict[str, dict[str, float]] = {}
    for ref, arms in sources.items():
        if arms["plain"] and arms["spec"]:
            out[ref] = {kind: kind_ratio(arms, shards_of(domains, kind)) for kind in sorted(set(domains.values()))}
    if plain.get("kind_s") and spec.get("kind_s"):
        out["kind"] = {k: plain["kind_s"][k] / spec["kind_s"][k] for k in plain["kind_s"]}
    return out


def saving_error(r: dict, reference: str) -> float | None:
    """The report's measured saving less a side-by-side one (r[reference]: bare plain - auto, or
    batchspec off - auto), as a share of auto's generation; None where no saving was measured."""
    reported = r["saving"].get("measured_saving_s")
    return None if reported is None else (reported - r[reference]) / r["generate_s"]


def within_kind_spread(run: dict, domains: dict[str, str]) -> list[str]:
    """Per kind with several shards: the spread of their own apart ratios within this repetition."""
    arms = apart_reference(run)
    out = []
    for kind in sorted(set(domains.values())):
        names = shards_of(domains, kind)
        if len(names) > 1:
            rs = [arms["plain"][n] / arms["spec"][n] for n in names]
            out.append(f"{kind} {min(rs):.2f}-{max(rs):.2f}")
    return out


def pool(files: list[str], engines: str) -> None:
    runs, domains = [], {}
    for f in files:
        data = json.loads(Path(f).read_text())
        domains = data["shards"]
        runs += [(Path(f).stem, r) for r in data["runs"]]
    kinds = sorted(set(domains.values()))
    first, again = f"auto_first{engines}", f"auto_remembered{engines}"
    for conc in sorted({r["concurrency"] for _, r in runs}, reverse=True):
        rs = [(name, r) for name, r in runs if r["concurrency"] == conc and first in r]
        if not rs:
            continue
        print(f"\n## concurrency {conc}{engines}: {len(rs)} repetitions ({', '.join(sorted({n for n, _ in rs}))})\n")
        print("| run | ran | auto first / best bare | remembered / best bare | off / bare plain "
              "| saving err. vs bare plain (first / rem.) | vs batchspec off (first / rem.) | same-kind shards' apart ratios |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rs:
            errs = [tuple("-" if (x := saving_error(r[key], ref)) is None else f"{x:+.1%}"
                          for ref in ("side_by_side_saving_s", "vs_batchspec_off_s")) for key in (first, again)]
            off = r[f"batchspec_off{engines}"]["generate_s"] / r["bare_plain"]["generate_s"]
            print(f"| {name} {r['repeat']} | {''.join(LETTERS.get(b.split('+')[0], '?') for b in r.get('ran', []))} "
                  f"| {r[first]['vs_best_static']:.2f}x | {r[again]['vs_best_static']:.2f}x | {off:.2f}x "
                  f"| {errs[0][0]} / {errs[1][0]} | {errs[0][1]} / {errs[1][1]} | {'; '.join(within_kind_spread(r, domains))} |")
        for label, key, goal in (("first", first, 1.06), ("remembered", again, 1.03)):
            xs = [r[key]["vs_best_static"] for _, r in rs]
            print(f"\n{label}: within {goal}x in {sum(x <= goal for x in xs)} of {len(xs)}; median {statistics.median(xs):.3f}x")
        for key in (first, again):
            errs = [x for _, r in rs if (x := saving_error(r[key], "side_by_side_saving_s")) is not None]
            if errs:
                print(f"{key} saving error of generation: within 5% in {sum(abs(e) <= 0.05 for e in errs)} of {len(errs)}, "
                      f"mean {statistics.fmean(errs):+.1%}" + (f", sd {statistics.stdev(errs):.1%}" if len(errs) > 1 else ""))
        refs = [kind_ratios(r, domains) for _, r in rs]
        names = sorted({ref for x in refs for ref in x})
        print("\n| kind | reference: each repetition (pooled) | predicted first | predicted remembered "
              "| pooled error (first / rem.) | speculated shards (first / rem.) |")
        print("|---|---|---|---|---|---|")
        for kind in kinds:
            cells, pooled = [], {}
            for ref in names:
                xs = [x[ref][kind] for x in refs if ref in x and kind in x[ref]]
                if xs:
                    pooled[ref] = gmean(xs)
                    cells.append(f"{ref} {' '.join(f'{v:.2f}' for v in xs)} ({pooled[ref]:.2f})")
            preds = {}
            for key in (first, again):
                xs = [p for _, r in rs if (p := mean_predicted(r[key], shards_of(domains, kind))) is not None]
                preds[key] = (xs, gmean(xs) if xs else None)
            errors = ", ".join(f"{ref} {preds[first][1] / v - 1:+.0%} / {preds[again][1] / v - 1:+.0%}"
                               for ref, v in pooled.items() if preds[first][1] and preds[again][1])
            spec = " ".join("/".join(str(sum(r[key]["speculated"].get(n, False) for n in shards_of(domains, kind)))
                                     for key in (first, again)) for _, r in rs)
            pc = [f"{' '.join(f'{p:.2f}' for p in xs)} ({g:.2f})" if g else "-" for xs, g in preds.values()]
            print(f"| {kind} | {'; '.join(cells)} | {pc[0]} | {pc[1]} | {errors} | {spec} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="bench_nightly.py --out files")
    ap.add_argument("--engines", default="two", choices=["one", "two"], help="which batchspec runs to read (as run)")
    args = ap.parse_args()
    pool(args.files, "" if args.engines == "one" else "+plain")


if __name__ == "__main__":
    main()
