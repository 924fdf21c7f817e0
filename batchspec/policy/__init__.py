"""Every speculation decision, as data: the cost model and the policy that applies it (model.py),
the Decision it returns (decision.py), the step rules that pick k inside a call (steps.py), and
an actor's decisions between and inside its calls (planner.py).
Pure Python: no torch, no Ray, no engine internals (import-linter keeps it so)."""

from .decision import Alone, CallShare, Decision, DecisionKind, Figures, Look
from .model import Acceptance, Costs, LengthProfile, Policy, acceptance_for, decode_speedup, expected_tokens
from .planner import ActorPolicy
from .steps import CostModelK, StepArms

__all__ = ["Acceptance", "ActorPolicy", "Alone", "CallShare", "CostModelK", "Costs", "Decision", "DecisionKind", "Figures",
           "LengthProfile", "Look", "Policy", "StepArms", "acceptance_for", "decode_speedup", "expected_tokens"]
