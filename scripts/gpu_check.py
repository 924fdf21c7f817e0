"""The GPU check: batchspec's hf engine on CUDA, with a target of over 1B parameters, bf16 and fp32.

Run it where there is a GPU (for this project: the device tool's H200, whose image has torch and
transformers but neither Ray nor vLLM, so only the engine is checked there):

    python scripts/gpu_check.py --out gpu-check          # about 6 minutes on an H200
    python scripts/gpu_check.py --out /tmp/gc --size small --device cpu --budget-s 300   # smoke test

Each step runs on its own, so one that fails leaves the others' results, and a step that would
start after --budget-s is skipped with a line saying so:

1. The engine's tests on CUDA: tests/test_engine.py, test_verify.py and test_learned.py, less the
   ones that need Ray or an S3 server. Engine.load's device and dtype "auto" put them on the GPU
   in bf16.
2. A pair: a 1.06B random Llama target (24 layers, hidden 2048; testing.SIZES["1b"]) and a draft
   model cut from it: its embeddings, first 2 layers, final norm and head (0.10B), saved as its
   own checkpoint. The target's layers 2-23 write into the residual stream at 0.03 of their random
   initial size, which puts the draft's greedy agreement with the target near 0.8 (measured
   teacher-forced in fp32; at full size a random draft agrees on about 1% of tokens).
3. `batchspec bench` on that pair, 128 new tokens per row, k=4 and adaptive k against plain
   decoding and transformers' generate: bf16 at batch 1, 16 and 64; fp32 at batch 16; the
   quantized self-draft (torchao int8 weight-only, the target's own weights) in bf16.
   Every batchspec row counts the rows whose greedy tokens equal plain decoding's.

Writes DIR/summary.md (the tables), DIR/bench-*.json, DIR/pytest.log and DIR/env.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TAIL_SCALE = 0.03
DRAFT_LAYERS = 2


def build_pair(root: Path, size: str) -> tuple[Path, Path]:
    """The target (layers past DRAFT_LAYERS damped to TAIL_SCALE) and the draft cut from it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchspec.testing import _sharpen, build_tokenizer, damp_layers, model_config

    target_dir, draft_dir = root / f"llama-{size}-target", root / f"llama-{size}-draft"
    if (target_dir / "config.json").exists() and (draft_dir / "config.json").exists():
        return target_dir, draft_dir
    tok = AutoTokenizer.from_pretrained(build_tokenizer(root / "tokenizer"))
    config = model_config("llama", len(tok), size=size, tokenizer=tok)
    torch.manual_seed(0)
    # Random init of 1B parameters takes a while on a CPU; on the GPU it is instant.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        target = AutoModelForCausalLM.from_config(config)
    _sharpen(target)
    damp_layers(target, DRAFT_LAYERS, TAIL_SCALE)
    target.to(torch.bfloat16).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    config.num_hidden_layers = DRAFT_LAYERS
    draft = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    draft.save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    for d, what in ((target_dir, "target"), (draft_dir, f"draft: the target's first {DRAFT_LAYERS} layers")):
        (d / "README.md").write_text(f"Random-weight Llama ({size}) built by scripts/gpu_check.py, {what}. "
                                     "Its text is meaningless.\n")
    del target, draft
    return target_dir, draft_dir


