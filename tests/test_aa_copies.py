"""A/A copies of drafters (bench/perturbed.py) and the per-prompt arithmetic of bench/tokens_per_pass.py: a
copy differs from its original only by one earlier output in its history."""

from __future__ import annotations

import math

import pytest

import specedge.edge.registry as registry
from specedge.bench.perturbed import EARLIER, install, perturb
from specedge.bench.tokens_per_pass import passes_against
from specedge.edge.retrieval import RetrievalDrafter


class BytesTokenizer:
    """Token ids = the text's bytes (the copy only needs some encoding of EARLIER)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


def test_a_copy_holds_one_earlier_output_in_its_history_and_nothing_else():
    original, copy = RetrievalDrafter(), perturb(RetrievalDrafter(), BytesTokenizer())
    assert original.history.n == 0
    written = list(EARLIER.encode())[8:]
    assert copy.history.tokens[: copy.history.n].tolist() == [*written, -1]  # the output and its separator
    assert copy.model.reached.sum() == original.model.reached.sum() == 0  # nothing learned from verdicts


def test_a_copy_drafts_from_that_output_where_the_original_has_nothing():
    original, copy = RetrievalDrafter(), perturb(RetrievalDrafter(), BytesTokenizer())
    prompt = list(b"the bud")  # no earlier "d" in it: the context itself has no continuation
    for drafter in (original, copy):
        drafter.begin(prompt)
    assert len(original.propose()) == 0
    assert copy.propose().tokens[:3] == list(b"get")


def test_the_registry_makes_copies_by_name(monkeypatch):
    for name in ("make_drafter", "check_drafter"):  # undone after the test
        monkeypatch.setattr(registry, name, getattr(registry, name))
    install()
    registry.check_drafter("retrieval~")
    copy = registry.make_drafter("retrieval~", tokenizer=BytesTokenizer())
    assert isinstance(copy, RetrievalDrafter) and copy.history.n > 0
    with pytest.raises(ValueError, match="tokenizer"):
        registry.make_drafter("retrieval~")


def test_passes_per_prompt_are_compared_as_a_geometric_mean_with_its_spread():
    rounds = {"a": {"x": 10, "y": 11}, "b": {"x": 20, "y": 18}, "c": {"x": 30, "y": 30}}
    ratio, sd, se = passes_against(rounds, "y", "x")
    logs = [math.log(1.1), math.log(0.9), 0.0]
    assert ratio == pytest.approx(math.exp(sum(logs) / 3))
    mean = sum(logs) / 3
    assert sd == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in logs) / 2))
    assert se == pytest.approx(sd / math.sqrt(3))
