"""A draft checked before use: held-out rows generated with speculation at the job's k, on the
engine the job ran on, with the job's generation settings; acceptance summed per input group.

Not a training metric: the engine's own counters (docs/engine.md) give per-token acceptance
(accepted / (accepted + rejections), the policy's alpha) and mean acceptance length (tokens per
target pass). The rows' completions come back too, and for a greedy job each must equal what the
output holds for the row (speculation is exact): a difference is reported, never hidden.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any

from ..engine.api import SamplingParams, row_seed
from ..engine.backend import load_backend
from ..rates import acceptance_rate, mean_acceptance_length, per_token_acceptance
from ..spec import JobSpec
from .rows import Row


def with_draft(spec: JobSpec, kind: str, path: str | None) -> Any:
    """The job's model section with this draft (and no plain engine beside it: every call here
    speculates)."""
    draft = spec.model.draft.model_copy(update={"kind": kind, "path": path})
    return spec.model.model_copy(update={"draft": draft, "vllm_plain_engine": False})


def measure(spec: JobSpec, backend: str, kind: str, draft: str | None, rows: list[Row],
            local_paths: dict[str, str] | None = None) -> dict[str, Any]:
    """{'groups': {group: figures}, 'all': figures, 'differs_from_output': n} for `rows` under the draft."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would bury the command's own
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # and stdout is the command's (--json)
    g, k = spec.generation, spec.speculation.num_speculative_tokens
    sampling = SamplingParams(g.temperature, g.top_k, g.top_p)
    engine = load_backend(backend, with_draft(spec, kind, draft), k_default=k, sampled=not sampling.greedy,
                          local_paths=local_paths, plain_calls=False)
    try:
        ids = engine.tokenize([r.prompt for r in rows])
        per_call = len(rows) if engine.whole_shard_calls else spec.resources.batch_size
        sums: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        differs = 0
        for b in range(0, len(rows), per_call):
            chunk = rows[b: b + per_call]
            completions, _ = engine.generate(ids[b: b + per_call], g.max_new_tokens, sampling, tuple(g.stop),
                                             [row_seed(g.seed, r.id) for r in chunk], speculate=True, draft_length=k)
            for r, c in zip(chunk, completions):
                differs += sampling.greedy and c.text != r.completion
                for s in (sums[r.group], sums["\0all"]):
                    s["rows"] += 1
                    for f in ("accepted_tokens", "draft_tokens", "spec_rounds", "rejections", "completion_tokens"):
                        s[f] += getattr(c.stats, f)
    finally:
        del engine
        gc.collect()
    figures = {name: _figures(s) for name, s in sums.items()}
    return {"groups": {n: f for n, f in sorted(figures.items()) if n != "\0all"},
            "all": figures.get("\0all", _figures({})), "differs_from_output": differs}


def _figures(s: dict[str, int]) -> dict[str, Any]:
    return {"rows": s.get("rows", 0), "completion_tokens": s.get("completion_tokens", 0),
            "per_token_acceptance": per_token_acceptance(s.get("accepted_tokens", 0), s.get("rejections", 0)),
            "mean_acceptance_length": mean_acceptance_length(s.get("accepted_tokens", 0), s.get("spec_rounds", 0)),
            "acceptance_rate": acceptance_rate(s.get("accepted_tokens", 0), s.get("draft_tokens", 0))}


def verdict(before: dict[str, Any], after: dict[str, Any], gain: float = 0.02, loss: float = 0.02) -> list[str]:
    """Why the new draft must not be used ([] when it may): mean acceptance length up by less than
    `gain` over all held-out rows, or down by more than `loss` in any group."""
    why = []
    b, a = before["all"]["mean_acceptance_length"], after["all"]["mean_acceptance_length"]
    if not b or not a or a < b * (1 + gain):
        why.append(f"held-out mean acceptance length {_f(b)} -> {_f(a)}, less than +{gain:.0%}")
    for group, fb in before["groups"].items():
        gb, ga = fb["mean_acceptance_length"], after["groups"].get(group, {}).get("mean_acceptance_length")
        if gb and (not ga or ga < gb * (1 - loss)):
            why.append(f"group {group}: mean acceptance length {_f(gb)} -> {_f(ga)}, down more than {loss:.0%}")
    return why


def _f(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
