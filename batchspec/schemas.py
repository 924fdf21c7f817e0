"""The files in schemas/: generated from the code, and kept in sync by a test."""

from __future__ import annotations

import json
from pathlib import Path

JOB_SPEC_FILE = "job-spec.schema.json"
OUTPUT_FILE = "output-v1.schema.json"


def rendered() -> dict[str, str]:
    from .runner.schema import output_schema_json
    from .spec import json_schema

    return {
        JOB_SPEC_FILE: json.dumps(json_schema(), indent=2, sort_keys=True) + "\n",
        OUTPUT_FILE: json.dumps(output_schema_json(), indent=2) + "\n",
    }


def write_schemas(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


def job_spec_reference() -> str:
    """A markdown table of every job-spec field, from the pydantic models (docs/job-spec.md)."""
    from pydantic import BaseModel

    from .spec import JobSpec

    lines = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            ann = f.annotation
            key = f"{prefix}{name}"
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                lines.append(f"| `{key}` | section | | {f.description or ''} |")
                walk(ann, key + ".")
                continue
            default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
            type_name = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "").replace(" | ", " or ")
            lines.append(f"| `{key}` | `{type_name}` | `{default}` | {(f.description or '').replace('|', '/')} |")

    walk(JobSpec, "")
    return "\n".join(lines) + "\n"
