"""The one seam between the runner/policy and a generation engine: a Backend Protocol and the flat
value types that cross it. Rows go in as token ids; completions with raw per-row counters
(RowStats) come out, with what the call measured (BatchResult.rounds) for the policy.

Both backends implement Backend: batchspec's own engine (engine.Engine, "hf") and vLLM
(vllm_backend.VLLMBackend, "vllm"). The runner and the policy import this module only, never a
backend's internals. Pure Python: importing it costs no torch (the driver and `--help` use it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol


class ModelLoadError(RuntimeError):
    """The model or tokenizer could not be loaded; the message says what to check."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def row_seed(job_seed: int, row_key: str) -> int:
    """A row's seed from the job seed and a stable row key (its id), independent of batching."""
    digest = hashlib.sha256(f"{job_seed}:{row_key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class RowStats:
    """Raw per-row counters. Rates are derived in one place (batchspec/rates.py):
    acceptance_rate = accepted / draft_tokens; mean acceptance length (tokens per target pass,
    counting the bonus token) = 1 + accepted / spec_rounds."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # proposed by the draft for this row
    accepted_tokens: int = 0  # of those, accepted by the target and emitted
    spec_rounds: int = 0  # target passes in which this row verified at least one draft token
    rejections: int = 0  # of those, passes cut short by a rejected draft token (policy's acceptance trials)
    ttft_s: float = 0.0  # batch start -> first token of this row
    latency_s: float = 0.0  # batch start -> this row finished
    finish_reason: str = "length"  # stop | length | error


@dataclass
class RowOutput:
    token_ids: list[int]  # generated ids, including a final EOS or the token completing a stop string
    stats: RowStats
    stop_string: str | None = None  # the stop string that ended the row, if any


@dataclass
class RoundTiming:
    """One round of the batch, for cost calibration (policy) and the adaptive draft length."""

    batch_size: int
    k: int
    draft_s: float
    target_s: float
    proposed: int
    accepted: int
    rejections: int = 0  # rows whose draft was cut short by a rejection (acceptance trials that failed)


@dataclass
class BatchResult:
    """What one call measured. rows: the hf engine's raw outputs (the vllm backend leaves it empty)."""

    rows: list[RowOutput]
    rounds: list[RoundTiming] = field(default_factory=list)
    prefill_s: float = 0.0  # target prefill and first token
    draft_prefill_s: float = 0.0  # the draft's own prefill (0 without a model draft)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    stats: RowStats
    error: str | None = None  # set when the backend could not generate this row (it becomes an error row)


class DraftLength(Protocol):
    """Chooses k for the next round and learns from each round's outcome (hf: every round)."""

    def next_k(self) -> int: ...
    def observe(self, timing: RoundTiming) -> None: ...


@dataclass
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, timing: RoundTiming) -> None:
        pass


@dataclass
class AdaptiveK:
    """Default rule, in the spirit of transformers' assisted-generation heuristic but batch-aware:
    grow k by one after a round where at least 90% of proposed tokens were accepted, shrink by one
    when fewer than 50% were. Cheap, no calibration, and k settles near the length at which the
    draft usually fails. (The per-shard policy can substitute a cost-model rule.)"""

    k: int = 4
    k_min: int = 1
    k_max: int = 10

    def next_k(self) -> int:
        return self.k

    def observe(self, timing: RoundTiming) -> None:
        if timing.proposed == 0:
            return
        rate = timing.accepted / timing.proposed
        if rate >= 0.9:
            self.k = min(self.k + 1, self.k_max)
        elif rate < 0.5:
            self.k = max(self.k - 1, self.k_min)


class StepRule(Protocol):
    """Chooses k before every engine step and is told what each step cost (vllm: policy.InterleavedSteps); `settled`: k
    stays where it is to the call's end, so a plain call may skip its draft."""

    settled: bool

    def next_k(self) -> int: ...
    def observe_step(self, k: int, seconds: float, tokens: int, rows: int, prefill: bool, draft_s: float = 0.0,
                     decode_tokens: int = 0, prompt_tokens: int = 0, decode_rows: int = 0) -> None: ...


class Backend(Protocol):
    """What the runner needs of an engine. Where the two backends differ, they say so here, as
    data the runner reads, not as types it checks."""

    name: str  # "hf" | "vllm"
    tokenizer: Any  # a transformers tokenizer (chat templates are applied by the runner)
    max_context: int  # tokens a row may hold, prompt and completion together
    context_note: str  # why max_context is below the model's own ("" when it is not)
    draft_kind: str
    target_source: str
    draft_source: str | None
    # True: a call takes a whole shard and the engine batches it (vllm's continuous batching);
    # False: the runner cuts micro-batches of resources.batch_size and re-decides between them.
    whole_shard_calls: bool
    max_batch: int | None  # rows the engine runs at once (vLLM's max_num_seqs); None: all of a call's rows
    per_round_k: bool  # a DraftLength rule sees every round (hf); else k is set per call or per step
    learns_costs: bool  # the policy's costs come from the steps of real calls (a StepRule), not a calibration
    separate_plain: bool  # calls at k = 0 run on an engine without speculation, whose steps time the plain arm

    def tokenize(self, prompts: list[str]) -> list[list[int]]: ...

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), stop: tuple[str, ...] = (),
                 seeds: list[int] | None = None, speculate: bool = True,
                 draft_length: DraftLength | StepRule | int | None = None,
                 max_new_per_row: list[int] | None = None) -> tuple[list[Completion], BatchResult]: ...

    def measure_costs(self, batch_size: int, sample: list[list[int]] | None = None) -> dict[str, Any]:
        """The policy's costs (policy.Costs fields) measured at this concurrency."""
        ...
