"""A draft distilled from one night's output against the demo draft on the next night's fresh rows,
on a domain the demo draft was not trained on (issue 59's goals).

    python scripts/bench_distill.py --out bench-distill.json              # night 1: 1,000 lower + 200 legal rows
    python scripts/bench_distill.py --night1 200,40 --night2 40,20 --repeats 1   # a smoke run
    python scripts/bench_distill.py --target small --kinds model,eagle3 --repeats 0   # eagle3 beside model, acceptance only

Target: the demo target's cost stand-in (build/demo-models/legal-target-40m, docs/demo.md; or
with --target small the demo target itself, whose outputs are the same, so the same acceptance,
at a fraction of the cost of the eagle3 kind's feature passes), on
vLLM (CPU, the job's 2 threads), the demo job's settings otherwise (draft `model`, k = 4, greedy,
stop at a newline, max_new_tokens 64). The data is bench_nightly.py's: the demo's synthetic
contracts as they are (`domain=legal/`, the draft's own domain) and lower-cased without digits
(`domain=lower/`, where the demo draft's acceptance is ~0.2), fresh contracts each night.

    1. night 1     `batchspec submit` (auto, max_num_seqs --concurrency1) over night 1's rows
    2. distill     `batchspec distill` night 1's output (its own gate: night 1's held-out rows),
                   once per --kinds: `model` from the demo draft, `eagle3` new (outputs alone)
    3. acceptance  night 2's rows generated plain (`mode: off`), then every one of them measured
                   with speculation at k = 4 on vLLM under each draft (batchspec.training.check),
                   the demo draft and each distilled one:
                   per-token acceptance and mean acceptance length per domain
    4. time        night 2 through `batchspec submit` (auto, max_num_seqs --concurrency2) with the
                   demo draft and with the distilled `model` one, --repeats times, interleaved: generation
                   seconds (the shards' generate_s) and the share of each domain's rows speculated

Goals (issue 59): lower's per-token acceptance +0.25 and mean acceptance length +1.0; legal's
per-token acceptance down no more than 0.01; generation time down >= 15% where lower ran plain.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_nightly import DOMAINS, STAND_IN, write_job  # noqa: E402
from bench_vllm import batchspec  # noqa: E402


def write_night(data: Path, sizes: dict[str, int], offset: int) -> None:
    """domain=<name>/part-0.parquet per domain, contracts from seed offset on (fresh each night)."""
    from batchspec.demo.corpus import examples

    rng = random.Random(offset)
    for domain, rows in sizes.items():
        folder = data / f"domain={domain}"
        folder.mkdir(parents=True, exist_ok=True)
        texts = [DOMAINS[domain](e["contract"], rng) for e in examples("demo", rows, offset=offset)]
        offset += rows
        ids = [f"{domain}-{offset}-{i:05d}" for i in range(rows)]
        pq.write_table(pa.table({"doc_id": ids, "contract": texts}), folder / "part-0.parquet")


def by_domain(out: Path) -> dict[str, list[int]]:
    """{domain: [rows speculated, rows]} of an output."""
    from batchspec.runner.store import OutputStore

    store = OutputStore(str(out))
    got: dict[str, list[int]] = {}
    for s, m in store.manifests().items():
        domain = Path(m["path"]).parent.name.split("=", 1)[1]
        spec = store.read_part(s).column("spec_enabled").to_pylist()
        got.setdefault(domain, [0, 0])
        got[domain][0] += sum(spec)
        got[domain][1] += len(spec)
    return got


def acceptance(job: Path, plain_out: Path, drafts: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """Each draft's figures per domain on every row of the plain night (training.check.measure)."""
    from transformers import AutoTokenizer

    from batchspec.spec import load_spec
    from batchspec.training.check import measure
    from batchspec.training.rows import committed_rows

    spec = load_spec(job)
    _, rows, _ = committed_rows(str(plain_out), AutoTokenizer.from_pretrained(spec.model.target))
    return {name: measure(spec, "vllm", kind, path, rows) for name, (kind, path) in drafts.items()}


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    n1, n2 = (dict(zip(("lower", "legal"), map(int, s.split(",")))) for s in (args.night1, args.night2))
    write_night(tmp / "night1", n1, 70_000)
    write_night(tmp / "night2", n2, 90_000)
    target = STAND_IN if args.target == "standin" else ROOT / "models/legal-target"
    job1 = write_job(tmp, tmp / "night1", args.concurrency1, target)
    demo_draft = str(ROOT / "models/legal-draft")
    result: dict = {"target": str(target), "night1_rows": n1, "night2_rows": n2, "concurrency1": args.concurrency1,
                    "concurrency2": args.concurrency2, "dir": str(tmp), "distill": {}, "distill_wall_s": {}}
    result["night1"] = {k: v for k, v in batchspec(job1, "vllm", tmp / "out1", memory=tmp / "memory").items() if k != "by_id"}
    result["night1"]["speculated"] = by_domain(tmp / "out1")
    drafts = {"demo": ("model", demo_draft)}
    for kind in args.kinds.split(","):
        t = time.perf_counter()
        proc = subprocess.run([str(Path(sys.executable).parent / "batchspec"), "distill", str(tmp / "out1"),
                               "--out", str(tmp / f"draft-{kind}"), "--kind", kind, "--json"], capture_output=True, text=True)
        result["distill_wall_s"][kind] = time.perf_counter() - t
        if proc.returncode not in (0, 1):
            raise RuntimeError(proc.stderr[-3000:])
        result["distill"][kind] = json.loads(proc.stdout)
        drafts[kind] = (kind, str(tmp / f"draft-{kind}"))
    (tmp / "night2-jobs").mkdir()
    job2 = write_job(tmp / "night2-jobs", tmp / "night2", args.concurrency2, target)
    batchspec(job2, "vllm", tmp / "plain2", "speculation.mode=off", memory=tmp / "memory")
    result["acceptance"] = acceptance(job2, tmp / "plain2", drafts)
    timed = {"demo": demo_draft, "model": str(tmp / "draft-model")} if "model" in drafts else {}
    runs: dict[str, list[dict]] = {name: [] for name in timed}
    for rep in range(args.repeats if timed else 0):
        for name in (list(timed) if rep % 2 == 0 else list(reversed(timed))):
            out = tmp / f"night2-{name}-{rep}"
            r = batchspec(job2, "vllm", out, f"model.draft.path={timed[name]}", memory=tmp / "memory")
            runs[name].append({"generate_s": r["generate_s"], "wall_s": r["wall_s"], "speculated": by_domain(out),
                               "decisions": r["decisions"]})
    result["night2"] = runs
    return result


