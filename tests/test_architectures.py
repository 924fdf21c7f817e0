"""Speculative greedy output equals transformers' greedy `generate` on every popular decoder
architecture and draft kind (2-layer random checkpoints; scripts/arch_matrix.py prints the table
in docs/engine.md), including sliding windows that rows do and do not fit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from arch_matrix import KINDS, WINDOWED, cells  # noqa: E402

from batchspec.testing import ARCHITECTURES  # noqa: E402


@pytest.fixture(scope="module")
def arch_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("arch")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_draft_kind_is_exact(arch_root, arch):
    row = cells(arch_root, arch, None)
    assert all(row[k] == "exact" for k in KINDS), row


@pytest.mark.parametrize("arch", WINDOWED)
@pytest.mark.parametrize("window", [16, 40])
def test_sliding_windows_stay_exact(arch_root, arch, window):
    """16: no row fits, all run plain; 40: the rows of up to 20 prompt tokens (5 of 6) speculate."""
    row = cells(arch_root, arch, window)
    assert all(v.startswith("exact") for v in row.values()), row
    fit = {16: "0/6", 40: "5/6"}[window]
    assert all(f"({fit} rows fit the {window}-token window" in v for v in row.values()), row


def test_window_cap_keeps_holes_inside_the_window(tmp_path):
    """Rows that all fit a tight window: the per-round cap on k (generate._window_slack) is what
    keeps them exact (without it, layer_skip drifted on 1 of 5 rows with this window)."""
    from arch_matrix import matrix_prompts

    from batchspec.testing import build_arch_model, build_tokenizer, lossless_cell

    tok = build_tokenizer(tmp_path / "tok")
    target = build_arch_model(tmp_path / "mistral", "mistral", tok, window=38)
    for kind in ("quantized", "layer_skip", "ngram"):
        assert lossless_cell(target, kind, matrix_prompts()[:5], 20) == "exact"


def test_attention_window_reads_every_declaration():
    from transformers import AutoConfig

    from batchspec.engine.models import attention_window

    assert attention_window(AutoConfig.for_model("mistral", sliding_window=16)) == 16
    assert attention_window(AutoConfig.for_model("mistral", sliding_window=None)) is None
    assert attention_window(AutoConfig.for_model("qwen2", sliding_window=16)) is None  # use_sliding_window off
    assert attention_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16,
                                                 num_hidden_layers=4, max_window_layers=2)) == 16
    assert attention_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16,
                                                 num_hidden_layers=4, max_window_layers=4)) is None  # no layer slides
    assert attention_window(AutoConfig.for_model("gemma2", sliding_window=32)) == 32
    assert attention_window(AutoConfig.for_model("phi3", sliding_window=2047)) == 2047
    assert attention_window(AutoConfig.for_model("llama")) is None
