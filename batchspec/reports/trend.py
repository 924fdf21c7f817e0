"""`batchspec report ROOT`: night over night, from a folder of outputs (`out/dt=*/`) or a list of
them. One line per run (a night rerun after a failure or a SIGTERM has two), and each night's
totals: rows, error rows, failed and rerun shards, tokens, actor-seconds, cost, acceptance, the
measured saving with its interval, the draft used.

Read from job.json and the shard manifests alone (no part is opened), so 30 nights of 100 shards
is 3,000 small JSON reads (scripts/bench_report.py --trend). A shard's figures count for the run
that committed it (its manifest's job_id); a failure counts for the run it happened in, also
after a rerun committed the shard (the manifest's earlier_errors).

    rows, error_rows, completion_tokens, prompt_tokens: sums over committed manifests
    actor_seconds = sum of their timings.total_s;  cost_usd = actor_seconds / 3600 * gpu_hour_usd
    acceptance_rate = rates.acceptance_rate(sum accepted_tokens, sum draft_tokens)
    saving_s, saving_interval_s = sums of the manifests' measured saving and its 95% bounds
"""

from __future__ import annotations

import html
import io
import json
import posixpath
from typing import Any

from ..rates import acceptance_rate
from ..runner.store import OutputStore
from ..spec import JobSpec
from .output import draft_name, load

FIGURES = ("rows", "error_rows", "prompt_tokens", "completion_tokens", "accepted_tokens", "draft_tokens", "actor_seconds")


def find_outputs(root: str, storage_options: dict | None = None) -> list[str]:
    """The outputs under root (folders holding _batchspec/job.json), sorted by path: dated
    partitions `dt=YYYY-MM-DD` sort night after night. root itself when it is one."""
    store = OutputStore(root, storage_options)
    if store.read_job() is not None:
        return [root]
    found = store.fs.glob(posixpath.join(store.root, "**", "_batchspec", "job.json"))
    prefix = f"{root.split('://', 1)[0]}://" if "://" in root else ""
    return sorted(f"{prefix}{posixpath.dirname(posixpath.dirname(p))}" for p in found)


def partition(output: str, root: str | None) -> dict[str, str]:
    """The hive keys of an output's path below root: out/region=eu/dt=2026-12-05 -> {region, dt}."""
    rel = output[len(root):] if root and output.startswith(root) else output
    return dict(part.split("=", 1) for part in rel.strip("/").split("/") if "=" in part)


def groups(manifests: list[dict], night_keys: set[str]) -> dict[str, dict[str, Any]]:
    """Acceptance and rows per group of shards within a night: the hive keys of each shard's input
    path other than the night's own (in/dt=2026-12-05/domain=legal/part-0.parquet is in group
    "domain=legal"), the groups that stay the same from night to night while shard names and
    contents change. {} where the input has no such keys (the night is one group)."""
    out: dict[str, list[dict]] = {}
    for m in manifests:
        keys = [p for p in str(m.get("path") or "").split("/")[:-1] if "=" in p and p.split("=", 1)[0] not in night_keys]
        if keys:
            out.setdefault("/".join(keys), []).append(m)
    return {g: {"shards": len(ms), "rows": sum(m.get("rows_out") or 0 for m in ms),
                "acceptance_rate": acceptance_rate(sum((m.get("tokens") or {}).get("accepted_tokens", 0) for m in ms),
                                                   sum((m.get("tokens") or {}).get("draft_tokens", 0) for m in ms))}
            for g, ms in sorted(out.items())}


def _sums(manifests: list[dict], price: float) -> dict[str, Any]:
    tok = [m.get("tokens") or {} for m in manifests]
    out: dict[str, Any] = {
        "rows": sum(m.get("rows_out") or 0 for m in manifests), "error_rows": sum(m.get("error_rows") or 0 for m in manifests),
        **{k: sum(t.get(k, 0) for t in tok) for k in ("prompt_tokens", "completion_tokens", "accepted_tokens", "draft_tokens")},
        "actor_seconds": sum((m.get("timings") or {}).get("total_s", 0.0) for m in manifests)}
    saving = [m["saving"] for m in manifests if m.get("saving")]
    out["cost_usd"] = out["actor_seconds"] / 3600 * price
    out["usd_per_million_tokens"] = out["cost_usd"] / out["completion_tokens"] * 1e6 if out["completion_tokens"] else None
    out["acceptance_rate"] = acceptance_rate(out["accepted_tokens"], out["draft_tokens"])
    out["saving_s"] = sum(x["seconds"] for x in saving) if saving else None
    out["saving_interval_s"] = [sum(x["low"] for x in saving), sum(x["high"] for x in saving)] if saving else None
    return out


