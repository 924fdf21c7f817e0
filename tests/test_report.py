"""Reports over a fixture output with hand-computed figures; formats; S3; log records."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from batchspec.cli import app
from batchspec.reports.output import build_report, compare, compare_text, to_html, to_text
from batchspec.runner.schema import OUTPUT_SCHEMA
from batchspec.runner.store import OutputStore


def row(shard, i, completion, draft=0, accepted=0, rounds=0, ttft=0.1, latency=1.0, spec=False, error=None, k=None):
    return {"id": f"{shard}:{i}", "shard": shard, "row_index": i, "completion": None if error else "x",
            "finish_reason": "error" if error else "length", "error": error, "prompt_tokens": 5,
            "completion_tokens": completion, "spec_enabled": spec, "draft_kind": "quantized" if spec else None,
            "num_speculative_tokens": k, "draft_tokens": draft, "accepted_tokens": accepted, "spec_rounds": rounds,
            "acceptance_rate": accepted / draft if spec and draft else None, "ttft_s": ttft, "latency_s": latency,
            "batch_size": 0 if error else 2, "attempt": 1, "worker": "w", "target_model": "t",
            "draft_model": "d" if spec else None, "prompt_sha256": None if error else "h"}


def write_fixture(store: OutputStore) -> None:
    """Shard a: speculation on (2 rows + 1 error row); b: off (2 rows); c: failed, must not count."""
    a = [row("a", 0, 10, 8, 6, 4, 0.1, 1.0, True, k=4), row("a", 1, 20, 12, 12, 4, 0.1, 2.0, True, k=4),
         row("a", 2, 0, error="null prompt")]
    b = [row("b", 0, 30, ttft=0.2, latency=3.0), row("b", 1, 40, ttft=0.3, latency=4.0)]
    costs = {"batch_size": 2, "target_step_s": 0.1, "draft_step_s": 0.02, "verify_s": {"4": 0.15},
             "prefill_token_s": 0.001, "draft_prefill_token_s": 0.0005}
    for shard, rows, total_s, c in (("a", a, 10.0, costs), ("b", b, 20.0, None)):
        part = store.write_part(shard, pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
        store.write_manifest(shard, {"shard": shard, "status": "done", "part": part["part"], "rows_out": len(rows),
                                     "timings": {"total_s": total_s}, "costs": c, "attempts": 1,
                                     "decisions": [{"reason": "on (probe): no acceptance observed yet", "at_row": 0},
                                                   {"reason": "on: per-token acceptance 0.95, k=4", "at_row": 2}]
                                     if c else [{"reason": "off: prefill-dominated", "at_row": 0}]})
    store.write_manifest("c", {"shard": "c", "status": "failed", "error": "unreadable"})
    store.write_job({"name": "fixture", "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 25.0}],
                     "shards": ["a", "b", "c"]})


EXPECTED = {
    "rows": 5, "error_rows": 1, "completion_tokens": 100, "prompt_tokens": 25, "actor_seconds": 30.0, "wall_s": 25.0,
    "tokens_per_s": 4.0, "cost_usd": 0.03, "usd_per_million_tokens": 300.0, "spec_rows": 2, "plain_rows": 2,
    "spec_shards": 1, "plain_shards": 1, "acceptance_rate": 0.9, "mean_acceptance_length": 3.25,
    # per speculative row: accepted - draft*c - rounds*(v-1) target steps, c=0.2, v(4)=1.5:
    # (6 - 1.6 - 2) + (12 - 2.4 - 2) = 10 steps * 0.1 s / batch 2 = 0.5 s
    "estimated_saving_s": 0.5, "saving_rows": 2,
}


def check(report: dict) -> None:
    for key, value in EXPECTED.items():
        assert report[key] == pytest.approx(value), key
    assert report["shards_not_committed"] == ["c"]
    assert report["latency_s"]["p50"] == pytest.approx(2.5) and report["ttft_s"]["p50"] == pytest.approx(0.15)
    assert report["acceptance_rate_quantiles"]["p50"] == pytest.approx(0.875)
    assert [s["shard"] for s in report["shards"]] == ["a", "b"]  # slowest (3.0 tok/s) first
    assert report["shards"][0]["tokens_per_s"] == pytest.approx(3.0)


def test_report_figures_local(tmp_path):
    write_fixture(OutputStore(str(tmp_path / "out")))
    check(build_report(str(tmp_path / "out")))


def test_a_shard_that_generated_nothing_is_listed_after_the_slow_ones(tmp_path):
    """An empty input file (or one of error rows only) is not the slowest shard: it goes last."""
    store = OutputStore(str(tmp_path / "out"))
    write_fixture(store)
    part = store.write_part("e", pa.Table.from_pylist([row("e", 0, 0, error="null prompt")], schema=OUTPUT_SCHEMA))
    store.write_manifest("e", {"shard": "e", "status": "done", "part": part["part"], "rows_out": 1,
                               "timings": {"total_s": 0.01}, "costs": None, "attempts": 1, "decisions": []})
    assert [s["shard"] for s in build_report(str(tmp_path / "out"))["shards"]] == ["a", "b", "e"]


def test_engine_loads_are_costed_apart_from_the_shards(tmp_path):
    """Every engine load the runs paid (a restarted actor's again) is start-up: priced on its own
    line, not spread over the shards; runs recorded before start-up was kept add nothing."""
    store = OutputStore(str(tmp_path / "out"))
    write_fixture(store)
    job = store.read_job()
    job["runs"] = [{"wall_s": 25.0},
                   {"wall_s": 30.0, "startup": {"ray_s": 3.0, "actors": [{"worker": "h:1", "load_s": 40.0, "ready_s": 44.0},
                                                                          {"worker": "h:2", "load_s": 50.0, "ready_s": 58.0}]}}]
    store.write_job(job)
    r = build_report(str(tmp_path / "out"))
    assert r["cost_usd"] == pytest.approx(0.03)  # the shards' 30 actor-seconds, as before
    assert (r["startup_loads"], r["startup_actor_seconds"]) == (2, 90.0)
    assert r["startup_cost_usd"] == pytest.approx(90 / 3600 * 3.6)
    assert "start-up $0.0900 more (2 engine load(s), 90.0 actor-seconds)" in to_text(r)
    assert "start-up" not in to_text(build_report(str(tmp_path / "out"), gpu_hour_usd=1.0) | {"startup_loads": 0})


def test_report_figures_on_s3(s3):
    opts, fs, bucket = s3
    write_fixture(OutputStore(f"{bucket}/out", opts))
    check(build_report(f"{bucket}/out", opts))


def test_report_and_status_read_stats_columns_and_list_parts_once(tmp_path, monkeypatch):
    """Over millions of rows the report reads only the columns it adds up (never completions, ids
    or prompt hashes), and neither it nor status asks for the parts one by one (a HEAD request per
    shard on S3): one listing of data/ answers which parts exist. A part deleted after the run is
    still seen as missing."""
    import pyarrow.parquet as pq

    from batchspec.runner.record import status

    store = OutputStore(str(tmp_path / "out"))
    write_fixture(store)
    read: list = []
    real_read = pq.ParquetFile.read
    monkeypatch.setattr(pq.ParquetFile, "read", lambda self, columns=None, **kw: read.append(columns)
                        or real_read(self, columns=columns, **kw))
    monkeypatch.setattr(OutputStore, "part_info", lambda *a, **kw: pytest.fail("a part looked up one by one"))
    check(build_report(str(tmp_path / "out")))
    assert len(read) == 2 and all(cols and not {"completion", "id", "prompt_sha256", "error"} & set(cols) for cols in read)
    assert status(str(tmp_path / "out"))["shards"] == {"done": 2, "failed": 1, "pending": 0, "total": 3}
    (tmp_path / "out" / store.part_name("b")).unlink()
    assert status(str(tmp_path / "out"))["shards"] == {"done": 1, "failed": 1, "pending": 1, "total": 3}
    assert build_report(str(tmp_path / "out"))["shards_not_committed"] == ["b", "c"]


def test_report_histograms_count_every_value(tmp_path):
    """The HTML's histograms count in bins (numpy), not over a list of every row's value."""
    import polars as pl

    from batchspec.reports.output import _bars, _histogram

    page = _histogram("t", pl.Series([0.0, 0.05, 0.5, 1.0, None]), bins=10, lo=0.0, hi=1.0)
    assert page.count(">2 rows<") == 1 and page.count(">1 rows<") == 2 and page.count(">0 rows<") == 7
    assert "no data" in _histogram("t", pl.Series([], dtype=pl.Float64))
    # Row latencies 0.240-0.285 s: bins 0.0045 s wide read "0.2400 – 0.2445", not "0.24 – 0.24" twice.
    narrow = _histogram("t", pl.Series([0.240, 0.285]), bins=10)
    assert ">0.2400 – 0.2445<" in narrow and ">0.2805 – 0.2850<" in narrow
    assert ">4,919 tokens/s<" in _bars("t", ["a"], [4918.8], " tokens/s")  # not 4.92e+03


def test_price_flag_overrides_the_spec(tmp_path):
    write_fixture(OutputStore(str(tmp_path / "out")))
    assert build_report(str(tmp_path / "out"), gpu_hour_usd=7.2)["cost_usd"] == pytest.approx(0.06)


def test_formats(tmp_path):
    write_fixture(OutputStore(str(tmp_path / "out")))
    out = str(tmp_path / "out")
    res = CliRunner().invoke(app, ["report", out, "--format", "json"])
    data = json.loads(res.stdout)
    assert {"rows", "error_rows", "completion_tokens", "acceptance_rate", "cost_usd", "usd_per_million_tokens",
            "shards"} <= set(data) and isinstance(data["shards"], list)
    csv_text = CliRunner().invoke(app, ["report", out, "--format", "csv"]).stdout.splitlines()
    assert csv_text[0].startswith("shard,rows,error_rows") and csv_text[1].startswith("a,3,1,30")
    assert csv_text[-1].startswith("TOTAL,5,1,100")
    table = CliRunner().invoke(app, ["report", out]).stdout
    assert "acceptance 0.900" in table and "$300.00 per million tokens" in table


def test_a_saving_without_measured_costs_is_unknown_not_zero(tmp_path):
    """On vllm a call whose rows finished while it measured keeps no step costs: its speculating
    rows cannot be estimated, and the report must not read as "speculation saved nothing"."""
    store = OutputStore(str(tmp_path / "out"))
    write_fixture(store)
    d = [row("d", 0, 10, 8, 6, 4, spec=True, k=4), row("d", 1, 10, 8, 8, 2, spec=True, k=4)]
    part = store.write_part("d", pa.Table.from_pylist(d, schema=OUTPUT_SCHEMA))
    store.write_manifest("d", {"shard": "d", "status": "done", "part": part["part"], "rows_out": 2,
                               "timings": {"total_s": 5.0}, "costs": None, "attempts": 1, "decisions": []})
    r = build_report(str(tmp_path / "out"))
    assert r["estimated_saving_s"] == pytest.approx(0.5) and (r["saving_rows"], r["spec_rows"]) == (2, 4)
    # The saving is the text's second line, as the HTML's first card, estimated (hf) as measured (vllm).
    assert to_text(r).splitlines()[1].startswith("saving: estimated saving 0.5 s vs plain (over 2 of 4 speculating rows")
    r["estimated_saving_s"] = -0.234  # a loss reads as a cost, as a measured one does
    assert to_text(r).splitlines()[1].startswith("saving: estimated cost 0.23 s vs plain")

    only_d = OutputStore(str(tmp_path / "only-d"))
    part = only_d.write_part("d", pa.Table.from_pylist(d, schema=OUTPUT_SCHEMA))
    only_d.write_manifest("d", {"shard": "d", "status": "done", "part": part["part"], "rows_out": 2,
                                "timings": {"total_s": 5.0}, "costs": None, "attempts": 1, "decisions": []})
    only_d.write_job({"name": "d", "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 6.0}], "shards": ["d"]})
    r = build_report(str(tmp_path / "only-d"))
    assert r["estimated_saving_s"] is None and r["spec_rows"] == 2
    assert "estimated saving unknown" in to_text(r) and "0.0s" not in to_text(r)
    page = CliRunner().invoke(app, ["report", str(tmp_path / "only-d"), "--format", "html"]).stdout
    assert ">unknown</div>" in page and "Saving from speculation" in page
    assert json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "only-d"), "--format", "json"]).stdout)[
        "estimated_saving_s"] is None


def test_an_output_where_nothing_was_generated_has_no_saving_figure(tmp_path):
    """Every shard failed (here: nothing committed): the saving is not a figure of 0.0 s, which
    read as "speculation saved nothing" in the text ("estimated saving 0.0s vs plain") and HTML."""
    store = OutputStore(str(tmp_path / "out"))
    store.write_manifest("a", {"shard": "a", "status": "failed", "error": "VLLMValidationError: temperature ..."})
    store.write_job({"name": "failed", "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 15.0}],
                     "shards": ["a"]})
    r = build_report(str(tmp_path / "out"))
    assert r["completion_tokens"] == 0 and r["shards_not_committed"] == ["a"]
    assert to_text(r).splitlines()[1] == "saving: n/a (nothing generated)"
    assert ">n/a</div>" in to_html(r) and "0.0 s" not in to_html(r)


def test_a_measured_saving_is_reported_first_with_its_interval(tmp_path):
    """vllm shards carry what speculation saved, measured in the run (manifest "saving"): the
    report sums the shards' seconds and their 95% bounds, says "no measurable saving" when the
    interval spans zero, and puts it first in the text and the html."""
    def job(name, savings):
        store = OutputStore(str(tmp_path / name))
        for i, (seconds, low, high) in enumerate(savings):
            shard = f"s{i}"
            rows = [row(shard, 0, 10, 8, 6, 4, spec=True, k=4), row(shard, 1, 10, 8, 6, 4, spec=True, k=4)]
            part = store.write_part(shard, pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
            store.write_manifest(shard, {"shard": shard, "status": "done", "part": part["part"], "rows_out": 2,
                                         "timings": {"total_s": 5.0}, "costs": None, "attempts": 1, "decisions": [],
                                         "saving": {"seconds": seconds, "low": low, "high": high, "rows": 2,
                                                    "steps": 12, "basis": "..."}})
        store.write_job({"name": name, "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 6.0}],
                         "shards": [f"s{i}" for i in range(len(savings))]})
        return build_report(str(tmp_path / name))

    r = job("paid", [(1.5, 1.0, 2.0), (0.5, 0.2, 0.8)])
    assert r["measured_saving_s"] == pytest.approx(2.0) and r["saving_interval_s"] == pytest.approx([1.2, 2.8])
    assert r["measured_rows"] == 4 and r["estimated_saving_s"] == 0.0
    text = to_text(r)
    assert "speculation saved 2.0 s (95% interval 1.2 to 2.8 s), measured in the run" in text
    assert "speculation saved 2.0 s" in to_html(r)
    tie = job("tie", [(0.3, -0.4, 1.0)])
    assert "no measurable saving (0.3 s, 95% interval -0.4 to 1.0 s)" in to_text(tie)
    lost = job("lost", [(-1.0, -1.5, -0.5)])
    assert "speculation cost 1.0 s (95% interval 0.5 to 1.5 s)" in to_text(lost)  # a cost, its interval as costs
    share = lost["measured_saving_s"] / (lost["actor_seconds"] + lost["measured_saving_s"])
    assert f"{-100 * share:.0f}% more time than plain decoding" in to_html(lost) and share < 0
    # Figures that one decimal would round to zero keep their side of it in the text.
    near = job("near", [(0.02, -0.04, 0.08)])
    assert "no measurable saving (0.02 s, 95% interval -0.04 to 0.08 s)" in to_text(near)
    # Under a second, two significant digits: one decimal put the demo's cost of 0.467 s on its own
    # bound ("cost 0.5 s (95% interval -0.5 to -0.2 s)").
    sampled = job("sampled", [(-0.4672, -0.5262, -0.1523)])
    assert "speculation cost 0.47 s (95% interval 0.15 to 0.53 s)" in to_text(sampled)
    assert ">-0.47 s</div>" in to_html(sampled)
    small = job("small", [(0.04, 0.004, 0.3)])
    assert "speculation saved 0.04 s (95% interval 0.004 to 0.3 s)" in to_text(small)
    exact = job("exact", [(0.0, 0.0, 0.0)])
    assert "no measurable saving (0.0 s, 95% interval 0.0 to 0.0 s)" in to_text(exact)


def test_a_shard_with_rows_both_ways_counts_as_speculating_and_as_plain(tmp_path):
    """A shard whose look ran some rows at k and some plain is in both counts of the speculation
    line, not "off for 1 rows in 0 shard(s)"."""
    store = OutputStore(str(tmp_path))
    rows = [row("m", 0, 10, 8, 6, 4, spec=True, k=4), row("m", 1, 10)]
    part = store.write_part("m", pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
    store.write_manifest("m", {"shard": "m", "status": "done", "part": part["part"], "rows_out": 2,
                               "timings": {"total_s": 2.0}, "costs": None, "attempts": 1, "decisions": []})
    store.write_job({"name": "mixed", "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 3.0}], "shards": ["m"]})
    r = build_report(str(tmp_path))
    assert (r["spec_rows"], r["plain_rows"], r["spec_shards"], r["plain_shards"]) == (1, 1, 1, 1)
    assert "on for 1 rows in 1 shard(s), off for 1 rows in 1 shard(s)" in to_html(r)


def test_html_is_self_contained(tmp_path):
    write_fixture(OutputStore(str(tmp_path / "out")))
    page = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", str(tmp_path / "out"), "--format", "html", "--out", str(page)])
    assert res.exit_code == 0
    text = page.read_text()
    assert text.startswith("<!doctype html>") and text.count("<svg") == 4
    assert "http://" not in text and "https://" not in text and "<script" not in text
    assert "<td>a</td>" in text
    # every decision of a shard, with the row it took effect from
    assert "from row 0:</span> on (probe)" in text and "from row 2:</span> on: per-token acceptance 0.95" in text
    assert "on (2 rows)" in text and "off (2 rows)" in text  # on vs off says how many rows each is
    assert "per-token acceptance (alpha)" in text and "accepted / proposed" in text  # both definitions labelled
    # headline figures first: saving, cost, per million tokens, acceptance, before the facts and tables
    order = [text.index(k) for k in ("Saving from speculation", "Cost</div>", "Per million tokens", "Acceptance</div>",
                                     "<dl>", "<table>")]
    assert order == sorted(order)
    assert "$300.00" in text and "0.900" in text


def test_compare_two_runs(tmp_path):
    write_fixture(OutputStore(str(tmp_path / "a")))
    write_fixture(OutputStore(str(tmp_path / "b")))
    c = compare(build_report(str(tmp_path / "a")), build_report(str(tmp_path / "b"), gpu_hour_usd=7.2))
    assert c["figures"]["cost_usd"]["ratio"] == pytest.approx(2.0)
    assert c["figures"]["tokens_per_s"]["ratio"] == pytest.approx(1.0)
    assert c["figures"]["startup_cost_usd"] == {"a": 0.0, "b": 0.0, "ratio": None}  # runs that recorded none
    res = CliRunner().invoke(app, ["report", str(tmp_path / "a"), "--compare", str(tmp_path / "b")])
    assert res.exit_code == 0 and "B/A" in res.stdout


def test_compare_puts_a_speculating_runs_saving_beside_a_plain_run_of_the_same_rows(tmp_path):
    """auto against the same job under mode=off: the plain run's actor-seconds less the speculating
    run's, next to what the speculating run says it saved; no such line for any other pair."""
    def job(name, spec, total_s, saving=None):
        store = OutputStore(str(tmp_path / name))
        rows = [row("s", i, 10, 8 if spec else 0, 6 if spec else 0, 4 if spec else 0, spec=spec, k=4 if spec else None)
                for i in range(2)]
        part = store.write_part("s", pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA))
        store.write_manifest("s", {"shard": "s", "status": "done", "part": part["part"], "rows_out": 2,
                                   "timings": {"total_s": total_s}, "costs": None, "attempts": 1, "decisions": [],
                                   **({"saving": saving} if saving else {})})
        store.write_job({"name": name, "spec": {"cost": {"gpu_hour_usd": 3.6}}, "runs": [{"wall_s": 9.0}], "shards": ["s"]})
        return build_report(str(tmp_path / name))

    auto = job("auto", True, 5.0, {"seconds": 1.0, "low": 0.5, "high": 1.5, "rows": 2, "steps": 8, "basis": "..."})
    off = job("off", False, 6.2)
    c = compare(auto, off)
    assert c["side_by_side"]["plain_minus_speculating_actor_s"] == pytest.approx(1.2)
    assert c["saving"]["b"] == "none (no row speculated)"
    assert ">none</div>" in to_html(off) and "no row speculated: every shard ran plain" in to_html(off)
    text = compare_text(c)
    assert ("side by side: B (plain) took 1.2 s more actor time than A (speculating) on the same 2 rows; "
            "A says: speculation saved 1.0 s (95% interval 0.5 to 1.5 s), measured in the run") in text
    assert "side by side: A (plain) took 1.2 s more" in compare_text(compare(off, auto))  # either order
    assert compare(auto, auto)["side_by_side"] is None and "side by side" not in compare_text(compare(off, off))
    fewer = job("fewer", False, 3.0)
    fewer["completion_tokens"] -= 1  # other completions (sampling): not the same work, no line
    assert compare(auto, fewer)["side_by_side"] is None


