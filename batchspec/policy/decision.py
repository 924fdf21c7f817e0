"""A decision is data: a kind, on/off and k, the figures it rests on, and what it was taken for.
The sentence a person reads (`reason`, in manifests, logs and reports) is rendered from it, and
code never reads that sentence back: it asks `kind` and the typed fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class DecisionKind(StrEnum):
    """What a decision is, by what it rests on. The value is written to manifests ("kind")."""

    NO_ROWS = "no_rows"  # off: the shard has no valid rows
    MODE_OFF = "mode_off"  # off: speculation.mode is off
    MODE_ON = "mode_on"  # on: speculation.mode is on
    UNCALIBRATED = "uncalibrated"  # on: no costs and none to be measured, so the default
    MEASURING = "measuring"  # on: the call times its own plain and speculative steps (vllm)
    LOOK = "look"  # on: a sample of the shard's rows measures its own acceptance at k (vllm)
    LOOK_PLAIN = "look_plain"  # off: a wave of rows runs plain on the engine without speculation (vllm, two engines)
    CANNOT_PAY = "cannot_pay"  # off: not even a draft that is always right would pay
    PROBE = "probe"  # on: no acceptance seen yet; a first look at the default k
    ON = "on"  # on: the cost model predicts a speedup past the threshold
    REPROBE = "reprobe"  # on: off for a while; looks at acceptance again (hf)
    OFF = "off"  # off: the cost model predicts no speedup past the threshold
    STOPPED = "stopped"  # off for the rest of a call whose own steps show speculation slower (vllm)


# How each kind's sentence starts; the rest is the decision's detail.
_PREFIX = {
    DecisionKind.NO_ROWS: "off: ", DecisionKind.MODE_OFF: "off: ", DecisionKind.MODE_ON: "on: ",
    DecisionKind.UNCALIBRATED: "on: ", DecisionKind.MEASURING: "on (measuring): ", DecisionKind.LOOK: "on (look): ",
    DecisionKind.LOOK_PLAIN: "off (look): ", DecisionKind.CANNOT_PAY: "off: ",
    DecisionKind.PROBE: "on (probe): ", DecisionKind.ON: "on: ", DecisionKind.REPROBE: "on (re-probe): ",
    DecisionKind.OFF: "off: ", DecisionKind.STOPPED: "off for the rest of the call: ",
}


@dataclass(frozen=True)
class Figures:
    """The figures a decision rests on; None where a kind has none. Written to manifests as
    `numbers` (only the figures present)."""

    # The cost model's inputs (the policy's decisions once costs are known).
    c: float | None = None  # draft step / target step
    v_k: float | None = None  # verify(k) / target step, at the default k
    batch_size: int | None = None  # the concurrency the costs were measured at
    rows: int | None = None  # rows profiled; for a call's own decisions, rows the call ran
    prompt_p50: float | None = None
    prompt_p90: float | None = None
    expected_new_tokens: float | None = None
    k: int | None = None  # the best k at the acceptance known (also when off); a call's: the k it measured
    # What the shard's own rows and the interleaved steps measured (vllm).
    look_rows: int | None = None  # rows of the shard whose verify steps gave its acceptance
    tokens_per_step: float | None = None  # tokens a row emitted per verify step, over those rows
    clean_steps: int | None = None  # clean steps behind the step lines, of the arm with fewer
    step_ratio: float | None = None  # a step at k over a plain step, at this concurrency (from the step lines)
    step_ratio_interval: tuple[float, float] | None = None  # its 95% interval
    predicted_own: float | None = None  # predicted speedup at the shard's own acceptance, whatever the kind
    speedup_interval: tuple[float, float] | None = None  # measured tokens/s ratio, 95% interval (stopped)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Decision:
    kind: DecisionKind
    speculate: bool
    k: int
    detail: str  # the sentence after the kind's prefix, composed from the figures when decided
    predicted_speedup: float | None = None
    alpha: float | None = None
    at_row: int = 0  # rows of the shard already generated when this decision was taken
    figures: Figures = field(default_factory=Figures)
    remembered: str | None = None  # "job ... at ...": it rests on what that run measured on this node

    @property
    def probes(self) -> bool:
        """A look at acceptance (a probe or a re-probe): not "on" for the hysteresis that follows it."""
        return self.kind in (DecisionKind.PROBE, DecisionKind.REPROBE)

    def body(self) -> str:
        """The sentence without its kind's prefix and without where its numbers came from."""
        return self.detail

    @property
    def reason(self) -> str:
        text = _PREFIX[self.kind] + self.body()
        if self.remembered:
            text += f" (from what {self.remembered} measured on this node)"
        return text

    def to_json(self) -> dict[str, Any]:
        numbers = self.figures.to_json()
        if self.remembered:
            numbers["remembered"] = self.remembered
        return {"kind": self.kind.value, "speculate": self.speculate, "k": self.k, "reason": self.reason,
                "predicted_speedup": self.predicted_speedup, "alpha": self.alpha, "at_row": self.at_row,
                "numbers": numbers}
