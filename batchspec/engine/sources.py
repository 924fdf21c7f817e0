"""Checks on where a checkpoint comes from that need neither torch nor transformers.

The driver runs them before Ray starts; importing transformers there costs ~3.5 s of a job's
start-up on two cores (it imports torch), which the vllm backend's driver otherwise never needs.
"""

from __future__ import annotations

from pathlib import Path


def local_source_problem(source: str) -> str | None:
    """Why `source` cannot be a checkpoint, when it names a local path; None for hub ids and s3://.

    "models/legal-target" is a valid hub id too: it counts as a local path when its parent
    directory exists here (a typo in a local path), so the user sees "does not exist" rather than
    the hub's lookup error.
    """
    if source.startswith("s3://"):
        return None
    p = Path(source).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            return f"model directory {source} has no config.json: not a Hugging Face checkpoint"
        return None if p.is_dir() else f"model path {source} is a file; give the checkpoint's directory"
    looks_local = source.startswith((".", "/", "~")) or source.count("/") != 1 or p.parent.is_dir()
    return f"model directory {source} does not exist" if looks_local else None


def vocab_problem(target_vocab: dict, draft_vocab: dict, draft_source: str) -> str | None:
    """Speculation compares token ids, so a draft must map every string to the target's ids."""
    if target_vocab == draft_vocab:
        return None
    differ = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
    return (f"draft {draft_source} has an incompatible tokenizer: {len(draft_vocab)} tokens vs the target's "
            f"{len(target_vocab)}, {differ} (token, id) pairs differ. A draft must share the target's vocabulary; "
            "use draft kind 'quantized', 'layer_skip' or 'ngram' for a target without a matching small model.")


def config_problem(kind: str, cfg: dict) -> str | None:
    """What makes a checkpoint's config.json wrong for draft kind `kind`, from the config alone: the
    loaders check it before reading weights, and `batchspec validate` on the driver, where weights
    are not fetched. None when nothing is."""
    if kind == "medusa":
        return None if "medusa_num_heads" in cfg else "config.json has no medusa_num_heads; not a Medusa checkpoint"
    if kind == "eagle3" and "medusa_num_heads" in cfg:
        return "config.json names medusa_num_heads; a Medusa checkpoint, not EAGLE-3"
    speculators = cfg.get("speculators_model_type")
    if kind == "eagle3" and speculators not in (None, "eagle3"):
        return f"a speculators '{speculators}' checkpoint, not eagle3"
    eagle3 = "draft_vocab_size" in cfg or speculators == "eagle3" or any(
        "eagle3" in a.lower() for a in cfg.get("architectures") or [])
    if kind == "eagle" and eagle3:
        return "an EAGLE-3 checkpoint (draft vocabulary, fused features): set model.draft.kind: eagle3"
    return None


# The files that make a checkpoint compute what it computes: its config and its weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def local_checkpoint_dir(source: str) -> Path | None:
    """The local directory holding `source`: itself when it is one, a hub id's snapshot when the hub
    cache holds it (never downloaded here), else None (an s3:// prefix, a hub id not cached)."""
    if source.startswith("s3://"):
        return None
    p = Path(source).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, local_files_only=True))
    except Exception:
        return None


# Above this many bytes of weights a fingerprint hashes their names and sizes, not their bytes: a
# submit names its draft (runner/record.py) and checks a distilled one's target before Ray starts,
# and must not read a 2 GB draft or a 140 GB target to do it (hashing runs at ~0.5 GB/s here).
FULL_HASH_BYTES = 256 << 20


def checkpoint_fingerprint(source: str) -> str | None:
    """'sha256:<16 hex>' over a checkpoint's config.json and weight files (names and bytes, streamed):
    two checkpoints share it only when they compute the same thing. Above FULL_HASH_BYTES of
    weights, 'shape:<16 hex>' over config.json and the weight files' names and sizes (two fine-tunes
    of one model share it). None where the files are not on this machine (local_checkpoint_dir)."""
    import hashlib

    folder = local_checkpoint_dir(source)
    if folder is None or not (folder / "config.json").is_file():
        return None
    weights = sorted(f for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
    full = sum(f.stat().st_size for f in weights) <= FULL_HASH_BYTES
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for f in weights:
        digest.update(f"\0{f.name}\0{f.stat().st_size}".encode())
        if full:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
    return f"{'sha256' if full else 'shape'}:{digest.hexdigest()[:16]}"


def distill_record(draft: str) -> dict | ValueError | None:
    """The distill.json of a draft made by `batchspec distill` (the error when it cannot be read);
    None for any other draft, or one whose files are not on this machine."""
    import json

    folder = local_checkpoint_dir(draft)
    record_file = folder / "distill.json" if folder is not None else None
    if record_file is None or not record_file.is_file():
        return None
    try:
        return json.loads(record_file.read_text())
    except ValueError as e:
        return e


def distilled_draft_problem(draft: str, target: str) -> str | None:
    """Why a draft made by `batchspec distill` must not serve this target: it failed its held-out
    check, or it was distilled for another target (the fingerprints of distill.json and of the
    target differ). None for any other draft, and where either checkpoint is not on this machine."""
    record = distill_record(draft)
    if record is None:
        return None
    if isinstance(record, ValueError):
        return f"draft {draft}: distill.json cannot be read ({record})"
    if not record.get("passed"):
        why = "; ".join(record.get("reasons") or []) or "no verdict recorded"
        return f"draft {draft} failed its held-out check when distilled ({why}); distill again, or start from it with --from"
    theirs, ours = record.get("target_fingerprint"), checkpoint_fingerprint(target)
    if theirs and ours and theirs != ours:
        return (f"draft {draft} was distilled for target {record.get('target')} ({theirs}), and this job's target "
                f"{target} is another checkpoint ({ours}): distill a draft from this target's outputs")
    return None


def draft_identity(kind: str, path: str | None) -> dict:
    """What a run records of its draft (job.json runs[].draft): kind, path, the checkpoint's
    fingerprint, and for a draft made by `batchspec distill` what it learned from."""
    out: dict = {"kind": kind, "path": path, "fingerprint": checkpoint_fingerprint(path) if path else None}
    record = distill_record(path) if path else None
    if isinstance(record, dict):
        out["distilled"] = {"outputs": record.get("outputs"), "replay": record.get("replay"),
                            "started_from": record.get("started_from"), "passed": record.get("passed"),
                            "target_fingerprint": record.get("target_fingerprint"),
                            "rows_trained": (record.get("rows") or {}).get("trained"),
                            "held_out_mean_acceptance_length": [
                                ((record.get(w) or {}).get("all") or {}).get("mean_acceptance_length")
                                for w in ("before", "after")]}
    return out
