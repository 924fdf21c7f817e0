"""batchspec: offline batch LLM generation with per-shard speculative decoding."""

__version__ = "0.1.0"
