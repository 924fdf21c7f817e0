"""The output row's schema, version 1 (also schemas/output-v1.schema.json; a test keeps both in sync)."""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

OUTPUT_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),
    pa.field("row_index", pa.int64(), nullable=False),
    pa.field("completion", pa.string()),  # null for error rows
    pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
    pa.field("error", pa.string()),  # why the row is an error row, else null
    pa.field("prompt_tokens", pa.int32(), nullable=False),
    pa.field("completion_tokens", pa.int32(), nullable=False),
    pa.field("spec_enabled", pa.bool_(), nullable=False),
    pa.field("draft_kind", pa.string()),  # null when speculation is off for the row
    pa.field("num_speculative_tokens", pa.int32()),  # k the shard's policy chose; null when off
    pa.field("draft_tokens", pa.int32(), nullable=False),  # proposed
    pa.field("accepted_tokens", pa.int32(), nullable=False),
    pa.field("spec_rounds", pa.int32(), nullable=False),
    pa.field("acceptance_rate", pa.float64()),  # accepted / draft tokens; null when off
    pa.field("ttft_s", pa.float64(), nullable=False),
    pa.field("latency_s", pa.float64(), nullable=False),
    pa.field("batch_size", pa.int32(), nullable=False),
    pa.field("attempt", pa.int32(), nullable=False),
    pa.field("worker", pa.string(), nullable=False),
    pa.field("target_model", pa.string(), nullable=False),
    pa.field("draft_model", pa.string()),
    pa.field("prompt_sha256", pa.string()),  # null when the prompt could not be read
], metadata={"batchspec.schema_version": str(SCHEMA_VERSION)})


def output_schema_json() -> dict:
    """OUTPUT_SCHEMA as a small JSON document (what schemas/output-v1.schema.json holds)."""
    return {
        "title": "batchspec output row",
        "version": SCHEMA_VERSION,
        "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in OUTPUT_SCHEMA],
    }