def night(output: str, storage_options: dict | None = None, gpu_hour_usd: float | None = None,
          root: str | None = None) -> dict[str, Any]:
    """One output's night: its totals and one entry per run in job.json, oldest first."""
    _, job, done, other = load(output, storage_options)
    manifests = {**done, **other}
    price = gpu_hour_usd if gpu_hour_usd is not None else (job.get("spec") or {}).get("cost", {}).get("gpu_hour_usd", 0.0)
    try:
        draft = JobSpec.model_validate(job.get("spec") or {}).draft_used()
    except ValueError:  # a spec of another version's keys
        draft = None
    runs = []
    for r in job.get("runs") or []:
        mine = [m for m in done.values() if m.get("job_id") == r.get("job_id")]
        failed = sorted({m["shard"] for m in manifests.values() if m.get("status") == "failed" and m.get("job_id") == r.get("job_id")}
                        | {m["shard"] for m in manifests.values()
                           for e in m.get("earlier_errors") or [] if e.get("job_id") == r.get("job_id")})
        loads = [a.get("load_s", 0.0) for a in (r.get("startup") or {}).get("actors", [])]
        runs.append({"job_id": r.get("job_id"), "status": r.get("status"), "started_at": r.get("started_at"),
                     "draft": draft_name(r.get("draft")) or draft, "draft_identity": r.get("draft"),
                     "wall_s": r.get("wall_s"), "startup_actor_seconds": sum(loads), "shards_committed": len(mine),
                     "failed_shards": failed, **_sums(mine, price)})
    reruns = sorted(s for s, m in done.items() if m.get("earlier_errors"))
    draft = runs[-1]["draft"] if runs else draft
    return {"output": output, "partition": partition(output, root), "name": job.get("name"), "draft": draft,
            "complete": len(done) == len(job.get("shards") or []), "shards": len(job.get("shards") or []),
            "shards_committed": len(done), "not_committed": sorted(set(job.get("shards") or []) - set(done)),
            "rerun_shards": reruns, "runs": runs, "wall_s": sum(r["wall_s"] or 0.0 for r in runs),
            "groups": groups(list(done.values()), set(partition(output, root))),
            "gpu_hour_usd": price, **_sums(list(done.values()), price)}


