"""The generation engine: torch + transformers only (no Ray, pyarrow or fsspec imports at load)."""

from .engine import DRAFT_KINDS, Completion, DraftSpec, Engine
from .generate import AdaptiveK, BatchResult, FixedK, GenerationConfig, RoundTiming, RowStats, generate
from .models import ModelLoadError, load_model
from .sampling import RowRandom, SamplingParams, row_seed

__all__ = [
    "DRAFT_KINDS", "AdaptiveK", "BatchResult", "Completion", "DraftSpec", "Engine", "FixedK", "GenerationConfig",
    "ModelLoadError", "RoundTiming", "RowRandom", "RowStats", "SamplingParams", "generate", "load_model", "row_seed",
]
