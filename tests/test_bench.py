"""`batchspec bench --quick` runs on a tiny pair and writes valid JSON."""

import json

from typer.testing import CliRunner

from batchspec.cli import app


def test_bench_quick_writes_valid_json(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--quick", "--policy", "--out", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    configs = {(r["batch_size"], r["config"]) for r in report["results"]}
    assert {(1, "batchspec plain"), (1, "transformers generate"), (1, "transformers assisted"),
            (2, "batchspec spec adaptive")} <= configs
    assert (2, "transformers assisted") not in configs  # transformers refuses batches > 1
    for r in report["results"]:
        assert r["tokens_per_s"] > 0
        if r["config"].startswith("batchspec"):  # greedy, fp32 on CPU: speculation changes no token
            assert r["rows_equal_plain"] == r["batch_size"], r
        if r["config"].startswith("batchspec spec"):
            assert 0 <= r["alpha"] <= 1 and r["mean_acceptance_length"] >= 1
            assert r["predicted_speedup"] > 0 and r["draft_cost_ratio_c"] > 0
    assert report["policy"] and "auto decides" in res.output
    assert "= plain" in res.output and report["machine"]["dtype"] == "torch.float32"
