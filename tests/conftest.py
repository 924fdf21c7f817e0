"""Shared fixtures: tiny random-weight checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """tokenizer/, <family>-target/ and <family>-other/ (an unrelated random draft) per family."""
    from batchspec.testing import build_model, build_tokenizer

    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer(root / "tokenizer")
    for family in ("llama", "gpt2"):
        build_model(root / f"{family}-target", family, tok, seed=0)
        build_model(root / f"{family}-other", family, tok, seed=1)
    return root


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    """Ragged prompts: from one word to a few dozen tokens."""
    from batchspec.testing import synthetic_text

    lines = synthetic_text(8, seed=7)
    return ["a"] + [line[: 10 + 17 * i] for i, line in enumerate(lines[1:])]
