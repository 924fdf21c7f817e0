"""The cost stand-in: the trained demo target made as expensive as a larger model, outputs unchanged.

    python -m batchspec.demo.standin                       # build/demo-models/legal-target-40m (make demo)
    python -m batchspec.demo.standin --params 100M --out build/demo-models/legal-target-100m

Why it exists: the demo target has 2.76M parameters, so one of its decode steps is mostly fixed
overhead (Python, kernel launches, scheduling), and a draft step costs nearly as much as a target
step. Speculation cannot pay on such a target whatever the acceptance, and a policy judged on it
is judged on noise. The stand-in keeps the trained target's three layers and appends layers whose
output projections (attention `o_proj`, MLP `down_proj`) are zero. Each appended layer still does
all of a real layer's work (norms, q/k/v and gate/up projections, rotary embedding, attention over
its own KV cache, the activation, both output projections), but adds exactly 0.0 to the residual
stream, so the final hidden state, and with it every logit, is bit for bit the small target's.

Why appended layers rather than a wider MLP: a wider MLP with zero down-projection columns changes
the length of down_proj's reduction, and a matmul may sum a longer reduction in another order, so
the logits could move in the last bit. `x + 0.0 == x` holds exactly in every float format, whatever
the kernel. Appended layers also model how a real model's step grows: with depth, each layer
carrying its own KV cache, so a long context costs more per step as it does in a real model.
What it does not model: a real model's wider matmuls (here 256 wide) are more arithmetic per
launched kernel, so on a GPU, where launches dominate small layers, this stand-in over-weights
per-layer overhead; on this CPU a step of it costs about what a ~40M dense model's does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

SOURCE = Path("models/legal-target")
DEFAULT_PARAMS = 40_000_000
STAMP = "batchspec_standin.json"  # what built it; a build with the same stamp is left alone
# Files copied unchanged from the source checkpoint (the tokenizer and templates are the target's).
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def default_out(params: int = DEFAULT_PARAMS) -> Path:
    return Path("build/demo-models") / f"legal-target-{round(params / 1e6)}m"


def parse_params(text: str) -> int:
    """'40M', '40m', '1.5B' or '40000000' -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count such as 40M, 0.1B or 40000000")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def layer_params(config: dict) -> int:
    """Weights of one Llama decoder layer: q, k, v, o projections, gate/up/down, two norms."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = o = hidden * config["num_attention_heads"] * head_dim
    kv = 2 * hidden * config["num_key_value_heads"] * head_dim
    return q + o + kv + 3 * hidden * inter + 2 * hidden


def _source_digest(source: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((source / name).read_bytes())
    return h.hexdigest()[:16]


def build(params: int = DEFAULT_PARAMS, out: Path | None = None, source: Path = SOURCE, seed: int = 0) -> Path:
    """Write the stand-in checkpoint (idempotent: an existing build of the same source and size is kept)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = out or default_out(params)
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{source}: the stand-in appends Llama layers; this is a {config.get('model_type')!r}")
    base_layers = config["num_hidden_layers"]
    weights = load_file(str(source / "model.safetensors"))
    base = sum(t.numel() for t in weights.values())
    extra = max(0, round((params - base) / layer_params(config)))
    total = base + extra * layer_params(config)
    stamp = {"source_sha256": _source_digest(source), "appended_layers": extra,
             "seed": seed, "parameters": total}
    if (out / STAMP).exists() and json.loads((out / STAMP).read_text()) == stamp:
        return out  # rewriting it would change nothing but the files' times
    # 1. The appended layers: real random weights where a layer computes, zeros where it writes back.
    gen = torch.Generator().manual_seed(seed)
    std = config.get("initializer_range", 0.02)
    template = {k.split(".", 3)[3]: t for k, t in weights.items() if k.startswith("model.layers.0.")}
    for i in range(base_layers, base_layers + extra):
        for name, t in template.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                new = torch.zeros_like(t)  # adds exactly 0.0 to the residual stream
            elif name.endswith("layernorm.weight"):
                new = torch.ones_like(t)
            else:
                new = torch.randn(t.shape, generator=gen, dtype=t.dtype) * std
            weights[f"model.layers.{i}.{name}"] = new
    # 2. Write the checkpoint beside a copy of the target's tokenizer files and the stamp.
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: t.contiguous() for k, t in weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": base_layers + extra}, indent=2))
    for name in COPIED:
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2))
    (tmp / "README.md").write_text(
        f"# Cost stand-in for {source}\n\nBuilt by `python -m batchspec.demo.standin` (docs/demo.md): the trained "
        f"target's {base_layers} layers plus {extra} appended layers whose o_proj and down_proj are zero, "
        f"{total / 1e6:.1f}M parameters. Greedy output is identical to {source}'s; a step costs "
        "what a model of this size does. Not a model of its own: never train or publish it.\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # whole or not at all: a build cut off half-way leaves only the .tmp folder
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=parse_params, default=DEFAULT_PARAMS,
                    help="the stand-in's size in parameters, e.g. 40M (default) or 0.1B")
    ap.add_argument("--out", type=Path, help="where to write it (default build/demo-models/legal-target-<size>m)")
    ap.add_argument("--source", type=Path, default=SOURCE, help="the trained Llama target to extend")
    args = ap.parse_args(argv)
    out = build(args.params, args.out, args.source)
    stamp = json.loads((out / STAMP).read_text())
    print(f"cost stand-in {out}: {stamp['parameters'] / 1e6:.1f}M parameters "
          f"({stamp['appended_layers']} zero-output layers appended to {args.source})")


if __name__ == "__main__":
    main()
