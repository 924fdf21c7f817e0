"""batchspec: offline batch LLM generation with per-shard speculative decoding.

    import batchspec
    run = batchspec.submit("jobs/summarize_legal.yaml", params={"ds": "2026-12-05"})

The API (batchspec/api.py, docs/api.md) loads on first use: `import batchspec` imports neither
Ray nor torch nor pydantic.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("submit", "rerun", "status", "report", "distill", "load_job", "Run", "Outcome")
_ERRORS = {"BatchspecError": "errors", "SpecError": "spec", "JobRefused": "runner.outcome", "PlanError": "runner.plan",
           "LeaseLost": "runner.lease", "JobInterrupted": "runner.outcome", "DistillError": "training"}
__all__ = [*_API, *_ERRORS, "__version__"]


def __getattr__(name: str) -> Any:
    import importlib

    if name in _API:
        return getattr(importlib.import_module(".api", __name__), name)
    if name in _ERRORS:
        return getattr(importlib.import_module(f".{_ERRORS[name]}", __name__), name)
    raise AttributeError(f"module 'batchspec' has no attribute {name!r}")