def determinism(target: Path, device: str, max_new_tokens: int, say) -> None:
    """Plain greedy decoding of the same 16 rows, three times in one process: how many rows equal
    the first run's; then 4 of the rows decoded alone, against the same rows in the batch. In bf16
    with torch's defaults, with its deterministic algorithms on, and with attention on SDPA's math
    kernel (the GPU's flash or cuDNN attention kernels out of the way), then fp32.

    On the H200 (2026-11-30), bf16 did not reproduce itself (9-11 of 16 rows), with cuBLAS's
    reduced-precision reductions on or off; fp32 did (16/16). The other two variants were added
    after that run, to be tried next."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from batchspec.bench import bench_prompts
    from batchspec.engine import DraftSpec, Engine

    variants = (("bf16", "defaults", False, False), ("bf16", "deterministic algorithms", True, False),
                ("bf16", "math attention", False, True), ("float32", "defaults", False, False))
    for dtype, label, deterministic, math_attention in variants:
        # warn_only: a kernel without a deterministic version warns instead of stopping the step.
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        with sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext():
            engine = Engine.load(str(target), DraftSpec(kind="none"), device=device, dtype=dtype)
            ids = engine.tokenize(bench_prompts(16, 40))
            runs = [[o.token_ids for o in engine.generate(ids, max_new_tokens=max_new_tokens, speculate=False)[0]]
                    for _ in range(3)]
            alone = [engine.generate([ids[i]], max_new_tokens=max_new_tokens, speculate=False)[0][0].token_ids
                     for i in range(4)]
        equal = [sum(a == b for a, b in zip(r, runs[0])) for r in runs[1:]]
        same_alone = sum(a == runs[0][i] for i, a in enumerate(alone))
        say(f"{dtype}, {label}: runs 2 and 3 equal run 1 on {equal[0]}/16 and {equal[1]}/16 rows; "
            f"rows decoded alone equal the batch on {same_alone}/4")
        del engine
    torch.use_deterministic_algorithms(False)


def run_pytest(out: Path, timeout_s: int, select: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
           "tests/test_engine.py", "tests/test_verify.py", "tests/test_learned.py", "-k", select]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        text, tail = p.stdout + p.stderr, f"exit {p.returncode}"
    except subprocess.TimeoutExpired as e:
        text, tail = f"{e.stdout or ''}{e.stderr or ''}", f"stopped after {timeout_s} s"
    (out / "pytest.log").write_text(text)
    last = [line for line in text.splitlines() if line.strip()][-1:] or [""]
    return f"{' '.join(cmd[3:])}: {tail}; {last[0]}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--size", default="1b", help='testing.SIZES key of the target ("small" for a smoke test)')
    ap.add_argument("--device", default="auto")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip steps that would start after this")
    ap.add_argument("--models", default=None, help="where to build the pair (default: OUT/../gpu-check-models)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", default="tests,bench-bf16,bench-fp32,bench-quantized,determinism")
    ap.add_argument("--tests", default="not s3 and not a_job_runs and not validate",
                    help="pytest -k expression (the default leaves out what needs Ray, an S3 server or pydantic)")
    args = ap.parse_args()

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.models) if args.models else out.resolve().parent / "gpu-check-models"
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)
        (out / "summary.md").write_text("\n".join(lines) + "\n")

    def step(name: str, reserve_s: float, fn, key: str | None = None) -> None:
        if key is not None and key not in args.steps.split(","):
            return
        elapsed = time.perf_counter() - start
        if elapsed + reserve_s > args.budget_s:
            say(f"\n## {name}\nskipped: {elapsed:.0f} s gone, this step needs about {reserve_s:.0f} s "
                f"of the {args.budget_s:.0f} s budget")
            return
        say(f"\n## {name}")
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # one failed step must leave the others' results
            say("FAILED:\n```\n" + traceback.format_exc() + "```")
        say(f"({time.perf_counter() - t:.0f} s)")

    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        import torchao
        env["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001 - recorded, the quantized step then says why it fails
        env["torchao"] = f"not importable: {e}"
    (out / "env.json").write_text(json.dumps(env, indent=2))
    say(f"# GPU check\n\n{json.dumps(env)}")

    device = args.device
    step("Engine tests on the device (auto device and dtype)", 120,
         lambda: say(run_pytest(out, int(min(150, args.budget_s / 3)), args.tests)), "tests")

    pair: dict[str, Path] = {}

    def build() -> None:
        pair["target"], pair["draft"] = build_pair(models, args.size)
        say(f"target {pair['target']}, draft {pair['draft']}")

    step(f"Pair: {args.size} target, {DRAFT_LAYERS}-layer draft cut from it", 60, build)
    if not pair:
        return 1

    from batchspec.bench import BenchConfig, format_policy, format_table, run_bench

    def bench(name: str, draft: str, dtype: str, batch_sizes: list[int]) -> None:
        cfg = BenchConfig(target=str(pair["target"]), draft=draft,
                          draft_path=str(pair["draft"]) if draft == "model" else None,
                          batch_sizes=batch_sizes, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                          ks=(4,), show_policy=True, out=str(out / f"bench-{name}.json"), device=device, dtype=dtype)
        report = run_bench(cfg, echo=lambda _: None)
        for f in report["failed"]:
            say(f"batch {f['batch_size']}: {f['config']} failed and is left out: {f['error'][:300]}")
        say(f"{report['target_params'] / 1e9:.2f}B target, draft {report['draft']}, {report['machine']['dtype']}, "
            f"{report['machine']['gpu'] or report['machine']['device']}, {args.max_new_tokens} new tokens, "
            f"median of {args.repeats} interleaved repetitions\n\n```\n{format_table(report['results'])}\n```")
        for p in report["policy"]:
            say("```\n" + format_policy(p) + "\n```")
        if device == "auto" and torch.cuda.is_available():
            say(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    step("Plain decoding, run to run and row alone vs in a batch", 60,
         lambda: determinism(pair["target"], device, args.max_new_tokens, say), "determinism")
    step("bench: model draft, bf16, batch 1/16/64", 150, lambda: bench("model-bf16", "model", "bf16", [1, 16, 64]),
         "bench-bf16")
    step("bench: model draft, fp32, batch 16", 60, lambda: bench("model-fp32", "model", "float32", [16]), "bench-fp32")
    step("bench: quantized self-draft (int8 weight-only), bf16, batch 1/16", 90,
         lambda: bench("quantized-bf16", "quantized", "bf16", [1, 16]), "bench-quantized")
    say(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
