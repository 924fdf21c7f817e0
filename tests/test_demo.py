"""The demo corpus is deterministic with disjoint splits; the committed trained pair works."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchspec.demo.corpus import KINDS, examples

REPO = Path(__file__).resolve().parents[1]
TARGET, DRAFT = REPO / "models" / "legal-target", REPO / "models" / "legal-draft"


def test_corpus_is_deterministic():
    assert examples("eval", 20) == examples("eval", 20)
    assert examples("train", 5, offset=100) == examples("train", 105)[100:]
    assert {e["kind"] for e in examples("train", 200)} == set(KINDS)


def test_splits_are_disjoint():
    train = {e["contract"] for e in examples("train", 3000)}
    for split in ("eval", "demo"):
        assert not train & {e["contract"] for e in examples(split, 300)}


def test_summaries_copy_the_key_facts():
    for e in examples("eval", 50):
        assert e["summary"].endswith(" law.")
        state = e["summary"].rsplit("under ", 1)[1][: -len(" law.")]
        assert state in e["contract"]


@pytest.mark.skipif(not (TARGET / "config.json").exists(), reason="trained demo pair not committed")
def test_committed_pair_summarizes_held_out_contracts():
    from batchspec.engine import DraftSpec, Engine

    engine = Engine.load(str(TARGET), DraftSpec(kind="model", path=str(DRAFT)))  # the normal loading path
    ex = examples("eval", 8)
    ids = engine.tokenize([e["prompt"] for e in ex])
    spec, _ = engine.generate(ids, max_new_tokens=64, speculate=True, draft_length=4)
    plain, _ = engine.generate(ids, max_new_tokens=64, speculate=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    exact = [o.text.strip() == e["summary"] for o, e in zip(spec, ex)]
    assert sum(exact) >= 7, [(o.text, e["summary"]) for o, e, ok in zip(spec, ex, exact) if not ok]
    acc = sum(o.stats.accepted_tokens for o in spec) / sum(o.stats.draft_tokens for o in spec)
    assert acc > 0.5  # the trained draft agrees with the target most of the time


def test_setting_the_demo_up_again_leaves_its_shards_alone(tmp_path):
    """`make demo` runs the setup before every submit; a shard rewritten with the same rows got a
    new mtime, and the second `make demo` refused to run with "input changed"."""
    from batchspec.demo.setup import write_shards

    paths = write_shards(tmp_path, shards=2, rows=4)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert write_shards(tmp_path, shards=2, rows=4) == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps


@pytest.mark.skipif(not (TARGET / "config.json").exists(), reason="trained demo pair not committed")
def test_cost_stand_in_decodes_exactly_as_the_small_target(tmp_path):
    """The stand-in appends zero-output layers: every one of them computes, none changes a logit.
    Built small here (~8M parameters); the size changes how many layers are appended, not how."""
    import json

    import torch

    from batchspec.demo import standin
    from batchspec.engine import DraftSpec, Engine

    out = standin.build(8_000_000, tmp_path / "stand-in", source=TARGET)
    stamp = json.loads((out / standin.STAMP).read_text())
    assert stamp["appended_layers"] == 7 and 7.9e6 < stamp["parameters"] < 8.6e6
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3 + 7
    assert standin.build(8_000_000, out, source=TARGET) == out  # the same build again is left alone
    assert json.loads((out / standin.STAMP).read_text()) == stamp

    prompts = [e["prompt"] for e in examples("eval", 6)]
    small = Engine.load(str(TARGET), DraftSpec(kind="none"))
    big = Engine.load(str(out), DraftSpec(kind="model", path=str(DRAFT)))
    assert sum(p.numel() for p in big.target.model.parameters()) == stamp["parameters"]
    ids = small.tokenize(prompts)
    assert big.tokenize(prompts) == ids
    with torch.no_grad():  # the logits themselves, not only their argmax, are the small target's
        x = torch.tensor([ids[0]])
        assert torch.equal(small.target.model(x).logits, big.target.model(x).logits)
    plain, _ = small.generate(ids, max_new_tokens=48, speculate=False)
    for speculate in (False, True):
        outs, _ = big.generate(ids, max_new_tokens=48, speculate=speculate, draft_length=4)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_stand_in_sizes_read_as_people_write_them():
    import argparse

    from batchspec.demo.standin import default_out, parse_params

    assert [parse_params(s) for s in ("40M", "40m", "0.1B", "2500k", "40000000")] == [
        40_000_000, 40_000_000, 100_000_000, 2_500_000, 40_000_000]
    assert default_out(40_000_000).name == "legal-target-40m"
    with pytest.raises(argparse.ArgumentTypeError, match="such as 40M"):
        parse_params("forty")
