"""The architecture matrix: is speculative greedy output identical to transformers' greedy
`generate` for every popular decoder architecture and every draft kind? Prints the Markdown table
that docs/engine.md carries.

    python scripts/arch_matrix.py                 # every architecture, default and small windows
    python scripts/arch_matrix.py --arch mistral,gemma2

Each checkpoint is a 2-layer random model built locally (batchspec.testing.build_arch_model); the
"model" draft is a sibling checkpoint of the same architecture with another seed.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
import warnings
from pathlib import Path

KINDS = ("model", "quantized", "layer_skip", "ngram")
# Also checked with windows rows do / do not fit (llama4_text: its attention chunk).
WINDOWED = ("mistral", "gemma2", "gemma3_text", "phi3", "gpt_oss", "llama4_text")


def matrix_prompts() -> list[str]:
    from batchspec.testing import synthetic_text

    lines = synthetic_text(6, seed=7)
    return ["a"] + [line[: 10 + 17 * i] for i, line in enumerate(lines[1:])]  # 1 to 32 tokens


def cells(root: Path, arch: str, window: int | None, max_new_tokens: int = 20) -> dict[str, str]:
    from batchspec.testing import build_arch_model, build_tokenizer, lossless_cell

    tok = build_tokenizer(root / "tokenizer")
    tag = f"{arch}-w{window}" if window else arch
    target = build_arch_model(root / tag, arch, tok, seed=0, window=window)
    draft = build_arch_model(root / f"{tag}-draft", arch, tok, seed=1, window=window)
    return {k: lossless_cell(target, k, matrix_prompts(), max_new_tokens, draft if k == "model" else None) for k in KINDS}


def _short(cell: str) -> str:
    return re.sub(r"exact \((\d+/\d+) rows fit the \d+-token window and speculate, the rest run plain\)",
                  r"exact, \1 rows speculate", cell)


def main() -> None:
    from transformers.utils import logging as hf_logging

    from batchspec.testing import ARCHITECTURES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=",".join(ARCHITECTURES), help="comma-separated model_types")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print("| architecture | window | " + " | ".join(KINDS) + " |")
    print("|---" * (len(KINDS) + 2) + "|")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch.split(","):
            for window in (None, 16, 40) if arch in WINDOWED else (None,):
                row = cells(Path(tmp), arch, window)
                label = "default" if window is None else str(window)
                print(f"| {arch} | {label} | " + " | ".join(_short(row[k]) for k in KINDS) + " |", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s; prompts of 1-32 tokens, 20 new tokens, k = 3, fp32 CPU")


if __name__ == "__main__":
    main()
