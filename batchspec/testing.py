"""Tiny local models and a locally built tokenizer, for tests, benchmarks and the demo.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on text generated
below, and the models are random-weight Hugging Face checkpoints written with
`save_pretrained`, so every consumer goes through the real `from_pretrained` loading path.

    tok_dir = build_tokenizer(tmp / "tok")
    target = build_model(tmp / "llama", family="llama", tokenizer_dir=tok_dir, seed=0)
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# Words for the tokenizer's training text: legal-flavoured English plus digits and punctuation,
# so the demo's contracts and the tests' prompts tokenize into a realistic number of tokens.
_WORDS = (
    "the of and to in a is that for on with as by this be are or at from an party parties "
    "agreement lease tenant landlord premises rent term month year months years payment "
    "shall will may not any all such other under herein thereof contract employee employer "
    "salary notice days written confidential information disclose recipient discloser "
    "borrower lender principal interest rate note promissory amount dollars state law "
    "governed laws effective date between summary summarize company inc llc corp signed "
    "section clause terminate termination renewal deposit security obligations remedies "
    "january february march april may june july august september october november december "
    "california texas new york delaware florida washington nevada oregon ohio illinois"
).split()

SPECIAL_TOKENS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>"}

# A minimal chat template so prompts given as chat messages can be rendered locally.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def synthetic_text(n_lines: int, seed: int = 0) -> list[str]:
    """Seeded pseudo-legal sentences with numbers, dates and punctuation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 30))]
        if rng.random() < 0.5:
            words.insert(rng.randrange(len(words)), f"${rng.randint(1, 99999):,}")
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), f"{rng.randint(1, 28)}/{rng.randint(1, 12)}/20{rng.randint(10, 30)}")
        lines.append(" ".join(words).capitalize() + rng.choice([".", ";", ":", "?"]))
    return lines


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, corpus: list[str] | None = None) -> Path:
    """Train a byte-level BPE on local text and save it as a Hugging Face fast tokenizer.

    Byte-level means any UTF-8 string encodes without an unknown token, as with GPT-2 or Llama 3.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return out_dir
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or synthetic_text(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
    )
    fast.chat_template = CHAT_TEMPLATE
    # Left padding is what batched decoder-only generation needs; saved so every loader agrees.
    fast.padding_side = "left"
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


# Shapes: "tiny" for unit tests (fast, about 0.2M parameters), "bench" for `batchspec bench`
# (about 104M parameters: big enough that a decode step is bound by reading weights, as on a
# real deployment, so speculation has something to save).
SIZES = {
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128),
    "small": dict(hidden=128, layers=4, heads=4, kv_heads=2, ffn=384),
    "bench": dict(hidden=768, layers=12, heads=12, kv_heads=4, ffn=3072),
    # TinyLlama's shape with 24 layers: about 1.06B parameters (scripts/gpu_check.py).
    "1b": dict(hidden=2048, layers=24, heads=32, kv_heads=4, ffn=5632),
}


def model_config(family: str, vocab_size: int, size: str = "tiny", max_positions: int = 1024, tokenizer=None):
    """A transformers config for `family` ("llama", "gpt2" or "qwen2") at one of SIZES."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    s = SIZES[size]
    ids = {}
    if tokenizer is not None:
        ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size, n_positions=max_positions, n_embd=s["hidden"], n_layer=s["layers"],
            n_head=s["heads"], n_inner=s["ffn"], tie_word_embeddings=False, **ids,
        )
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return cls(
        vocab_size=vocab_size, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], intermediate_size=s["ffn"],
        max_position_embeddings=max_positions, tie_word_embeddings=False, **ids,
    )


