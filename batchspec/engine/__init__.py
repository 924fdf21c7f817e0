"""The generation engine: torch + transformers only (no Ray, pyarrow or fsspec imports at load).

Names load on first use (PEP 562): the driver imports `batchspec.engine.backend` to pick a backend
and must not pay for torch and transformers (~3.5 s) to do it."""

from importlib import import_module

_WHERE = {
    "DRAFT_KINDS": "engine", "Completion": "engine", "DraftSpec": "engine", "Engine": "engine",
    "AdaptiveK": "generate", "BatchResult": "generate", "FixedK": "generate", "GenerationConfig": "generate",
    "RoundTiming": "generate", "RowStats": "generate",
    "ModelLoadError": "models", "load_model": "models",
    "RowRandom": "sampling", "SamplingParams": "sampling", "row_seed": "sampling",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
