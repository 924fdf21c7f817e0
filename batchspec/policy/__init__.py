"""Every speculation decision, as data: the cost model and the policy that applies it (model.py),
the Decision it returns (decision.py), the rules that pick k inside a call (steps.py; interleaved.py:
vLLM's, with plain blocks interleaved between speculative steps), what an actor's calls measured of
their steps (measured.py), and an actor's decisions between and inside its calls (planner.py).
Pure Python: no torch, no Ray, no engine internals (import-linter keeps it so)."""

from .decision import Decision, DecisionKind, Figures
from .interleaved import InterleavedSteps, PromptPrices, StepLine, ratio_interval
from .measured import Saving, StepCosts, streams
from .model import Acceptance, Costs, LengthProfile, Policy, acceptance_for, decode_speedup, expected_tokens
from .planner import ActorPolicy, own_acceptance, tokens_per_step_interval
from .steps import CostModelK

__all__ = ["Acceptance", "ActorPolicy", "CostModelK", "Costs", "Decision", "DecisionKind", "Figures",
           "LengthProfile", "InterleavedSteps", "Policy", "PromptPrices", "StepLine", "acceptance_for", "decode_speedup", "expected_tokens", "own_acceptance", "tokens_per_step_interval",
           "ratio_interval", "Saving", "StepCosts", "streams"]
