"""`batchspec bench`: measure a target/draft pair on this machine, side by side, in one run.

For each batch size, on the same prompts and max_new_tokens, with repetitions interleaved (so
drift in machine load hits every configuration alike):

    batchspec plain | batchspec speculative k=2,4,6 and adaptive | transformers generate |
    transformers assisted generation (assistant_model=, batch 1 only: it refuses larger batches)

Every row reports tokens/s and, for speculative rows, acceptance a (per-token, see policy.py),
mean acceptance length (1 + accepted / rounds, counting the bonus token), the draft cost ratio
c = draft step / target step and the verify cost v = verify(k) / target step measured at that
batch size, the measured speedup over batchspec plain, the speedup the cost model predicts,
(1 - a^(k+1)) / ((1 - a) (k c + v)), and efficiency = measured / predicted.
Rows never stop at EOS, so every configuration generates exactly max_new_tokens per row.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .engine.api import AdaptiveK, FixedK, SamplingParams
from .engine.engine import DraftSpec, Engine, measure_costs
from .engine.generate import GenerationConfig, generate
from .policy import Costs, LengthProfile, Policy, expected_tokens
from .rates import acceptance_rate, mean_acceptance_length, per_token_acceptance
from .runner.checkpoints import cache_root, fetch_prefix


@dataclass
class BenchConfig:
    quick: bool = False
    target: str | None = None
    draft: str = "quantized"
    draft_path: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    max_new_tokens: int = 64
    repeats: int = 2
    ks: tuple[int, ...] = (2, 4, 6)
    show_policy: bool = False
    out: str = "bench.json"
    prompt_words: int = 40
    device: str = "auto"
    dtype: str = "auto"


def default_target(quick: bool) -> str:
    """A locally built Llama: ~104M parameters (tiny for --quick), cached under BATCHSPEC_CACHE."""
    from .testing import build_model, build_tokenizer

    root = cache_root() / "bench"
    tok = build_tokenizer(root / "tokenizer")
    return str(build_model(root / ("llama-tiny" if quick else "llama-104m"), "llama", tok,
                           size="tiny" if quick else "bench", seed=0))


def bench_prompts(n: int, words: int) -> list[str]:
    from .testing import synthetic_text

    lines = synthetic_text(4 * n, seed=123)
    return [" ".join(" ".join(lines[4 * i: 4 * i + 4]).split()[:words]) for i in range(n)]


def run_bench(cfg: BenchConfig, echo: Callable[[str], None] = print) -> dict:
    if cfg.quick:
        cfg.batch_sizes, cfg.max_new_tokens, cfg.repeats, cfg.ks = [1, 2], 8, 1, (2,)
    target = cfg.target or default_target(cfg.quick)
    copies = {s: str(fetch_prefix(s)) for s in (target, cfg.draft_path) if s and s.startswith("s3://")}
    engine = Engine.load(target, DraftSpec(kind=cfg.draft, path=cfg.draft_path), device=cfg.device, dtype=cfg.dtype,
                         local_paths=copies)
    model, tok = engine.target.model, engine.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    where = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else f"{torch.get_num_threads()} threads"
    echo(f"target {target} ({n_params / 1e6:.1f}M parameters, {model.dtype}), draft {engine.draft_source}, "
         f"{where}, max_new_tokens {cfg.max_new_tokens}")
    config = GenerationConfig(cfg.max_new_tokens, SamplingParams(), eos_token_ids=(), pad_token_id=tok.pad_token_id)
    results: list[dict] = []
    policy_rows: list[dict] = []
    failed: list[dict] = []
    for bs in cfg.batch_sizes:
        prompts = bench_prompts(bs, cfg.prompt_words)
        ids = engine.tokenize(prompts)
        costs = measure_costs(engine, bs, ks=tuple(sorted(set(cfg.ks) | {1, 8})))
        runs = _configurations(engine, model, tok, prompts, ids, config, cfg, bs)
        samples: dict[str, list] = {name: [] for name in runs}
        for name, fn in list(runs.items()):  # warm-up, untimed
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a reference library's failure leaves our own rows
                if not name.startswith("transformers"):
                    raise
                failed.append({"batch_size": bs, "config": name, "error": f"{type(e).__name__}: {e}"})
                echo(f"batch {bs}: {name} failed and is left out: {failed[-1]['error'][:200]}")
                del runs[name], samples[name]
        for _ in range(cfg.repeats):
            for name, fn in runs.items():  # interleaved repetitions
                samples[name].append(fn())
        plain = samples["batchspec plain"]
        _count_rows_equal(samples, plain[0]["ids"])
        plain_tps = _tps(plain)
        plain_decode_tps = statistics.median(r["tokens"] / r["decode_s"] for r in plain)
        step_s = statistics.median(r["step_s"] for r in plain)
        for name, reps in samples.items():
            results.append(_row(name, bs, reps, plain_tps, plain_decode_tps, step_s))
        if cfg.show_policy:
            policy_rows.append(_policy_view(costs, results, bs, ids, cfg))
    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "processor": platform.processor() or platform.machine(), "device": str(engine.device),
                          "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
                          "dtype": str(model.dtype)},
              "target": target, "target_params": n_params, "draft": engine.draft_source,
              "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "results": results, "policy": policy_rows,
              "failed": failed}
    Path(cfg.out).write_text(json.dumps(report, indent=2))
    echo(format_table(results))
    for p in policy_rows:
        echo(format_policy(p))
    echo(f"wrote {cfg.out}")
    return report


def _configurations(engine, model, tok, prompts, ids, config, cfg, bs) -> dict[str, Callable[[], dict]]:
    def ours(speculate: bool, rule_factory=None):
        def run():
            proposer = engine.new_proposer() if speculate else None
            t = time.perf_counter()
            res = generate(model, ids, config, proposer, rule_factory() if rule_factory else None)
            wall = time.perf_counter() - t
            spec_rounds = [r for r in res.rounds if r.k]
            return {"wall_s": wall, "tokens": sum(r.stats.completion_tokens for r in res.rows),
                    "ids": [r.token_ids for r in res.rows],
                    "decode_s": wall - res.prefill_s - res.draft_prefill_s,
                    "accepted": sum(t.accepted for t in res.rounds), "proposed": sum(t.proposed for t in res.rounds),
                    "rejections": sum(t.rejections for t in res.rounds),
                    "rounds": sum(r.stats.spec_rounds for r in res.rows) / len(res.rows),
                    "k_mean": statistics.fmean([t.k for t in spec_rounds] or [0]),
                    "draft_step_s": sum(t.draft_s for t in spec_rounds) / max(1, sum(t.k for t in spec_rounds)),
                    "verify_s": statistics.fmean([t.target_s for t in spec_rounds] or [0.0]),
                    "step_s": statistics.fmean([t.target_s for t in res.rounds]) if not spec_rounds else None}
        return run

    enc = tok(prompts, return_tensors="pt", padding=True).to(engine.device)

    def hf(assistant=None):
        def run():
            kw = dict(max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id)
            if assistant is not None:
                kw["assistant_model"] = assistant
            t = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(**enc, **kw)
            wall = time.perf_counter() - t
            return {"wall_s": wall, "tokens": (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)}
        return run

    runs = {"batchspec plain": ours(False)}
    for k in cfg.ks:
        runs[f"batchspec spec k={k}"] = ours(True, lambda k=k: FixedK(k))
    runs["batchspec spec adaptive"] = ours(True, AdaptiveK)
    runs["transformers generate"] = hf()
    if bs == 1 and engine.draft.kind in ("model", "quantized", "layer_skip"):  # a causal LM transformers can assist with
        runs["transformers assisted"] = hf(engine.draft_module)
    return runs


def _count_rows_equal(samples: dict[str, list[dict]], plain_ids: list[list[int]]) -> None:
    """Greedy agreement: in every repetition, how many rows equal batchspec plain's first run token
    for token. In fp32 anything below the batch size is a defect. In bf16 on a GPU, plain decoding
    did not reproduce itself either (docs/engine.md): read a speculative row's count against the
    plain row's, which is its later runs against its first. (Not counted for transformers'
    generate: its min_new_tokens, which keeps rows going to max_new_tokens, masks EOS out of the
    argmax.)"""
    for reps in samples.values():
        for r in reps:
            if "ids" in r:
                r["rows_equal_plain"] = sum(a == b for a, b in zip(r.pop("ids"), plain_ids))


def _tps(reps: list[dict]) -> float:
    # Median of per-repetition throughput: robust to one slow repetition on a shared machine.
    return statistics.median(r["tokens"] / r["wall_s"] for r in reps)


def _row(name: str, bs: int, reps: list[dict], plain_tps: float, plain_decode_tps: float, step_s: float) -> dict:
    """One table row. The prediction uses costs measured in these very runs: the plain run's step
    time t, and the speculative runs' draft time per step and target time per verification, so
    efficiency isolates what the cost model leaves out (per-round bookkeeping, acceptance that is
    not i.i.d.), not calibration error. End-to-end speedup also pays both prefills."""
    tps = _tps(reps)
    row = {"config": name, "batch_size": bs, "tokens_per_s": tps, "speedup_vs_plain": tps / plain_tps,
           "wall_s": [r["wall_s"] for r in reps]}
    if "rows_equal_plain" in reps[0]:
        row["rows_equal_plain"] = min(r["rows_equal_plain"] for r in reps)
    if "proposed" in reps[0] and reps[0]["proposed"]:
        acc = sum(r["accepted"] for r in reps)
        rej = sum(r["rejections"] for r in reps)
        alpha = per_token_acceptance(acc, rej) or 0.0
        k = statistics.fmean(r["k_mean"] for r in reps)
        c = statistics.median(r["draft_step_s"] for r in reps) / step_s
        v = statistics.median(r["verify_s"] for r in reps) / step_s
        predicted = expected_tokens(alpha, k) / (k * c + v)
        decode_speedup = statistics.median(r["tokens"] / r["decode_s"] for r in reps) / plain_decode_tps
        row.update({"k": k, "acceptance_rate": acceptance_rate(acc, sum(r["proposed"] for r in reps)), "alpha": alpha,
                    "mean_acceptance_length": mean_acceptance_length(acc, sum(r["rounds"] * bs for r in reps)),
                    "draft_cost_ratio_c": c, "verify_cost_v": v, "predicted_speedup": predicted,
                    "decode_speedup_vs_plain": decode_speedup, "efficiency": decode_speedup / predicted})
    return row


def _policy_view(costs: dict, results: list[dict], bs: int, ids, cfg: BenchConfig) -> dict:
    policy, measured = Policy("auto", k_default=4), Costs(**costs)
    policy.calibrate(measured)
    spec_rows = [r for r in results if r["batch_size"] == bs and "alpha" in r]
    alpha = statistics.fmean(r["alpha"] for r in spec_rows) if spec_rows else None
    if alpha is not None:
        policy.prior.accepted, policy.prior.trials = alpha * 100, 100
    profile = LengthProfile([len(i) for i in ids], cfg.max_new_tokens)
    d = policy.decide(profile, None)
    return {"batch_size": bs, "costs": costs, "c": measured.c,
            "v": {k: measured.v(k) for k in sorted(costs["verify_s"])}, "alpha": alpha,
            "predicted_by_k": {k: policy.predict(profile, alpha or 1.0, k) for k in range(1, 9)},
            "decision": d.to_json()}


def format_table(results: list[dict]) -> str:
    head = f"{'batch':>5}  {'configuration':<26}{'tok/s':>8}{'vs plain':>9}{'decode':>8}{'alpha':>7}{'mean len':>9}" \
           f"{'k':>5}{'c':>6}{'v':>6}{'pred':>6}{'eff':>6}{'= plain':>9}"
    lines = [head, "-" * len(head)]

    def equal(r):
        return f"{r['rows_equal_plain']}/{r['batch_size']}" if "rows_equal_plain" in r else "-"

    for r in results:
        def f(key, fmt, r=r):
            return format(r[key], fmt) if r.get(key) is not None else "-"
        lines.append(f"{r['batch_size']:>5}  {r['config']:<26}{r['tokens_per_s']:>8.1f}{r['speedup_vs_plain']:>8.2f}x"
                     f"{f('decode_speedup_vs_plain', '.2f'):>8}{f('alpha', '.3f'):>7}{f('mean_acceptance_length', '.2f'):>9}"
                     f"{f('k', '.1f'):>5}{f('draft_cost_ratio_c', '.2f'):>6}"
                     f"{f('verify_cost_v', '.2f'):>6}{f('predicted_speedup', '.2f'):>6}{f('efficiency', '.2f'):>6}"
                     f"{equal(r):>9}")
    return "\n".join(lines)


def format_policy(p: dict) -> str:
    preds = " ".join(f"k={k}:{v:.2f}x" for k, v in p["predicted_by_k"].items())
    v = " ".join(f"v({k})={x:.2f}" for k, x in p["v"].items())
    alpha = f"{p['alpha']:.3f}" if p["alpha"] is not None else "unknown"
    return (f"policy @ batch {p['batch_size']}: c={p['c']:.3f} {v} acceptance {alpha}\n"
            f"  predicted shard speedup {preds}\n  auto decides: {p['decision']['reason']}")
