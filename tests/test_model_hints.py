"""bench/model_hints.py: the target's hints on every node of a replayed pass, computed with the real model
once and then read from a file keyed by the committed text and the tree."""

from __future__ import annotations

import pytest

from specedge.bench.model_hints import ModelHints
from specedge.common.draft_tree import DraftTree

pytestmark = pytest.mark.real_model

PROMPT = [1, 504, 2128, 314, 260, 1345, 28, 2030, 30]
FIRST = DraftTree(tokens=[260, 1345, 216], parents=[-1, 0, 0])  # a root with two children, one grandchild
SECOND = DraftTree.chain([28, 2030])


def passes(hints: ModelHints) -> list:
    """Two passes of one prompt: a tree, the verdict's two tokens committed, another tree."""
    prompt = hints.open(PROMPT)
    first = prompt.rows(FIRST)
    prompt.commit([260, 1345])
    second = prompt.rows(SECOND)
    prompt.close()
    return [first, second]


def test_hints_are_the_models_top_k_at_the_root_and_every_node(tmp_path, real_model):
    import torch

    model, _ = real_model("smollm2-135m")
    first, second = passes(ModelHints("smollm2-135m", tmp_path / "hints.json"))
    assert [len(first), len(second)] == [1 + len(FIRST), 1 + len(SECOND)]
    # the second tree's root is the last committed token: its row is the model's next token after it
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + [260, 1345]])).logits[0, -1]
    assert second.ids[0][:4] == torch.topk(logits, 4).indices.tolist()
    assert all(len(row) == 8 for row in first.ids + second.ids)
    assert all(p >= q for row in first.probs for p, q in zip(row, row[1:]))  # most likely first


def test_a_second_replay_reads_the_same_hints_without_the_model(tmp_path):
    cache = tmp_path / "hints.json"
    computed = ModelHints("smollm2-135m", cache)
    first = passes(computed)
    assert computed.computed == 2 and computed.read == 0 and cache.exists()

    again = ModelHints("smollm2-135m", cache)
    assert passes(again) == first  # exactly: probabilities survive the file
    assert again.read == 2 and again.computed == 0 and again._engine is None


def test_a_tree_at_another_committed_length_is_not_read_from_the_cache(tmp_path):
    cache = tmp_path / "hints.json"
    passes(ModelHints("smollm2-135m", cache))
    other = ModelHints("smollm2-135m", cache)
    prompt = other.open(PROMPT)
    prompt.commit([260])  # one token committed, not two: the same tree hangs off another text
    prompt.rows(SECOND)
    prompt.close()
    assert other.computed == 1 and other.read == 0


def test_replays_side_by_side_keep_what_each_computed(tmp_path):
    cache = tmp_path / "hints.json"
    one, other = ModelHints("smollm2-135m", cache), ModelHints("smollm2-135m", cache)  # both start from nothing
    passes(one)
    prompt = other.open(PROMPT)
    prompt.rows(SECOND)  # another tree at the prompt's end: saved after `one` saved its two
    prompt.close()
    assert len(ModelHints("smollm2-135m", cache).known) == 3