def build_trend(targets: list[str], storage_options: dict | None = None, gpu_hour_usd: float | None = None) -> dict[str, Any]:
    """The nights of every output found under the targets (each a root or an output), in order."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for t in targets:
        found = find_outputs(t, storage_options)
        if not found:  # a mistyped folder among several must not vanish from the report
            raise FileNotFoundError(f"no batchspec output at or under {t} (no _batchspec/job.json)")
        jobs += [(out, t) for out in found]
    with ThreadPoolExecutor(max_workers=8) as pool:  # on S3 each night's reads are mostly waiting
        nights = list(pool.map(lambda j: night(j[0], storage_options, gpu_hour_usd, j[1].rstrip("/")), jobs))
    return {"kind": "trend", "nights": nights, "runs": sum(len(n["runs"]) for n in nights)}


# -- rendering ------------------------------------------------------------------------------

def _f(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _saving(x: dict) -> str:
    if x["saving_s"] is None:
        return "-"
    lo, hi = x["saving_interval_s"]
    return f"{x['saving_s']:.1f}s ({lo:.1f}..{hi:.1f})"


def _label(n: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in n["partition"].items()) or n["output"]


HEADER = (f"{'night':<22}{'run':<10}{'status':<12}{'wall s':>8}{'rows':>7}{'errors':>7}{'failed':>7}{'rerun':>6}"
          f"{'tokens':>9}{'actor s':>9}{'cost $':>9}{'$/M tok':>9}{'accept':>8}  {'saving (95%)':<20}draft")


def _line(label: str, run: str, status: str, x: dict, failed: int, rerun: int | str, draft: str | None) -> str:
    return (f"{label[:21]:<22}{run[:9]:<10}{status[:11]:<12}{_f(x['wall_s'], '.1f'):>8}{x['rows']:>7}{x['error_rows']:>7}"
            f"{failed:>7}{rerun!s:>6}{x['completion_tokens']:>9}{x['actor_seconds']:>9.1f}{x['cost_usd']:>9.4f}"
            f"{_f(x['usd_per_million_tokens']):>9}{_f(x['acceptance_rate'], '.3f'):>8}  {_saving(x):<20}{draft or '-'}")


def to_text(t: dict) -> str:
    """One line per run, night after night; a night of several runs ends with its total line."""
    lines = [f"{len(t['nights'])} night(s), {t['runs']} run(s)", HEADER]
    for n in t["nights"]:
        label = _label(n)
        for r in n["runs"]:
            run = (r["job_id"] or "?").rsplit("-", 2)[-2][-6:] if r["job_id"] and r["job_id"].count("-") >= 2 else "?"
            lines.append(_line(label, run, r["status"] or "?", r, len(r["failed_shards"]), "", r["draft"]))
            label = ""
        if len(n["runs"]) != 1:
            status = "complete" if n["complete"] else f"{len(n['not_committed'])} not done"
            lines.append(_line("", "night", status, n, len(n["not_committed"]), len(n["rerun_shards"]), n["draft"]))
        if n["groups"]:
            lines.append(f"{'':<22}acceptance by group: " + ", ".join(
                f"{g} {_f(x['acceptance_rate'], '.3f')} ({x['rows']} rows)" for g, x in n["groups"].items()))
    return "\n".join(lines)


def _svg(t: dict) -> str:
    """Four charts over the nights (rows and error rows, $/M tokens, acceptance, the saving with its
    95% interval) as one inline SVG, drawn by matplotlib; text kept as text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nights = t["nights"]
    # The last partition value ("2026-12-05" of dt=2026-12-05), at most ~10 of them on an axis.
    labels = [list(n["partition"].values())[-1] if n["partition"] else posixpath.basename(n["output"]) for n in nights]
    x = list(range(len(nights)))
    every = max(1, -(-len(nights) // 10))
    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9})
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), constrained_layout=True)
    (a, b), (c, d) = axes
    a.bar(x, [n["rows"] - n["error_rows"] for n in nights], label="rows")
    a.bar(x, [n["error_rows"] for n in nights], bottom=[n["rows"] - n["error_rows"] for n in nights], label="error rows")
    a.set_title("rows per night")
    a.legend(loc="lower right")
    b.plot(x, [n["usd_per_million_tokens"] for n in nights], marker="o")
    b.set_ylim(bottom=0)  # a ratio's axis from zero: a 10% change looks like one
    b.set_title("$ per million completion tokens")
    c.plot(x, [n["acceptance_rate"] for n in nights], marker="o", label="all shards")
    for g in sorted({g for n in nights for g in n["groups"]}):  # a group's line where it ran
        c.plot(x, [(n["groups"].get(g) or {}).get("acceptance_rate") for n in nights], marker=".", label=g)
    if any(n["groups"] for n in nights):
        c.legend(fontsize=7)
    c.set_ylim(0, 1)
    c.set_title("acceptance (accepted / drafted tokens)")
    measured = [(i, n) for i, n in zip(x, nights) if n["saving_s"] is not None]
    if measured:
        d.errorbar([i for i, _ in measured], [n["saving_s"] for _, n in measured], fmt="o", capsize=3,
                   yerr=[[n["saving_s"] - n["saving_interval_s"][0] for _, n in measured],
                         [n["saving_interval_s"][1] - n["saving_s"] for _, n in measured]])
    else:
        d.text(0.5, 0.5, "not measured (hf engine, or nothing speculated)", ha="center", transform=d.transAxes)
    d.axhline(0, color="grey", linewidth=0.8)
    d.set_title("speculation's measured saving, s (95% interval)")
    for ax in (a, b, c, d):
        ax.set_xticks(x[::every], labels[::every], rotation=30, ha="right")
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def to_html(t: dict) -> str:
    """One self-contained page: the charts, then the text table (no scripts, no external resources)."""
    return ("<!doctype html><html><head><meta charset='utf-8'><title>batchspec: night over night</title>"
            "<style>body{font-family:sans-serif;margin:1.5em;max-width:100%}svg{max-width:100%;height:auto}"
            "pre{overflow-x:auto;font-size:12px}</style></head><body>"
            f"<h1>{html.escape(t['nights'][0]['name'] or 'batchspec')}: night over night</h1>{_svg(t)}"
            f"<pre>{html.escape(to_text(t))}</pre></body></html>")


def render(t: dict, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(t, indent=2, default=str)
    if fmt == "html":
        return to_html(t)
    if fmt == "table":
        return to_text(t)
    raise ValueError(f"the trend report renders table, json or html, not {fmt}")
