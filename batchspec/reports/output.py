"""`batchspec report`: what a run cost, whether speculation paid, where the time went.

Reads only committed shards (manifest status done, part present), local or s3://, with polars.
Every figure is derived from the raw counters in the parts and manifests; the speculation rates
use the one definition in rates.py:

    acceptance_rate       = rates.acceptance_rate(sum(accepted_tokens), sum(draft_tokens)), rows with speculation on
    mean_acceptance_len   = rates.mean_acceptance_length(sum(accepted_tokens), sum(spec_rounds))  (counts the bonus token)
    actor_seconds         = sum of committed shards' total time on their actor
    cost_usd              = actor_seconds / 3600 * gpu_hour_usd
    startup_actor_seconds = sum of the engine loads every run paid (job.json runs[].startup.actors[].load_s),
                            a restarted actor's again; not in cost_usd, which is the shards' own time
    startup_cost_usd      = startup_actor_seconds / 3600 * gpu_hour_usd
    usd_per_million_tokens = cost_usd / completion_tokens * 1e6
    measured_saving_s     = sum of the shard manifests' "saving" (vllm: measured in the run, the shard's
                            rows priced plain against the time they took, or its speculating rows'
                            steps priced with the run's step lines: policy/measured.py), with
                            saving_interval_s the sum of their 95% bounds (their errors share one
                            step line, so the bounds add); over measured_rows; None when no shard has one
    estimated_saving_s    = for the other shards' speculating rows (hf): accepted - draft_tokens * c -
                            spec_rounds * (v(k) - 1) target steps per row, with c and v(k) the actor's
                            measured costs (manifest "costs"), converted to seconds with the measured
                            step time and the row's batch size; over the rows whose shard kept costs
                            (saving_rows), None when no speculating row's did.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from ..policy import Costs
from ..rates import acceptance_rate, mean_acceptance_length
from ..runner.store import OutputStore


def _quantiles(series: pl.Series, qs=(0.5, 0.95, 0.99)) -> dict[str, float | None]:
    s = series.drop_nulls()
    return {f"p{int(q * 100)}": (float(s.quantile(q, interpolation="linear")) if s.len() else None) for q in qs}


# The columns the report reads: a part's completions, ids and hashes are never loaded.
COLUMNS = ("finish_reason", "prompt_tokens", "completion_tokens", "spec_enabled", "num_speculative_tokens",
           "draft_tokens", "accepted_tokens", "spec_rounds", "acceptance_rate", "ttft_s", "latency_s", "batch_size")


def load(output: str, storage_options: dict | None = None) -> tuple[OutputStore, dict, dict[str, dict], dict[str, dict]]:
    """(store, job.json, committed manifests, failed-or-pending manifests): the manifests alone,
    with every part looked up in one listing."""
    store = OutputStore(output, storage_options)
    job = store.read_job()
    if job is None:
        raise FileNotFoundError(f"no batchspec job at {output} (missing _batchspec/job.json)")
    manifests = store.manifests()
    done = store.committed_manifests(manifests)
    return store, job, done, {s: m for s, m in manifests.items() if s not in done}


@dataclass
class _Scan:
    """What one pass over the committed parts gathers: one row of sums per shard, and the per-row
    values whose quantiles and histograms the report draws (ok rows' ttft and latency; speculating
    rows' acceptance). Each part is read alone, its needed columns only, so memory holds the
    sums and three float columns, not the table."""
    shards: pl.DataFrame
    ttft: pl.Series
    latency: pl.Series
    acceptance: pl.Series


def _scan(store: OutputStore, manifests: dict[str, dict]) -> _Scan:
    ok = pl.col("finish_reason") != "error"
    spec = ok & pl.col("spec_enabled")
    sums = [pl.len().alias("rows"), ok.sum().alias("ok_rows"), spec.sum().alias("spec_rows"),
            *(pl.col(c).sum().alias(c) for c in ("completion_tokens", "prompt_tokens")),
            *(pl.col(c).filter(spec).sum().alias(c) for c in ("accepted_tokens", "draft_tokens", "spec_rounds")),
            pl.col("latency_s").filter(spec).sum().alias("spec_latency_s"),
            pl.col("completion_tokens").filter(spec).sum().alias("spec_completion_tokens"),
            pl.col("latency_s").filter(ok & ~pl.col("spec_enabled")).sum().alias("plain_latency_s"),
            pl.col("completion_tokens").filter(ok & ~pl.col("spec_enabled")).sum().alias("plain_completion_tokens")]

    def one(shard: str) -> tuple[pl.DataFrame, pl.DataFrame, pl.Series]:
        m = manifests[shard]
        part = pl.from_arrow(store.read_part(shard, m, columns=COLUMNS))
        assert isinstance(part, pl.DataFrame)
        row = part.select(sums).with_columns(shard=pl.lit(shard), **_estimate(part.filter(spec), m))
        return row, part.filter(ok).select("ttft_s", "latency_s"), \
            part.filter(spec & (pl.col("draft_tokens") > 0))["acceptance_rate"]

    # A few parts at a time: on S3 each read is mostly waiting, and pyarrow decodes outside the GIL.
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(one, sorted(manifests)))
    if not got:
        empty = pl.Series([], dtype=pl.Float64)
        return _Scan(pl.DataFrame(), empty, empty, empty)
    rows = pl.concat([g[1] for g in got], rechunk=False)
    return _Scan(pl.concat([g[0] for g in got]), rows["ttft_s"], rows["latency_s"],
                 pl.concat([g[2] for g in got], rechunk=False))


def _estimate(spec: pl.DataFrame, manifest: dict) -> dict[str, pl.Expr]:
    """The hf estimate of one shard's saving (estimated_saving_s below) as two literal columns:
    its seconds, and the rows it is over. Only a shard whose manifest kept the actor's measured
    costs, and no measured saving, is estimated; its speculating rows with a batch size count."""
    costs = Costs.from_json(manifest["costs"]) if manifest.get("costs") and not manifest.get("saving") else None
    if costs is None or not spec.height:
        return {"estimated_s": pl.lit(0.0), "estimated_rows": pl.lit(0, pl.UInt32)}
    rows = spec.filter(pl.col("batch_size") > 0).with_columns(k=pl.col("num_speculative_tokens").fill_null(1))
    total = 0.0
    for (k,), group in rows.group_by("k"):  # v(k) per k the shard ran
        steps = (pl.col("accepted_tokens") - pl.col("draft_tokens") * costs.c
                 - pl.col("spec_rounds") * (costs.v(int(k)) - 1)) * costs.target_step_s / pl.col("batch_size")
        total += float(group.select(steps.sum()).item())  # a step serves batch_size rows at once
    return {"estimated_s": pl.lit(total), "estimated_rows": pl.lit(rows.height, pl.UInt32)}


def _saving(shards: pl.DataFrame, manifests: dict[str, dict], spec_rows: int) -> dict:
    """measured_saving_s (the manifests'), estimated_saving_s and saving_rows, the speculating rows
    the estimate is over. Only rows whose shard manifest has the actor's measured costs can be
    estimated: on vllm a call whose rows finished while it measured keeps none (docs/policy.md).
    0.0 when nothing speculated; None when rows speculated but none could be estimated: the
    saving is unknown then, not zero (a 600-row vllm shard at acceptance 0.88 read "estimated
    saving 0.0s vs plain")."""
    measured = [m["saving"] for m in manifests.values() if m.get("saving")]
    out = {"measured_saving_s": sum(x["seconds"] for x in measured) if measured else None,
           "saving_interval_s": [sum(x["low"] for x in measured), sum(x["high"] for x in measured)] if measured else None,
           "measured_rows": sum(x["rows"] for x in measured)}
    if not spec_rows:
        return {**out, "estimated_saving_s": 0.0, "saving_rows": 0}
    counted = int(shards["estimated_rows"].sum())
    estimated = spec_rows - out["measured_rows"]
    total = float(shards["estimated_s"].sum())
    return {**out, "estimated_saving_s": total if counted else (0.0 if estimated <= 0 else None), "saving_rows": counted}


def input_group(path: str, root: str) -> str:
    """The group of an input file: the hive keys (k=v folders) between the input root and the file
    (in/dt=2026-12-05/domain=legal/part-0.parquet under in/dt=2026-12-05 -> 'domain=legal'), the
    groups that stay the same night after night while shards change; 'all' where there are none."""
    rel = path[len(root.rstrip("/")):] if path.startswith(root.rstrip("/")) else path
    return "/".join(p for p in rel.strip("/").split("/")[:-1] if "=" in p) or "all"


def _groups(manifests: dict[str, dict], root: str) -> dict[str, dict[str, Any]]:
    """Rows and acceptance per input group, from the manifests' token sums."""
    sums: dict[str, dict[str, int]] = {}
    for m in manifests.values():
        g = sums.setdefault(input_group(str(m.get("path") or ""), root), {"rows": 0, "accepted": 0, "drafted": 0, "rounds": 0})
        t = m.get("tokens") or {}
        g["rows"] += m.get("rows_out") or 0
        g["accepted"] += t.get("accepted_tokens", 0)
        g["drafted"] += t.get("draft_tokens", 0)
        g["rounds"] += t.get("spec_rounds", 0)
    return {name: {"rows": g["rows"], "acceptance_rate": acceptance_rate(g["accepted"], g["drafted"]),
                   "mean_acceptance_length": mean_acceptance_length(g["accepted"], g["rounds"])}
            for name, g in sorted(sums.items())}


def build_report(output: str, storage_options: dict | None = None, gpu_hour_usd: float | None = None) -> dict[str, Any]:
    store, job, manifests, other = load(output, storage_options)
    scan = _scan(store, manifests)
    price = gpu_hour_usd if gpu_hour_usd is not None else job.get("spec", {}).get("cost", {}).get("gpu_hour_usd", 0.0)
    by_shard = {r["shard"]: r for r in scan.shards.iter_rows(named=True)} if scan.shards.height else {}

    def total(col: str) -> int:
        return int(scan.shards[col].sum()) if scan.shards.height else 0

    rows, ok_rows, spec_rows, completion = total("rows"), total("ok_rows"), total("spec_rows"), total("completion_tokens")
    actor_s = sum(m.get("timings", {}).get("total_s", 0.0) for m in manifests.values())
    wall_s = sum(r.get("wall_s", 0.0) for r in job.get("runs", []) if "wall_s" in r)
    cost = actor_s / 3600 * price
    loads = [a["load_s"] for r in job.get("runs", []) for a in (r.get("startup") or {}).get("actors", [])]
    accepted, drafted, rounds = total("accepted_tokens"), total("draft_tokens"), total("spec_rounds")
    shards = []
    for s, m in manifests.items():
        f = by_shard[s]
        toks = f["completion_tokens"]
        shard_s = m.get("timings", {}).get("total_s", 0.0)
        shards.append({
            "shard": s, "rows": f["rows"], "error_rows": f["rows"] - f["ok_rows"], "completion_tokens": toks,
            "seconds": shard_s, "tokens_per_s": toks / shard_s if shard_s else None, "cost_usd": shard_s / 3600 * price,
            "spec_rows": f["spec_rows"], "plain_rows": f["ok_rows"] - f["spec_rows"],
            "acceptance_rate": acceptance_rate(f["accepted_tokens"], f["draft_tokens"]),
            "decisions": [d["reason"] for d in m.get("decisions", [])],
            "decision_rows": [d.get("at_row", 0) for d in m.get("decisions", [])], "attempts": m.get("attempts"),
            "earlier_errors": m.get("earlier_errors") or [],
        })
    # Slowest first among shards that generated; one that generated nothing (no rows, or only
    # error rows) is not slow, and goes last: an empty shard used to head the table at 0 tok/s.
    shards.sort(key=lambda r: (not r["completion_tokens"], r["tokens_per_s"] or 0.0))
    return {
        "name": job.get("name"), "output": output, "gpu_hour_usd": price,
        "shards_committed": len(manifests), "shards_not_committed": sorted(other),
        "rows": rows, "error_rows": rows - ok_rows,
        "prompt_tokens": total("prompt_tokens"), "completion_tokens": completion,
        "wall_s": wall_s, "actor_seconds": actor_s,
        "tokens_per_s": completion / wall_s if wall_s else None,
        "tokens_per_actor_s": completion / actor_s if actor_s else None,
        "cost_usd": cost, "usd_per_million_tokens": cost / completion * 1e6 if completion else None,
        "startup_loads": len(loads), "startup_actor_seconds": sum(loads), "startup_cost_usd": sum(loads) / 3600 * price,
        "spec_rows": spec_rows, "plain_rows": ok_rows - spec_rows,
        "spec_shards": sum(1 for r in shards if r["spec_rows"]), "plain_shards": sum(1 for r in shards if r["plain_rows"]),
        "acceptance_rate": acceptance_rate(accepted, drafted),
        "acceptance_rate_quantiles": _quantiles(scan.acceptance, (0.1, 0.5, 0.9)),
        "mean_acceptance_length": mean_acceptance_length(accepted, rounds),
        **_saving(scan.shards, manifests, spec_rows),
        "ttft_s": _quantiles(scan.ttft) if ok_rows else {}, "latency_s": _quantiles(scan.latency) if ok_rows else {},
        "shards": shards, "rerun_shards": _reruns(shards),
        "draft": next((r["draft"] for r in reversed(job.get("runs") or []) if r.get("draft")), None),
        "groups": _groups(manifests, ((job.get("spec") or {}).get("input") or {}).get("path") or ""),
        "_acceptance_values": scan.acceptance, "_latency_values": scan.latency,
        "_spec_tokens_per_s": _rate(total("spec_completion_tokens"), scan.shards, "spec_latency_s", spec_rows),
        "_plain_tokens_per_s": _rate(total("plain_completion_tokens"), scan.shards, "plain_latency_s", ok_rows - spec_rows),
    }


def _reruns(shards: list[dict]) -> list[dict]:
    """Shards committed after failing before, with why they failed (oldest first), for the report's
    "failed before" line: a rerun must not erase the cause of a night's failure."""
    return [{"shard": s["shard"], "attempts": s["attempts"], "causes": [e.get("error") for e in s["earlier_errors"]]}
            for s in shards if s["earlier_errors"]]


def _reruns_text(r: dict) -> str | None:
    if not r["rerun_shards"]:
        return None
    return "; ".join(f"{x['shard']} (attempt {x['attempts']}; before: {' / '.join(map(str, x['causes']))})"
                     for x in r["rerun_shards"][:5]) + (f"; and {len(r['rerun_shards']) - 5} more" if len(r["rerun_shards"]) > 5 else "")


NO_SAVING_COSTS = "no step costs were kept for the speculating shards"


def measured_saving_text(r: dict) -> str | None:
    """The measured saving with its interval, or "no measurable saving" where the interval spans
    zero; None when nothing was measured. A loss reads as a cost with its interval as costs
    ("speculation cost 0.47 s (95% interval 0.15 to 0.53 s)"), not as negative savings beside a
    positive cost."""
    if r.get("measured_saving_s") is None:
        return None
    low, high = r["saving_interval_s"]
    seconds = r["measured_saving_s"]

    def interval(lo: float, hi: float) -> str:
        return f"95% interval {_seconds(lo)} to {_seconds(hi)} s"

    if low <= 0 <= high:
        return f"no measurable saving ({_seconds(seconds)} s, {interval(low, high)})"
    if low > 0:
        return f"speculation saved {_seconds(seconds)} s ({interval(low, high)}), measured in the run"
    return f"speculation cost {_seconds(-seconds)} s ({interval(-high, -low)}), measured in the run"


def _seconds(seconds: float) -> str:
    """Seconds to one decimal from 1 s up, to two significant digits below: the wording above
    decides on the unrounded bounds, and a "saved" interval of 0.04 to 0.3 s written "0.0 to
    0.3 s" would read as one that spans zero; a cost of 0.467 s in 0.152 to 0.526 s written
    "0.5 s (0.2 to 0.5 s)" would sit on its own bound."""
    if seconds == 0:
        return "0.0"
    if abs(seconds) >= 1:
        return f"{seconds:.1f}"
    return f"{float(f'{seconds:.2g}'):.12f}".rstrip("0").rstrip(".")


def _saving_coverage(r: dict) -> str:
    """'' when the saving covers every speculating row, else over how many it does."""
    if r["saving_rows"] + r.get("measured_rows", 0) >= r["spec_rows"]:
        return ""
    return f"over {r['saving_rows']} of {r['spec_rows']} speculating rows; the others' shards kept no step costs"


def _no_saving(r: dict) -> tuple[str, str, str] | None:
    """Where a run has no saving to show: (the word, why, the HTML card's note). None otherwise."""
    if not r["completion_tokens"]:
        return "n/a", "nothing generated", "nothing generated"
    if not r["spec_rows"]:
        return "none", "no row speculated", "no row speculated: every shard ran plain"
    return None


def _saving_text(r: dict) -> str:
    if (none := _no_saving(r)) is not None:
        return f"{none[0]} ({none[1]})"
    measured = measured_saving_text(r)
    if measured is not None and r["measured_rows"] >= r["spec_rows"]:
        return measured
    if r["estimated_saving_s"] is None:
        return f"estimated saving unknown ({NO_SAVING_COSTS})"
    coverage = _saving_coverage(r)
    seconds = r["estimated_saving_s"]
    figure = f"saving {_seconds(seconds)} s" if seconds >= 0 else f"cost {_seconds(-seconds)} s"
    return f"estimated {figure} vs plain" + (f" ({coverage})" if coverage else "")


def _rate(tokens: int, shards: pl.DataFrame, latency_col: str, rows: int) -> float | None:
    """Per-row decode rate, completion tokens over latency, summed over rows (a throughput proxy)."""
    if not rows:
        return None
    lat = float(shards[latency_col].sum())
    return tokens / lat if lat else None


def public(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------
# Formats


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def draft_name(identity: dict | None) -> str | None:
    """A run's draft as its record names it: 'model drafts/12-05 (distilled from out/dt=2026-12-05)'.
    None for a run recorded before runs named their draft."""
    if not identity:
        return None
    name = f"{identity['kind']} {identity['path']}" if identity.get("path") else identity["kind"]
    distilled = identity.get("distilled")
    return f"{name} (distilled from {', '.join(distilled.get('outputs') or [])})" if distilled else name


def to_text(r: dict) -> str:
    q = r["acceptance_rate_quantiles"]
    lines = [
        f"{r['name']}: {r['shards_committed']} shard(s) committed"
        + (f", not committed (not counted): {', '.join(r['shards_not_committed'])}" if r["shards_not_committed"] else ""),
        f"saving: {_saving_text(r)}",  # first, as on the HTML page: measured (vllm) or estimated (hf)
        f"rows {r['rows']} ({r['error_rows']} error rows)  prompt tokens {r['prompt_tokens']}  completion tokens {r['completion_tokens']}",
        f"wall {r['wall_s']:.1f}s  actor-seconds {r['actor_seconds']:.1f}  {_fmt(r['tokens_per_s'], '.1f')} tok/s "
        f"({_fmt(r['tokens_per_actor_s'], '.1f')} per actor)",
        f"cost ${r['cost_usd']:.4f} at ${r['gpu_hour_usd']}/actor-hour  ${_fmt(r['usd_per_million_tokens'], '.2f')} per million tokens"
        + _startup_note(r, "; "),
        f"speculation: on for {r['spec_rows']} rows / {r['spec_shards']} shards, off for {r['plain_rows']} rows / "
        f"{r['plain_shards']} shards; acceptance {_fmt(r['acceptance_rate'], '.3f')} (p10 {_fmt(q['p10'])}, p50 "
        f"{_fmt(q['p50'])}, p90 {_fmt(q['p90'])}), mean acceptance length {_fmt(r['mean_acceptance_length'])}",
        f"ttft p50/p95/p99 {'/'.join(_fmt(r['ttft_s'].get(k), '.3f') for k in ('p50', 'p95', 'p99'))}s  "
        f"latency {'/'.join(_fmt(r['latency_s'].get(k), '.3f') for k in ('p50', 'p95', 'p99'))}s",
        *([f"draft: {draft_name(r['draft'])}, {r['draft'].get('fingerprint') or 'no fingerprint'}"] if r["draft"] else []),
        *([f"failed before, committed on a rerun: {_reruns_text(r)}"] if r["rerun_shards"] else []),
        "",
        f"{'shard':<24}{'rows':>6}{'errors':>7}{'tokens':>8}{'tok/s':>8}{'accept':>8}{'cost $':>10}  decisions",
    ]
    for s in r["shards"]:
        lines.append(f"{s['shard']:<24}{s['rows']:>6}{s['error_rows']:>7}{s['completion_tokens']:>8}"
                     f"{_fmt(s['tokens_per_s'], '.1f'):>8}{_fmt(s['acceptance_rate'], '.3f'):>8}{s['cost_usd']:>10.5f}  "
                     f"{' -> '.join(s['decisions']) or '-'}")
    return "\n".join(lines)


SHARD_COLUMNS = ("shard", "rows", "error_rows", "completion_tokens", "seconds", "tokens_per_s", "cost_usd", "spec_rows",
                 "acceptance_rate", "attempts", "decisions")


def to_csv(r: dict) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(SHARD_COLUMNS)
    for s in r["shards"]:
        w.writerow([" | ".join(s[c]) if c == "decisions" else s[c] for c in SHARD_COLUMNS])
    w.writerow(["TOTAL", r["rows"], r["error_rows"], r["completion_tokens"], r["actor_seconds"], r["tokens_per_actor_s"],
                r["cost_usd"], r["spec_rows"], r["acceptance_rate"], "", ""])
    return buf.getvalue()


def _bars(title: str, labels: list[str], values: list[float], unit: str = "") -> str:
    """A horizontal bar chart as inline SVG (no scripts, no external resources)."""
    if not values:
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    top = max(values) or 1.0
    h = 22 * len(values) + 10
    bars = []
    for i, (label, v) in enumerate(zip(labels, values)):
        width = 360 * v / top
        bars.append(f'<text x="0" y="{22 * i + 16}" font-size="12">{html.escape(label)}</text>'
                    f'<rect x="170" y="{22 * i + 4}" width="{width:.1f}" height="16" fill="#4a7bd0"/>'
                    f'<text x="{175 + width:.1f}" y="{22 * i + 16}" font-size="12">{_figure(v)}{unit}</text>')
    return f'<h3>{html.escape(title)}</h3><svg width="620" height="{h}" role="img">{"".join(bars)}</svg>'


def _figure(v: float) -> str:
    """A bar's figure as a reader takes it in: 4,919 tokens/s, 23 rows, 0.245 s (not 4.92e+03)."""
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


def _histogram(title: str, values: pl.Series, bins: int = 10, lo: float | None = None, hi: float | None = None) -> str:
    """Counts in `bins` equal bins from lo to hi (the values' range by default); the top bin holds hi."""
    v = values.drop_nulls().to_numpy()
    if not len(v):
        return f"<h3>{html.escape(title)}</h3><p>no data</p>"
    lo = float(v.min()) if lo is None else lo
    hi = float(v.max()) if hi is None else hi
    width = (hi - lo) / bins or 1.0
    counts = np.bincount(np.clip(((v - lo) / width).astype(np.int64), 0, bins - 1), minlength=bins)
    places = min(max(2, 1 - math.floor(math.log10(width))), 8)  # enough that no two bin edges read alike
    labels = [f"{lo + i * width:.{places}f} – {lo + (i + 1) * width:.{places}f}" for i in range(bins)]
    return _bars(title, labels, [float(c) for c in counts], " rows")


ACCEPTANCE_NOTE = ("Acceptance = accepted / proposed draft tokens (share of the draft the target kept). The "
                   "policy's decisions quote per-token acceptance (alpha) = accepted / (accepted + rejections): a "
                   "round stops at its first rejected token, so the tokens after it are never tried; alpha is "
                   "therefore higher whenever k exceeds the runs the draft gets right.")


def _startup_note(r: dict, sep: str) -> str:
    """What the engines' loads cost on top of the shards, when the runs recorded any."""
    if not r.get("startup_loads"):
        return ""
    return (f"{sep}start-up ${r['startup_cost_usd']:.4f} more ({r['startup_loads']} engine load(s), "
            f"{r['startup_actor_seconds']:.1f} actor-seconds)")


def _card(label: str, value: str, note: str) -> str:
    return (f"<div class='card'><div class='label'>{html.escape(label)}</div><div class='value'>{html.escape(value)}</div>"
            f"<div class='note'>{html.escape(note)}</div></div>")


def _headline(r: dict) -> str:
    actor_s = r["actor_seconds"]
    measured = measured_saving_text(r)
    saving = r["measured_saving_s"] if measured is not None else r["estimated_saving_s"]
    share = ""
    if saving and actor_s + saving > 0:
        pct = saving / (actor_s + saving) * 100
        share = f"{pct:.0f}% of the plain-decoding time" if pct > 0 else f"{-pct:.0f}% more time than plain decoding"
    if measured is not None:
        saving_note = "; ".join(x for x in (measured, share, "against plain decoding of the same rows, priced with "
                                            "the run's own step measurements (docs/policy.md)") if x)
    elif saving is None:
        saving_note = f"{NO_SAVING_COSTS}, so there is nothing to estimate it from"
    else:
        saving_note = "; ".join(x for x in (share, "estimated vs plain decoding of the same rows, from each actor's "
                                            "measured draft and verify costs and the rows' accepted and proposed "
                                            "tokens", _saving_coverage(r)) if x)
    none = _no_saving(r)
    value, note = (none[0], none[2]) if none else ("unknown" if saving is None else f"{_seconds(saving)} s", saving_note)
    q = r["acceptance_rate_quantiles"]
    return "<div class='cards'>" + "".join([
        _card("Saving from speculation", value, note),
        _card("Cost", f"${r['cost_usd']:.4f}", f"{actor_s / 3600:.4f} actor-hours at ${r['gpu_hour_usd']}/actor-hour"
              + _startup_note(r, "; ")),
        _card("Per million tokens", f"${_fmt(r['usd_per_million_tokens'], '.2f')}",
              f"{r['completion_tokens']} completion tokens, {r['rows']} rows"),
        _card("Acceptance", _fmt(r["acceptance_rate"], ".3f"),
              f"accepted / proposed draft tokens over {r['spec_rows']} speculating rows; per row p10 {_fmt(q['p10'])}, "
              f"p50 {_fmt(q['p50'])}, p90 {_fmt(q['p90'])}; {_fmt(r['mean_acceptance_length'])} tokens per target pass"),
    ]) + "</div>"


def _facts(r: dict) -> str:
    items = [
        ("Shards", f"{r['shards_committed']} committed" + (f"; not committed (not counted): "
                                                           f"{', '.join(r['shards_not_committed'])}" if r["shards_not_committed"] else "")),
        ("Rows", f"{r['rows']} ({r['error_rows']} error rows); prompt tokens {r['prompt_tokens']}, completion tokens "
                 f"{r['completion_tokens']}"),
        ("Time", f"wall {r['wall_s']:.1f} s, actor-seconds {r['actor_seconds']:.1f}; {_fmt(r['tokens_per_s'], '.1f')} tok/s "
                 f"({_fmt(r['tokens_per_actor_s'], '.1f')} per actor)"),
        ("Speculation", f"on for {r['spec_rows']} rows in {r['spec_shards']} shard(s), off for {r['plain_rows']} rows in "
                        f"{r['plain_shards']} shard(s)"),
        ("Latency", f"time to first token p50/p95/p99 "
                    f"{'/'.join(_fmt(r['ttft_s'].get(k), '.3f') for k in ('p50', 'p95', 'p99'))} s; row latency "
                    f"{'/'.join(_fmt(r['latency_s'].get(k), '.3f') for k in ('p50', 'p95', 'p99'))} s"),
        *([("Failed before", f"committed on a rerun: {_reruns_text(r)}")] if r["rerun_shards"] else []),
    ]
    return "<dl>" + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in items) + "</dl>"


def _decision_list(s: dict) -> str:
    if not s["decisions"]:
        return "-"
    items = "".join(f"<li><span class='at'>from row {at}:</span> {html.escape(reason)}</li>"
                    for at, reason in zip(s["decision_rows"] or [0] * len(s["decisions"]), s["decisions"]))
    return f"<ol>{items}</ol>"


def to_html(r: dict) -> str:
    """One self-contained page: headline figures, the run's facts, every shard with every policy
    decision, charts. No scripts or external resources; wraps at any width (docs/reports.md)."""
    rows = "".join(
        "<tr>" + "".join(f"<td class='num'>{html.escape(str(v))}</td>" if i else f"<td>{html.escape(str(v))}</td>"
                         for i, v in enumerate((
                             s["shard"], s["rows"], s["error_rows"], f"{s['spec_rows']} / {s['rows'] - s['error_rows']}",
                             s["completion_tokens"], _fmt(s["tokens_per_s"], ".1f"), _fmt(s["acceptance_rate"], ".3f"),
                             f"{s['cost_usd']:.5f}")))
        + f"<td class='decisions'>{_decision_list(s)}</td></tr>"
        for s in r["shards"])
    charts = [
        _histogram("Acceptance per row (accepted / proposed, speculating rows)", r["_acceptance_values"], lo=0.0, hi=1.0),
        _bars("Throughput per shard (tokens/s)", [s["shard"] for s in r["shards"]],
              [s["tokens_per_s"] or 0.0 for s in r["shards"]]),
        _histogram("Row latency (s)", r["_latency_values"]),
        _bars("Decode rate per row, speculation on vs off (tokens/s)",
              [f"on ({r['spec_rows']} rows)", f"off ({r['plain_rows']} rows)"],
              [r["_spec_tokens_per_s"] or 0.0, r["_plain_tokens_per_s"] or 0.0]),
    ]
    style = ("body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}"
             "h1{font-size:1.5em}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:1em 0}"
             ".card{flex:1 1 220px;border:1px solid #d0d7e2;border-radius:6px;padding:10px 14px;background:#f7f9fc}"
             ".label{font-size:.85em;color:#555}.value{font-size:1.6em;font-weight:600;margin:2px 0}"
             ".note{font-size:.8em;color:#555;overflow-wrap:anywhere}"
             "dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px}dt{font-weight:600}"
             "dd{margin:0;overflow-wrap:anywhere}.tablewrap{overflow-x:auto}"
             "table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;"
             "vertical-align:top}th{background:#eef2f8;text-align:left}td:first-child{white-space:nowrap}td.num{text-align:right;white-space:nowrap}"
             "td.decisions{overflow-wrap:anywhere}td.decisions ol{margin:0;padding-left:1.2em}.at{color:#666}"
             "p.defs{font-size:.85em;color:#444;max-width:70em}svg{max-width:100%;height:auto}")
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'><title>batchspec report: "
            f"{html.escape(str(r['name']))}</title><style>{style}</style></head><body>"
            f"<h1>batchspec report: {html.escape(str(r['name']))}</h1>{_headline(r)}{_facts(r)}"
            f"<p class='defs'>{html.escape(ACCEPTANCE_NOTE)}</p>"
            "<h2>Shards (slowest first)</h2><div class='tablewrap'><table><tr><th>shard</th><th>rows</th><th>errors</th>"
            "<th>speculating rows</th><th>tokens</th><th>tok/s</th><th>acceptance</th><th>cost $</th>"
            f"<th>policy decisions</th></tr>{rows}</table></div>"
            f"<h2>Charts</h2>{''.join(charts)}</body></html>")


COMPARED = ("rows", "completion_tokens", "tokens_per_s", "tokens_per_actor_s", "actor_seconds", "cost_usd",
            "usd_per_million_tokens", "startup_actor_seconds", "startup_cost_usd", "acceptance_rate",
            "mean_acceptance_length", "spec_rows")


def compare(a: dict, b: dict) -> dict:
    """Two runs side by side; ratio = b / a."""
    out = {}
    for key in COMPARED:
        va, vb = a.get(key), b.get(key)
        out[key] = {"a": va, "b": vb, "ratio": (vb / va) if isinstance(va, (int, float)) and va and vb is not None else None}
    groups = {g: {"a": a.get("groups", {}).get(g), "b": b.get("groups", {}).get(g)}
              for g in sorted({*a.get("groups", {}), *b.get("groups", {})})}
    return {"a": a["output"], "b": b["output"], "figures": out, "groups": groups,
            "draft": {"a": draft_name(a.get("draft")), "b": draft_name(b.get("draft"))},
            "saving": {"a": _saving_text(a), "b": _saving_text(b)}, "side_by_side": side_by_side(a, b)}


def side_by_side(a: dict, b: dict) -> dict | None:
    """Where one run speculated and the other generated the same rows and tokens without (the same
    job with --set speculation.mode=off into another output): the plain run's actor-seconds less
    the speculating run's, which is what the speculating run's own saving figure claims. One pair
    of runs: on a shared machine that difference moves by several percent of either run
    (docs/benchmarks.md). None for any other pair (both or neither speculated, other rows, or
    other completions, as sampling gives)."""
    spec, plain = (a, b) if a["spec_rows"] else (b, a)
    if not spec["spec_rows"] or plain["spec_rows"] or not plain["completion_tokens"] or \
            (a["rows"], a["completion_tokens"]) != (b["rows"], b["completion_tokens"]):
        return None
    return {"speculating": "A" if spec is a else "B", "plain": "A" if plain is a else "B",
            "plain_minus_speculating_actor_s": plain["actor_seconds"] - spec["actor_seconds"],
            "speculating_run_says": _saving_text(spec)}


def compare_text(c: dict) -> str:
    lines = [f"A = {c['a']}\nB = {c['b']}", f"{'figure':<26}{'A':>14}{'B':>14}{'B/A':>8}"]
    for key, v in c["figures"].items():
        lines.append(f"{key:<26}{_fmt(v['a'], '.4g'):>14}{_fmt(v['b'], '.4g'):>14}{_fmt(v['ratio'], '.3f'):>8}")
    if len(c["groups"]) > 1:
        lines += ["", f"{'acceptance by group':<26}{'A':>14}{'B':>14}{'B-A':>8}"]
        for g, v in c["groups"].items():
            in_a, in_b = ((x or {}).get("acceptance_rate") for x in (v["a"], v["b"]))
            diff = in_b - in_a if in_a is not None and in_b is not None else None
            lines.append(f"{g:<26}{_fmt(in_a, '.3f'):>14}{_fmt(in_b, '.3f'):>14}{_fmt(diff, '+.3f'):>8}")
    lines += ["", f"draft in A: {c['draft']['a'] or '-'}", f"draft in B: {c['draft']['b'] or '-'}"]
    lines += ["", f"saving in A: {c['saving']['a']}", f"saving in B: {c['saving']['b']}"]
    if (pair := c.get("side_by_side")) is not None:
        diff = pair["plain_minus_speculating_actor_s"]
        rows = c["figures"]["rows"]["a"]
        lines.append(f"side by side: {pair['plain']} (plain) took {_seconds(abs(diff))} s {'more' if diff >= 0 else 'less'} "
                     f"actor time than {pair['speculating']} (speculating) on the same {rows} rows; "
                     f"{pair['speculating']} says: {pair['speculating_run_says']} (one pair of runs: on a shared "
                     "machine their difference moves by several percent of either)")
    return "\n".join(lines)


def render(report: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(public(report), indent=2, default=str)
    if fmt == "csv":
        return to_csv(report)
    if fmt == "html":
        return to_html(report)
    return to_text(report)