def test_log_records_carry_ids_and_no_prompt_text(models_dir, tmp_path, capfd):
    """JSON logs from a real shard run: job and shard ids, prompt hashes for error rows, no prompt."""
    import pyarrow.parquet as pq

    from batchspec.runner.logs import configure
    from batchspec.runner.plan import plan_shards
    from batchspec.runner.worker import ShardRunner
    from batchspec.spec import spec_from_dict

    secret_prompt = "CONFIDENTIAL merger terms of Acme"
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"prompt": [secret_prompt, "", "ok " * 2000], "doc_id": ["p1", "p2", "p3"]}),
                   tmp_path / "in" / "s-0000.parquet")
    spec = spec_from_dict({"name": "logs", "input": {"path": str(tmp_path / "in"), "id_column": "doc_id"},
                           "output": {"path": str(tmp_path / "out")},
                           "model": {"target": str(models_dir / "llama-target"), "draft": {"kind": "ngram"},
                                     "backend": "hf"},
                           "generation": {"max_new_tokens": 4}})
    configure("json")
    runner = ShardRunner(spec, "job-123")
    runner.run(plan_shards(str(tmp_path / "in"))[0])
    err = capfd.readouterr().err
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert records and all(r.get("job") == "job-123" and r.get("shard") == "s-0000" for r in records)
    error_rows = [r for r in records if r["msg"].startswith("error row")]
    assert {r["row"] for r in error_rows} == {"p2", "p3"} and all("prompt_sha256" in r for r in error_rows)
    assert "CONFIDENTIAL" not in err and "ok ok ok" not in err


