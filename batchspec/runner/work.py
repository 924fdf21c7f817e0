"""A shard's work as it passes between the stages (read, generate, commit): its rows and what
the policy decided and generated for them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..policy import LengthProfile
from .plan import Shard


@dataclass
class RowInput:
    row_index: int
    id: str
    prompt: str | None  # None for error rows
    error: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class ShardWork:
    """A shard between reading and committing: its rows, the policy's decisions, results so far."""

    shard: Shard
    base: dict  # manifest fields known at the start
    attempt: int
    rows_in: int
    rows: list[RowInput]  # every input row, in input order (error rows included)
    valid: list[RowInput]  # rows to generate, shortest prompt first
    read_s: float
    profile: LengthProfile | None = None
    decisions: list = field(default_factory=list)
    results: dict = field(default_factory=dict)  # row_index -> (Completion, Decision, batch size)
    done: int = 0  # rows of `valid` generated so far
    gen_s: float = 0.0  # this shard's share of generation time
    plain_call: tuple[int, int] = (0, 0)  # vllm: one plain call over its actor call's rows, (rows, concurrency)
    calibrate_s: float = 0.0  # cost measurement this shard paid for (the first at a new concurrency)

    def pending_prompt_lengths(self) -> list[int]:
        """Prompt lengths of the rows not yet generated (policy.planner.ShardProgress)."""
        return [len(r.token_ids) for r in self.valid[self.done:]]

    def completion_tokens(self) -> int:
        return sum(o.stats.completion_tokens for o, _, _ in self.results.values())
