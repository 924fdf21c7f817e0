"""The architecture matrix on the vllm backend: does vLLM serve each popular decoder architecture
through batchspec, and is its greedy output, plain and speculative, identical to transformers'
greedy `generate`? Prints the Markdown table that docs/engine.md carries.

    python scripts/vllm_arch_matrix.py                          # every architecture and draft kind
    python scripts/vllm_arch_matrix.py --arch llama,gemma2 --kinds ngram

The checkpoints are scripts/arch_matrix.py's (2-layer random models of each architecture, built
locally, the "model" draft a sibling with another seed, the windowed architectures also with
windows of 16 and 40 tokens). Each cell starts the vllm backend in a process of its own (vLLM's
CPU build cannot start a second engine in one process) exactly as a job's actor does
(`load_backend("vllm", spec.model)`), generates the six ragged prompts plain and with speculation
at k = 3, and compares both with transformers run one row at a time in fp32:

    exact (N drafted)     plain and speculative rows equal the reference; N draft tokens proposed
    MISMATCH ...          which of plain / speculative differ, and on how many rows; and how many
                          speculative rows differ from vLLM's own plain ones
    refused: ...          the one line a job's shards would fail with (batchspec's ModelLoadError)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

KINDS = ("ngram", "model")
MAX_NEW = 20
WIDTH = 256  # heads of 64: vLLM's CPU attention has no kernel for arch_matrix's heads of 16

CELL = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from batchspec.engine.backend import load_backend
from batchspec.engine.api import ModelLoadError
from batchspec.spec import load_spec
job, sets, ids, max_new = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
spec = load_spec(job, sets)
try:
    backend = load_backend("vllm", spec.model, k_default=3)
except ModelLoadError as e:
    print("RESULT" + json.dumps({"refused": str(e)}))
    sys.exit(0)
out = {}
for speculate in (False, True):
    rows, _ = backend.generate(ids, max_new, speculate=speculate, draft_length=3)
    out["spec" if speculate else "plain"] = [r.token_ids for r in rows]
    out["errors"] = [r.error for r in rows if r.error]
    if speculate:
        out["drafted"] = sum(r.stats.draft_tokens for r in rows)
print("RESULT" + json.dumps(out))
"""


def reference(target: Path, prompts: list[str], max_new: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids as the engines encode them, and transformers' greedy continuations, one row at a time."""
    from batchspec.engine.models import encode_prompts, eos_token_ids, load_model
    from batchspec.testing import transformers_greedy

    loaded = load_model(str(target), "cpu", "float32")
    ids = encode_prompts(loaded.tokenizer, prompts)
    eos = eos_token_ids(loaded.model, loaded.tokenizer)
    return ids, transformers_greedy(loaded.model, ids, max_new, eos, loaded.tokenizer.pad_token_id)


def cell(target: Path, kind: str, draft: Path | None, ids: list[list[int]], refs: list[list[int]]) -> str:
    sets = [f"model.target={target}", f"model.draft.kind={kind}", "model.backend=vllm"]
    if kind == "model":
        sets.append(f"model.draft.path={draft}")
    proc = subprocess.run([sys.executable, "-c", CELL, str(ROOT / "jobs" / "summarize_legal_small.yaml"), json.dumps(sets),
                           json.dumps(ids), str(MAX_NEW)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"}, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        tail = [x for x in proc.stderr.splitlines() if x.strip()][-1:] or ["no output"]
        return f"crashed: {tail[0][:200]}"
    res = json.loads(line[0][6:])
    if "refused" in res:
        return f"refused: {res['refused'][:200]}"
    if res["errors"]:
        return f"error rows: {res['errors'][0][:200]}"
    wrong = {name: sum(a != b for a, b in zip(res[name], refs)) for name in ("plain", "spec")}
    if any(wrong.values()):
        # Is it the engine's own plain decoding that differs, or does speculation change its output?
        apart = sum(a != b for a, b in zip(res["spec"], res["plain"]))
        return ("MISMATCH " + ", ".join(f"{name} {n}/{len(refs)}" for name, n in wrong.items() if n)
                + f"; speculative vs plain {apart}/{len(refs)} differ")
    return f"exact ({res['drafted']} drafted)"


def main() -> None:
    from arch_matrix import WINDOWED, matrix_prompts
    from transformers.utils import logging as hf_logging

    from batchspec.testing import ARCHITECTURES, build_arch_model, build_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=",".join(ARCHITECTURES), help="comma-separated model_types")
    ap.add_argument("--kinds", default=",".join(KINDS), help="draft kinds (ngram, model)")
    ap.add_argument("--windows", default="16,40", help="windows tried on the windowed architectures ('' for none)")
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    kinds = args.kinds.split(",")
    windows = [None] + [int(w) for w in args.windows.split(",") if w]
    print("| architecture | window | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 2) + "|")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok = build_tokenizer(root / "tokenizer")
        for arch in args.arch.split(","):
            for window in windows if arch in WINDOWED else (None,):
                tag = f"{arch}-w{window}" if window else arch
                target = build_arch_model(root / tag, arch, tok, seed=0, window=window, width=WIDTH)
                draft = build_arch_model(root / f"{tag}-draft", arch, tok, seed=1, window=window, width=WIDTH)
                ids, refs = reference(target, matrix_prompts(), MAX_NEW)
                row = [cell(target, kind, draft, ids, refs) for kind in kinds]
                print(f"| {arch} | {window or 'default'} | " + " | ".join(row) + " |", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s; prompts of 1-32 tokens, {MAX_NEW} new tokens, k = 3, fp32 CPU")


if __name__ == "__main__":
    main()
