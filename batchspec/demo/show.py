"""Print a few demo completions next to their contracts, and where the output is."""

from __future__ import annotations

import sys

import polars as pl


def main(output: str = "out/summarize_legal", data: str = "jobs/data/legal", n: int | str = 3) -> None:
    """n: how many completions to print (a string from the command line)."""
    parts = pl.read_parquet(f"{output}/data")
    inputs = pl.read_parquet(f"{data}/*.parquet")
    joined = parts.join(inputs, left_on="id", right_on="doc_id").sort("id").head(int(n))
    for row in joined.iter_rows(named=True):
        print(f"--- {row['id']} ({row['kind']})\ncontract:   {row['contract'][:160]}...\nreference:  {row['reference']}"
              f"\ncompletion: {row['completion']!r}\n")
    all_rows = parts.join(inputs, left_on="id", right_on="doc_id")
    exact = sum(c is not None and c.strip() == r for c, r in zip(all_rows["completion"], all_rows["reference"]))
    print(f"exact match with the reference summary: {exact} of {all_rows.height}")
    spec_rows = parts.filter(pl.col("spec_enabled"))
    acc = float(spec_rows["accepted_tokens"].sum()) / float(spec_rows["draft_tokens"].sum()) if spec_rows.height else None
    print(f"{parts.height} rows in {output}/data; {spec_rows.height} with speculation on"
          + (f", acceptance {acc:.2f}" if acc is not None else ""))
    from ..reports.output import build_report, to_text

    print(to_text(build_report(output)).splitlines()[1])  # the saving, measured in the run, with its interval
    print(f"the whole report: batchspec report {output}; status: batchspec status {output}")
    print("note: the demo models were trained by this project on synthetic contracts only, and the target runs as "
          "its cost stand-in (the same outputs, the step cost of a ~40M model; docs/demo.md); point model.target at "
          "a real checkpoint for real work")


if __name__ == "__main__":
    main(*sys.argv[1:])
