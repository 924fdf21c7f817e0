"""Fine-tune a `model` draft on the target's own completions (black-box distillation).

The loss is next-token cross-entropy on the completion's tokens (and its EOS where the row ended
on one), the prompt being context only: what the draft must do is propose the target's next
tokens, and a prompt is text it copies from, not text to imitate (as batchspec.demo.train).

Each epoch ends with a held-out check that needs no engine: the draft's greedy choice at every
completion position, given the target's tokens before it (teacher forcing), replayed as greedy
speculation at k (a round accepts the run of agreeing positions, up to k, then the target's own
token). Under greedy decoding that is what speculation at k does with this draft, so the
epoch with the best held-out mean acceptance length is kept, not the one with the lowest loss
(loss can go on falling after acceptance peaks). The gate itself (distill/check.py) measures
with the engine the job runs on.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.models import encode_prompts
from ..rates import mean_acceptance_length, per_token_acceptance
from .rows import Row


@dataclass
class Example:
    ids: list[int]
    start: int  # the first completion position
    repeats: int = 1  # times per epoch (rows with the lowest acceptance may be seen twice)


def examples(tokenizer, rows: list[Row], max_len: int) -> tuple[list[Example], list[Row], int]:
    """(each row's prompt and completion as one sequence, the rows they are, rows too long for the
    draft's context)."""
    prompts = encode_prompts(tokenizer, [r.prompt for r in rows])
    completions = tokenizer([r.completion for r in rows], add_special_tokens=False)["input_ids"] if rows else []
    out, kept, too_long = [], [], 0
    for r, p, c in zip(rows, prompts, completions):
        c = list(c) + ([tokenizer.eos_token_id] if r.ends_with_eos and tokenizer.eos_token_id is not None else [])
        if not c or len(p) + len(c) > max_len:
            too_long += bool(c)
            continue
        out.append(Example(list(p) + c, len(p)))
        kept.append(r)
    return out, kept, too_long


def oversample(rows: list[Row], exs: list[Example], share: float) -> None:
    """The `share` of rows whose acceptance in their run was lowest are seen twice per epoch (rows
    that ran plain have no acceptance and are not among them)."""
    scored = sorted((r.acceptance, i) for i, r in enumerate(rows) if r.acceptance is not None)
    for _, i in scored[: int(len(scored) * share)]:
        exs[i].repeats = 2


def _batch(exs: list[Example], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(e.ids) for e in exs)
    ids = torch.full((len(exs), T), pad)
    labels = torch.full((len(exs), T), -100)
    mask = torch.zeros(len(exs), T, dtype=torch.long)
    for i, e in enumerate(exs):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        labels[i, e.start: len(e.ids)] = torch.tensor(e.ids[e.start:])
        mask[i, : len(e.ids)] = 1
    return ids, mask, labels


@torch.no_grad()
def replayed(model, exs: list[Example], k: int, pad: int, batch: int = 16) -> dict[str, Any]:
    """Greedy speculation at k replayed from teacher-forced agreement (module docstring)."""
    model.eval()
    accepted = rejections = rounds = 0
    for b in range(0, len(exs), batch):
        chunk = exs[b: b + batch]
        ids, mask, _ = _batch(chunk, pad)
        guess = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
        for i, e in enumerate(chunk):
            agree = (guess[i, e.start - 1: len(e.ids) - 1] == ids[i, e.start: len(e.ids)]).tolist()
            pos = 0
            while pos < len(agree) - 1:  # the last token is the target's own once everything before is accepted
                run = 0
                while run < k and pos + run < len(agree) - 1 and agree[pos + run]:
                    run += 1
                accepted, rounds = accepted + run, rounds + 1
                rejections += run < k and pos + run < len(agree) - 1
                pos += run + 1
    model.train()
    return {"per_token_acceptance": per_token_acceptance(accepted, rejections),
            "mean_acceptance_length": mean_acceptance_length(accepted, rounds), "rounds": rounds}


def fine_tune(start: str, tokenizer, train: list[Example], held: list[Example], k: int, epochs: int = 3,
              lr: float = 3e-4, batch: int = 16, seed: int = 0, log=print, workers: int = 1) -> tuple[Any, dict[str, Any]]:
    """(the draft of the best epoch by held-out replayed acceptance length, what training did).
    workers > 1: data-parallel on Ray Train (TorchTrainer, DDP; gloo on CPU), batches dealt
    over the workers, so each step's gradient is the average over workers * batch rows."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = {"start": start, "train": train, "held": held, "k": k, "epochs": epochs, "lr": lr, "batch": batch,
              "seed": seed, "pad": pad}
    if workers > 1:
        return _on_ray(config, workers, log)
    return _fit(config, 0, 1, lambda m: m, log)


def _fit(c: dict[str, Any], rank: int, world: int, wrap, log) -> tuple[Any, dict[str, Any]]:
    """The training loop of one worker of `world` (rank 0 checks the held-out rows and keeps the best epoch)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(c["seed"])
    model = AutoModelForCausalLM.from_pretrained(c["start"], dtype=torch.float32)
    trained = wrap(model)
    order = [e for e in c["train"] for _ in range(e.repeats)]
    per_epoch = max(1, math.ceil(len(order) / c["batch"]) // world)  # the same count on every worker
    steps = c["epochs"] * per_epoch
    opt = torch.optim.AdamW(trained.parameters(), lr=c["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) *
                                              (0.1 + 0.45 * (1 + math.cos(math.pi * s / max(1, steps)))))
    t0, rng = time.perf_counter(), random.Random(c["seed"])  # one seed: every worker shuffles alike
    epochs_seen = [{"epoch": 0, "loss": None, **(replayed(model, c["held"], c["k"], c["pad"]) if rank == 0 else {})}]
    best, best_state = epochs_seen[0], None
    for epoch in range(1, c["epochs"] + 1):
        rng.shuffle(order)
        losses = []
        for i in range(per_epoch):
            b = (i * world + rank) * c["batch"] % max(1, len(order))
            ids, mask, labels = _batch(order[b: b + c["batch"]], c["pad"])
            loss = trained(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        if rank:
            continue
        seen = {"epoch": epoch, "loss": sum(losses) / len(losses), **replayed(model, c["held"], c["k"], c["pad"])}
        epochs_seen.append(seen)
        log(f"epoch {epoch}/{c['epochs']}: loss {seen['loss']:.3f}, held-out replayed acceptance length "
            f"{seen['mean_acceptance_length'] or 0:.2f}")
        if (seen["mean_acceptance_length"] or 0) > (best["mean_acceptance_length"] or 0):
            best, best_state = seen, copy.deepcopy(model.state_dict())
    if best_state is not None:
        model.load_state_dict(best_state)
    return model, {"steps": steps, "train_s": round(time.perf_counter() - t0, 2), "epochs": epochs_seen,
                   "kept_epoch": best["epoch"], "lr": c["lr"], "batch": c["batch"], "seed": c["seed"], "workers": world,
                   "train_rows": len(c["train"]), "rows_seen_twice": sum(e.repeats > 1 for e in c["train"])}


def _worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: DDP over gloo (prepare_model); rank 0 reports the best epoch's draft."""
    import tempfile

    import ray.train
    from ray.train.torch import prepare_model

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    model, record = _fit(config, rank, ctx.get_world_size(), prepare_model, lambda line: None)
    if rank:
        ray.train.report({})
        return
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        ray.train.report({"record": record}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _on_ray(config: dict[str, Any], workers: int, log) -> tuple[Any, dict[str, Any]]:
    import tempfile

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from transformers import AutoModelForCausalLM

    log(f"distill: training on {workers} Ray Train workers (DDP, gloo on CPU)")
    with tempfile.TemporaryDirectory(prefix="batchspec-distill-") as storage:
        trainer = TorchTrainer(_worker, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
                               run_config=RunConfig(name="distill", storage_path=storage))
        result = trainer.fit()
        assert result.checkpoint is not None
        with result.checkpoint.as_directory() as folder:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert result.metrics is not None
    return model, result.metrics["record"]