def summary(r: dict) -> list[str]:
    lines = [f"target {r['target']}; night 1: {r['night1_rows']} rows at max_num_seqs {r['concurrency1']}, "
             f"generation {r['night1']['generate_s']:.1f} s"]
    for kind, d in r["distill"].items():
        lines.append(f"distill {kind}: {r['distill_wall_s'][kind]:.0f} s, trained on {d['rows']['trained']} rows, "
                     + ("passed" if d["passed"] else "NOT passed: " + "; ".join(d["reasons"])))
    a = r["acceptance"]
    lines.append("night 2 acceptance on every row, vLLM k=4 (demo draft -> distilled):")
    for g in a["demo"]["groups"]:
        b = a["demo"]["groups"][g]
        for kind in r["distill"]:
            n = a[kind]["groups"][g]
            lines.append(f"  {g:<14} {kind:<7} per-token {b['per_token_acceptance']:.3f} -> {n['per_token_acceptance']:.3f} "
                         f"({n['per_token_acceptance'] - b['per_token_acceptance']:+.3f}), mean acceptance length "
                         f"{b['mean_acceptance_length']:.2f} -> {n['mean_acceptance_length']:.2f} "
                         f"({n['mean_acceptance_length'] - b['mean_acceptance_length']:+.2f}), {b['rows']} rows")
    if r["night2"] and all(r["night2"].values()):
        med = {name: statistics.median(x["generate_s"] for x in runs) for name, runs in r["night2"].items()}
        lines.append(f"night 2 at max_num_seqs {r['concurrency2']}, auto, generation median of {len(r['night2']['demo'])}: "
                     f"demo draft {med['demo']:.1f} s, distilled {med['model']:.1f} s ({med['model'] / med['demo'] - 1:+.1%}); "
                     "all: " + ", ".join(f"{n} {[round(x['generate_s'], 1) for x in runs]}" for n, runs in r["night2"].items()))
        for name, runs in r["night2"].items():
            lines.append(f"  rows speculated, {name}: " + "; ".join(
                ", ".join(f"{g} {s}/{t}" for g, (s, t) in sorted(x["speculated"].items())) for x in runs))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--night1", default="1000,200", help="rows of lower,legal in night 1 (default 1000,200)")
    ap.add_argument("--night2", default="200,100", help="rows of lower,legal in night 2 (default 200,100)")
    ap.add_argument("--concurrency1", type=int, default=64, help="max_num_seqs of night 1 (default 64)")
    ap.add_argument("--concurrency2", type=int, default=8, help="max_num_seqs of night 2's timed runs (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="timed night-2 runs per draft, interleaved")
    ap.add_argument("--target", choices=("standin", "small"), default="standin",
                    help="the demo target's cost stand-in (default) or the demo target itself")
    ap.add_argument("--kinds", default="model", help="draft kinds to distill, comma-separated (model, eagle3)")
    ap.add_argument("--out", default="bench-distill.json")
    args = ap.parse_args()
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print("\n".join(summary(result)))


if __name__ == "__main__":
    main()