def test_log_lines_carry_batchspec_ids_only(capfd):
    """Attributes other libraries put on records (vLLM's record factory adds vllm_process_name to
    every record once vLLM is imported, as it is earlier in this session) stay out of batchspec's
    text and JSON lines; log_event's ids go in."""
    import json
    import logging

    from batchspec.runner.logs import configure, log_event

    log = logging.getLogger("batchspec.test")
    for fmt in ("text", "json"):
        configure(fmt)
        log.info("plain", extra={"other_library_field": "x"})
        log_event(log, "shard done", job="j1", shard="s1", rows=3, attempts=None)
        plain, done = capfd.readouterr().err.splitlines()
        assert "other_library_field" not in plain + done and "vllm_process_name" not in plain + done
        if fmt == "json":
            assert {k: v for k, v in json.loads(done).items() if k in ("job", "shard", "rows")} == \
                {"job": "j1", "shard": "s1", "rows": 3}
            assert json.loads(done)["attempts"] is None  # a pipeline's key stays, as null
        else:
            assert done.endswith("shard done job=j1 shard=s1 rows=3")  # no "attempts=None" in text
    configure("text")


def test_html_fits_1400px_in_chromium(tmp_path):
    """Rendered, not only parsed: no horizontal overflow at 1400 px (or at a phone's 420 px)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from report_screenshot import find_browser, measure

    from batchspec.reports.output import to_html

    if find_browser() is None:
        pytest.skip("no Chromium here (apt-get install chromium; .ci/run installs it)")
    store = OutputStore(str(tmp_path / "out"))
    write_fixture(store)
    long = "off: per-token acceptance 0.31 gives predicted 0.87x (< 1.05x) at prompt p50 1800 tokens " * 3
    store.write_manifest("b", {**store.manifests()["b"], "decisions": [{"reason": long, "at_row": 0}]})
    page = to_html(build_report(str(tmp_path / "out")))
    for width in (1400, 420):
        m = measure(page, width, png=str(tmp_path / f"report-{width}.png"))
        assert m["scroll_width"] <= m["viewport"], (width, m)
    assert (tmp_path / "report-1400.png").stat().st_size > 10_000


def test_the_trend_groups_a_nights_shards_by_their_inputs_hive_keys(tmp_path):
    """Acceptance per group within a night (issue 60): the hive keys of the shards' input paths
    other than the night's own; a group that did not run one night leaves a gap in its line. The
    page, rendered in Chromium where there is one, fits 1400 px and a phone's width."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from report_screenshot import find_browser, measure

    from batchspec.reports.trend import groups, to_html, to_text

    def m(path: str, accepted: int, drafted: int) -> dict:
        return {"path": path, "rows_out": 10, "tokens": {"accepted_tokens": accepted, "draft_tokens": drafted}}

    night = [m("/in/dt=2026-12-05/domain=legal/p0.parquet", 80, 100), m("/in/dt=2026-12-05/domain=legal/p1.parquet", 90, 100),
             m("/in/dt=2026-12-05/domain=other/p0.parquet", 10, 100)]
    assert groups(night, {"dt"}) == {"domain=legal": {"shards": 2, "rows": 20, "acceptance_rate": 0.85},
                                     "domain=other": {"shards": 1, "rows": 10, "acceptance_rate": 0.1}}
    assert groups([m("/in/dt=2026-12-05/p0.parquet", 1, 2)], {"dt"}) == {}
    base = {"output": "o", "name": "j", "draft": "ngram", "complete": True, "not_committed": [], "rerun_shards": [],
            "rows": 30, "error_rows": 0, "completion_tokens": 300, "actor_seconds": 3.0, "cost_usd": 0.01, "wall_s": 5.0,
            "usd_per_million_tokens": 33.3, "acceptance_rate": 0.6, "saving_s": None, "saving_interval_s": None}
    run = {**base, "job_id": "j-20261205T023000-abcdef", "status": "succeeded", "failed_shards": []}
    trend = {"kind": "trend", "runs": 2, "nights": [
        {**base, "partition": {"dt": "2026-12-05"}, "groups": groups(night, {"dt"}), "runs": [run]},
        {**base, "partition": {"dt": "2026-12-06"}, "groups": {"domain=legal": {"shards": 1, "rows": 10, "acceptance_rate": 0.9}},
         "runs": [run]}]}
    text = to_text(trend)
    assert "acceptance by group: domain=legal 0.850 (20 rows), domain=other 0.100 (10 rows)" in text
    assert text.splitlines()[2].split()[:3] == ["dt=2026-12-05", "023000", "succeeded"]
    page = to_html(trend)
    assert "domain=other" in page and "not measured" in page  # its legend entry; the saving's empty panel
    if find_browser() is not None:
        for width in (1400, 420):
            m = measure(page, width, png=str(tmp_path / f"trend-{width}.png"))
            assert m["scroll_width"] <= m["viewport"], (width, m)
        assert (tmp_path / "trend-1400.png").stat().st_size > 10_000


