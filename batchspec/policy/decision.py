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
    CANNOT_PAY = "cannot_pay"  # off: not even a draft that is always right would pay
    PROBE = "probe"  # on: no acceptance seen yet; a first look at the default k
    ON = "on"  # on: the cost model predicts a speedup past the threshold
    REPROBE = "reprobe"  # on: off for a while; looks at acceptance again (hf)
    OFF = "off"  # off: the cost model predicts no speedup past the threshold
    CHECKING = "checking"  # on: a remembered "off" checked by this call's own steps (vllm)
    KEPT = "kept"  # what a measuring call kept, from its steps' tokens per second (vllm)
    STOPPED = "stopped"  # off for the rest of a call whose own acceptance stopped paying (vllm)


# How each kind's sentence starts; the rest is the decision's detail.
_PREFIX = {
    DecisionKind.NO_ROWS: "off: ", DecisionKind.MODE_OFF: "off: ", DecisionKind.MODE_ON: "on: ",
    DecisionKind.UNCALIBRATED: "on: ", DecisionKind.MEASURING: "on (measuring): ", DecisionKind.CANNOT_PAY: "off: ",
    DecisionKind.PROBE: "on (probe): ", DecisionKind.ON: "on: ", DecisionKind.REPROBE: "on (re-probe): ",
    DecisionKind.OFF: "off: ", DecisionKind.CHECKING: "on (checking): ", DecisionKind.KEPT: "",
    DecisionKind.STOPPED: "off for the rest of the call: ",
}


@dataclass(frozen=True)
class Alone:
    """What a shard's own decision was, where its rows ran under a decision for a whole call."""

    speculate: bool
    k: int
    predicted_speedup: float | None

    def render(self) -> str:
        on = f"on at k={self.k}" if self.speculate else "off"
        return on + (f", predicted {self.predicted_speedup:.2f}x" if self.predicted_speedup is not None else "")


@dataclass(frozen=True)
class CallShare:
    """The decision was taken for the rows of several shards together (one vllm call)."""

    rows: int
    shards: int
    alone: Alone


@dataclass(frozen=True)
class Look:
    """A probe's short look at acceptance, discarded after: `tokens` new tokens of `rows` rows."""

    tokens: int
    rows: int


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
    # What a call's own steps measured (kept arm, stopped).
    tokens_per_s: dict[str, float] | None = None  # by arm ("4", "0")
    costs_kept: bool | None = None  # the arms ran at matched rows, so their times became costs
    acceptance: float | None = None  # per-token acceptance the steps delivered
    predicted_speedup: float | None = None  # the guard's prediction from that acceptance
    steps: int | None = None  # clean steps at k behind it
    row_passes: int | None = None

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
    call: CallShare | None = None
    remembered: str | None = None  # "job ... at ...": it rests on what that run measured on this node
    rests_on_remembered_acceptance: bool = False  # an "off" for an earlier run's acceptance (vllm checks it)
    look: Look | None = None

    @property
    def probes(self) -> bool:
        """A look at acceptance (a probe or a re-probe): not "on" for the hysteresis that follows it."""
        return self.kind in (DecisionKind.PROBE, DecisionKind.REPROBE)

    def body(self) -> str:
        """The sentence without its kind's prefix and without where its numbers came from."""
        if self.call is None:
            return self.detail
        c = self.call
        return (f"{self.detail}, for the {c.rows} rows of this call's {c.shards} shards together "
                f"(this shard alone: {c.alone.render()})")

    @property
    def reason(self) -> str:
        text = _PREFIX[self.kind] + self.body()
        if self.remembered:
            text += f" (from what {self.remembered} measured on this node)"
        if self.look:
            text += f"; a {self.look.tokens}-token look at {self.look.rows} rows, discarded"
        return text

    def to_json(self) -> dict[str, Any]:
        numbers = self.figures.to_json()
        if self.call is not None:
            numbers.update(call_rows=self.call.rows, call_shards=self.call.shards, alone=asdict(self.call.alone))
        if self.rests_on_remembered_acceptance:
            numbers["remembered_off"] = True
        if self.remembered:
            numbers["remembered"] = self.remembered
        if self.kind is DecisionKind.CHECKING:
            numbers["checking"] = True
        return {"kind": self.kind.value, "speculate": self.speculate, "k": self.k, "reason": self.reason,
                "predicted_speedup": self.predicted_speedup, "alpha": self.alpha, "at_row": self.at_row,
                "numbers": numbers}
