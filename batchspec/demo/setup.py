"""Prepare the demo: its input shards of synthetic contracts and the cost stand-in target.

    python -m batchspec.demo.setup                  # idempotent; `make demo` runs it first
    python -m batchspec.demo.setup --params 100M    # a larger stand-in (build/demo-models/legal-target-100m)
    python -m batchspec.demo.setup --random-model   # also build the random-weight small model

The demo job runs the trained target committed under models/ (python -m batchspec.demo.train) as
its cost stand-in (batchspec/demo/standin.py: the same outputs, the step cost of a ~40M model),
with the trained draft from models/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import standin
from .corpus import examples

DATA_DIR = Path("jobs/data/legal")
MODEL_DIR = Path("build/demo-models")
SHARDS, ROWS_PER_SHARD = 4, 24


def write_shards(out: Path = DATA_DIR, shards: int = SHARDS, rows: int = ROWS_PER_SHARD) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        ex = examples("demo", rows, offset=s * rows)
        table = pa.table({"doc_id": [e["doc_id"] for e in ex], "kind": [e["kind"] for e in ex],
                          "contract": [e["contract"] for e in ex], "reference": [e["summary"] for e in ex]})
        path = out / f"prompts-{s:04d}.parquet"
        # A shard already as it would be written is left alone: rewritten, its mtime changes, and
        # the next `make demo` refused to run ("input changed for 4 committed shard(s)").
        if not (path.exists() and pq.read_table(path).equals(table)):
            pq.write_table(table, path)
        paths.append(path)
    return paths


def build_demo_model(root: Path = MODEL_DIR) -> Path:
    """A small random-weight Llama with a tokenizer trained on the contract corpus (cached)."""
    from ..testing import build_model, build_tokenizer

    corpus = [e["prompt"] + " " + e["summary"] for e in examples("train", 3000)]
    tok = build_tokenizer(root / "tokenizer", vocab_size=1024, corpus=corpus)
    return build_model(root / "legal-small", "llama", tok, size="small", seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--random-model", action="store_true", help="also build the random-weight small model")
    ap.add_argument("--params", type=standin.parse_params, default=standin.DEFAULT_PARAMS,
                    help="the cost stand-in's size in parameters (default 40M, what jobs/summarize_legal.yaml names)")
    args = ap.parse_args()
    for p in write_shards():
        print(f"input shard {p}")
    standin.main([f"--params={args.params}"])
    if args.random_model:
        print(f"random-weight model {build_demo_model()}")


if __name__ == "__main__":
    main()