def build_model(
    out_dir: str | Path,
    family: str = "llama",
    tokenizer_dir: str | Path | None = None,
    size: str = "tiny",
    seed: int = 0,
    init_std: float | None = None,
    layers: int | None = None,
    passthrough_from: int | None = None,
) -> Path:
    """Save a random-weight causal LM (plus its tokenizer) as a real HF checkpoint. Idempotent.

    passthrough_from=n zeroes the output projections of layers n.. (Llama family), so they add
    nothing to the residual stream: the model's logits then equal exactly those of its first n
    layers, which makes a layer_skip draft with n layers accept every token at a fraction of the
    cost. Tests use it to get a pair for which speculation really pays.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else build_tokenizer(out_dir.parent / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = model_config(family, len(tokenizer), size=size, tokenizer=tokenizer)
    if layers is not None:
        config.num_hidden_layers = layers
    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if init_std is None:
        _sharpen(model)
    if passthrough_from is not None:
        damp_layers(model, passthrough_from, 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(
        f"Random-weight {family} ({size}) built by batchspec.testing for tests; seed {seed}. "
        "Its text is meaningless.\n"
    )
    (out_dir / "batchspec_model.json").write_text(json.dumps({"family": family, "size": size, "seed": seed}))
    return out_dir


def damp_layers(model, first: int, scale: float) -> None:
    """Scale the output projections of layers first.. (Llama family) by scale, in place: what they
    write into the residual stream shrinks by that factor (at 0 they write nothing, and the model's
    logits are those of its first `first` layers)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers[first:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def build_repeater(out_dir: str | Path, tokenizer_dir: str | Path, size: str = "tiny") -> Path:
    """A target that repeats its last token: no layer writes to the residual stream and the head
    is the embedding (x10), so its logits favour the current token. Drafts that propose the token
    again (build_learned_draft's copy_next) are then accepted at every position: tests reach the
    full-acceptance paths, and can tell whether another engine reads a draft as batchspec does."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    path = build_model(out_dir, "llama", tokenizer_dir, size=size, passthrough_from=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * 10)
    model.save_pretrained(path)
    return path


def to_speculators(src: str | Path, dst: str | Path, k: int = 3) -> Path:
    """An EAGLE-3 checkpoint saved by batchspec rewritten in the speculators format (the layout of
    vLLM-project/speculators releases): model_type "speculators", the layer's config under
    transformer_layer_config, the EAGLE-3 fields at the top, weights under layers.0.* instead of
    midlayer.*, and norm_before_residual stated (that format's default is on)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    top = {key: cfg.pop(key) for key in ("draft_vocab_size", "target_hidden_size") if key in cfg}
    layers = cfg.pop("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    for key in ("architectures", "batchspec_draft", "base_model_name_or_path"):
        cfg.pop(key, None)
    # vLLM sizes fc from this in the speculators format (it assumes 3 layers without it).
    cfg["num_aux_hidden_states"] = len(layers)
    out = {"model_type": "speculators", "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": cfg, **top, "eagle_aux_hidden_state_layer_ids": layers,
           "norm_before_residual": bool(cfg.pop("norm_before_residual", False)),
           "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                                  "default_proposal_method": "greedy", "verifier": {"name_or_path": "target"}}}
    (dst / "config.json").write_text(json.dumps(out, indent=2))
    weights = load_file(str(src / "model.safetensors"))
    save_file({("layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key): value
               for key, value in weights.items()}, str(dst / "model.safetensors"))
    for extra in src.glob("*.md"):
        shutil.copy(extra, dst)
    return dst


def _sharpen(model) -> None:
    """Scale the output head so the random model's next-token distribution is peaked.

    With the default init (std 0.02) every logit is within ~0.1 of the others: the model is nearly
    uniform, argmax is decided by tiny margins and sampling is close to uniform noise. Real LMs are
    confident, so we scale the head to give top-1 margins of order one, which keeps greedy tests
    meaningful (a float-rounding difference cannot flip them) and sampled text less uniform.
    """
    import torch

    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(25.0)


# Decoder-only architectures the engine is checked against (tests/test_architectures.py, and the
# full matrix in scripts/arch_matrix.py whose table is in docs/engine.md).
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2",
                 "gpt_neox", "opt", "falcon", "stablelm", "gpt_bigcode", "granite", "olmo2", "cohere", "smollm3",
                 "glm4", "exaone4",
                 # mixtures of experts; deepseek_v3 also has multi-head latent attention, llama4_text
                 # chunked attention, gpt_oss alternating sliding layers and attention sinks
                 "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss", "llama4_text")

# Small mixture-of-experts and latent-attention sizes, for the configs that have these keys (their
# defaults are a real model's: deepseek_v3's 256 experts of 2048, a KV rank of 512).
_MOE_SIZES = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_shared_experts": 1,
              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
# Latent attention has as many K/V heads as heads (DeepSeek's configs say so; transformers breaks otherwise).
_LATENT_ATTENTION = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4}
_LATENT_ATTENTION_DEEPSEEK = {**_LATENT_ATTENTION, "kv_lora_rank": 512, "q_lora_rank": 256, "qk_rope_head_dim": 64,
                              "qk_nope_head_dim": 128, "v_head_dim": 128, "head_dim": 64}


def arch_config(arch: str, tokenizer, window: int | None = None, width: int = 64):
    """A 2-layer config of any transformers decoder `arch` (its model_type), `width` wide with 4
    heads, with the tokenizer's special ids. window: the sliding window, for architectures that
    have one. vLLM's CPU attention has no kernel for heads of 16 (width 64): its matrix uses 256."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(arch)
    sizes = {"vocab_size": len(tokenizer), "hidden_size": width, "n_embd": width, "num_hidden_layers": 2, "n_layer": 2,
             "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2, "head_dim": width // 4,
             "intermediate_size": 2 * width, "n_inner": 2 * width, "ffn_dim": 2 * width, "word_embed_proj_dim": width,
             "max_position_embeddings": 512, "n_positions": 512, "pad_token_id": tokenizer.pad_token_id,
             "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    kwargs = {k: v for k, v in sizes.items() if (k in base.to_dict() or hasattr(base, k))
              and not isinstance(getattr(type(base), k, None), property)}  # falcon derives head_dim
    if getattr(base, "multi_query", False):
        kwargs["num_key_value_heads"] = 1  # gpt_bigcode: one K/V head; vLLM reads this key, transformers multi_query
    if arch == "smollm3":
        kwargs["no_rope_layers"] = [1, 0]  # its default lists 36 layers
    kwargs.update({k: v for k, v in _MOE_SIZES.items() if getattr(base, k, None) is not None})
    if getattr(base, "kv_lora_rank", None):  # multi-head latent attention (deepseek): head_dim is the rope part
        # vLLM's MLA kernels refuse small latents, so the vLLM matrix's width (256) gets DeepSeek's own sizes
        kwargs.update(_LATENT_ATTENTION if width < 256 else _LATENT_ATTENTION_DEEPSEEK)
    if arch == "llama4_text":  # its window is a chunk: layer 0 attends within chunks, layer 1 fully
        # top-1 routing, as Llama 4's own (vLLM implements its router weighting for top-1 only)
        kwargs.update(no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"], num_experts_per_tok=1)
        if window is not None:
            kwargs["attention_chunk_size"] = window
    elif window is not None:
        kwargs["sliding_window"] = window
    if arch == "gpt_oss":
        kwargs["layer_types"] = ["sliding_attention", "full_attention"]
    if arch == "deepseek_v3":  # as DeepSeek-V3's config.json says: vLLM reads them, transformers implies them
        kwargs.update(topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "glm4_moe":
        kwargs["head_dim"] = width // 4  # GLM-4.5's own configs carry it, and vLLM reads it
    return AutoConfig.for_model(arch, **kwargs)


def build_arch_model(out_dir: str | Path, arch: str, tokenizer_dir: str | Path, seed: int = 0,
                     window: int | None = None, width: int = 64) -> Path:
    """Save a tiny random checkpoint of `arch` (see arch_config). Idempotent."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(arch_config(arch, tokenizer, window, width))
    _sharpen(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(f"Random-weight 2-layer {arch} built by batchspec.testing; seed {seed}.\n")
    return out_dir


def transformers_greedy(model, rows: list[list[int]], max_new_tokens: int, eos: tuple[int, ...] | list[int],
                        pad_token_id: int | None) -> list[list[int]]:
    """The exactness reference: transformers' own greedy `generate`, one row at a time (no
    padding), each row's new token ids."""
    import torch

    refs = []
    for row in rows:
        with torch.inference_mode():
            out = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=list(eos), pad_token_id=pad_token_id)
        refs.append(out[0, len(row):].tolist())
    return refs


def lossless_cell(target_dir: str | Path, kind: str, prompts: list[str], max_new_tokens: int = 20,
                  draft_dir: str | Path | None = None) -> str:
    """One cell of the architecture matrix: "exact", "exact (plain: ...)" when the engine chose not
    to speculate, "refused: <why>", or "MISMATCH i/n rows".

    The engine's speculative greedy output (a ragged batch: left padding, and the holes that
    rejected draft tokens leave) must equal transformers' own greedy `generate`, run one row at
    a time (no padding), token for token.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .engine.api import ModelLoadError
    from .engine.engine import DraftSpec, Engine

    try:
        engine = Engine.load(str(target_dir), DraftSpec(kind=kind, path=str(draft_dir) if draft_dir else None,
                                                       layers=1), device="cpu", dtype="float32")
    except ModelLoadError as e:
        return f"refused: {e}"
    ids = engine.tokenize(prompts)
    got, _ = engine.generate(ids, max_new_tokens=max_new_tokens, speculate=kind != "none", draft_length=3)
    ref_model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    refs = transformers_greedy(ref_model, ids, max_new_tokens, engine.eos, engine.tokenizer.pad_token_id)
    wrong = sum(ref != out.token_ids for ref, out in zip(refs, got))
    if wrong:
        return f"MISMATCH {wrong}/{len(prompts)} rows"
    if kind != "none" and engine.window is not None:
        fit = sum(len(row) + max_new_tokens <= engine.window for row in ids)
        if fit < len(ids):
            return f"exact ({fit}/{len(ids)} rows fit the {engine.window}-token window and speculate, the rest run plain)"
    return "exact"


def build_learned_draft(out_dir: str | Path, target_dir: str | Path, kind: str, seed: int = 0,
                        copy_next: bool = False, heads: int = 4, draft_vocab: int | None = None,
                        reference_layout: bool = False) -> Path:
    """A random Medusa ("medusa"), EAGLE ("eagle") or EAGLE-3 ("eagle3") draft for a target, saved
    in the layout engine.learned reads. copy_next: instead of random weights, a draft that proposes
    the target's own next token again (heads = the LM head; an EAGLE layer that passes the feature
    through), which random targets that repeat themselves accept often, so tests reach every
    acceptance path. draft_vocab (eagle3): a draft vocabulary of that many random target ids.
    reference_layout (eagle): the EAGLE-1 reference's files instead of batchspec's:
    pytorch_model.bin with fc.*, layers.0.* (no input norm), no final norm, its own embed_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from .engine.learned import (
        Eagle3Model,
        EagleModel,
        MedusaHeads,
        default_feature_layers,
        save_eagle,
        save_eagle3,
        save_medusa,
    )

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    head = target.get_output_embeddings().weight
    torch.manual_seed(seed)
    if kind == "medusa":
        medusa = MedusaHeads(head.shape[1], head.shape[0], heads)
        with torch.no_grad():
            for h in medusa.heads:
                h[0].linear.weight.normal_(0, 0.02 if copy_next else 0.5)
                h[-1].weight.copy_(head if copy_next else torch.randn_like(head) * head.std())
        save_medusa(medusa, out_dir, str(target_dir))
    elif kind == "eagle":
        eagle = EagleModel(target.config.get_text_config(), reference_layout=reference_layout)
        if copy_next:
            H = head.shape[1]
            with torch.no_grad():
                eagle.fc.weight.zero_()
                eagle.fc.weight[:, H:] = torch.eye(H)
                eagle.fc.bias.zero_()
                layer: Any = eagle.decoder.layers[0]  # a LlamaDecoderLayer
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
        if reference_layout:
            state = {k.removeprefix("decoder."): v for k, v in eagle.state_dict().items()
                     if not k.startswith(("decoder.embed_tokens", "decoder.norm", "decoder.rotary"))}
            state["embed_tokens.weight"] = torch.randn(head.shape[0], head.shape[1])
            out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(state, out_dir / "pytorch_model.bin")
            eagle.config.save_pretrained(out_dir)
            cfg = json.loads((out_dir / "config.json").read_text())
            # As published EAGLE-1 configs: the target's vocabulary (vLLM sizes its embedding from it).
            cfg.update(vocab_size=head.shape[0], architectures=["LlamaForCausalLM"])
            (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
        else:
            save_eagle(eagle, out_dir, str(target_dir))
    else:
        V, H = head.shape
        n = target.config.get_text_config().num_hidden_layers
        # copy_next reads only the last layer's output (fc = identity) and adds nothing to it, so
        # the target's own norm and head rows (from_target's start) give back the token fed.
        layers = (n,) if copy_next else default_feature_layers(n)
        ids = None if draft_vocab is None else torch.randperm(V)[:draft_vocab].sort().values
        eagle3 = Eagle3Model.from_target(target, layers, ids)
        with torch.no_grad():
            if copy_next:
                eagle3.fc.weight.copy_(torch.eye(H))
                layer = eagle3.decoder.layers[0]
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            else:
                eagle3.lm_head.weight.copy_(torch.randn(eagle3.draft_vocab, H) * head.std())
        save_eagle3(eagle3, out_dir, str(target_dir))
    return out_dir
