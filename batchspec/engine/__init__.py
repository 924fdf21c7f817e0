"""The generation engine: torch + transformers only (no Ray, pyarrow or fsspec imports at load).

Names load on first use (PEP 562): the driver imports `batchspec.engine.backend` to pick a backend
and must not pay for torch and transformers (~3.5 s) to do it."""

from importlib import import_module

_WHERE = {
    "DRAFT_KINDS": "engine", "DraftSpec": "engine", "Engine": "engine",
    "Backend": "api", "BatchResult": "api", "Completion": "api", "RoundTiming": "api", "RowStats": "api",
    "SamplingParams": "api", "row_seed": "api",
    "AdaptiveK": "api", "FixedK": "api", "GenerationConfig": "generate",
    "ModelLoadError": "api", "load_model": "models",
    "RowRandom": "sampling",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