def test_status_and_report_of_a_folder_of_outputs_and_one_compare_only(tmp_path):
    """Issue 60: `status` on the parent folder failed ("missing _batchspec/job.json"); `--compare`
    given twice took the last silently. Now: a line per night (exit 1 while one is not complete),
    the trend for `report`, and a second --compare refused."""
    for night in ("dt=2026-12-04", "dt=2026-12-05"):
        write_fixture(OutputStore(str(tmp_path / "out" / night)))  # shard c failed: neither is complete
    res = CliRunner().invoke(app, ["status", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[0] == "dt=2026-12-04: last run None, 2/3 shards done, 1 failed, 0 pending, 5 rows"
    both = json.loads(CliRunner().invoke(app, ["status", str(tmp_path / "out"), "--json"]).stdout)
    assert not both["complete"] and [s["shards"]["done"] for s in both["outputs"]] == [2, 2]
    trend = json.loads(CliRunner().invoke(app, ["report", str(tmp_path / "out"), "--format", "json"]).stdout)
    assert [n["partition"] for n in trend["nights"]] == [{"dt": "2026-12-04"}, {"dt": "2026-12-05"}]
    assert [n["not_committed"] for n in trend["nights"]] == [["c"], ["c"]] and trend["nights"][0]["rows"] == 5
    one = str(tmp_path / "out" / "dt=2026-12-04")
    twice = CliRunner().invoke(app, ["report", one, "--compare", one, "--compare", one])
    assert twice.exit_code == 2 and "--compare takes one output" in twice.output
