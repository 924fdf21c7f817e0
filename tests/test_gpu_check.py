"""scripts/gpu_check.py runs only where a GPU is lent, which CI never is; its smoke mode on the CPU
keeps it working between those sessions (the pair, the bench step and the determinism step)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "gc"
    subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), "--models", str(tmp_path / "models"),
                    "--size", "small", "--device", "cpu", "--max-new-tokens", "8", "--repeats", "1",
                    "--steps", "bench-fp32,determinism"], cwd=REPO, check=True, capture_output=True, timeout=600)
    summary = (out / "summary.md").read_text()
    assert "FAILED" not in summary and "skipped" not in summary, summary
    # fp32: speculation with the draft cut from the target changes no token, and plain reproduces itself.
    assert "batchspec spec k=4" in summary
    table = [line for line in summary.splitlines() if line.startswith("   16  batchspec")]
    assert len(table) == 3 and all(line.endswith("16/16") for line in table), table
    assert "float32, defaults: runs 2 and 3 equal run 1 on 16/16 and 16/16 rows; rows decoded alone equal the " \
           "batch on 4/4" in summary
    assert summary.count("runs 2 and 3 equal run 1") == 4
    assert (out / "bench-model-fp32.json").exists()
