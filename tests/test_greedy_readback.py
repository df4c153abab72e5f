"""A greedy step's results read back from the device in one transfer (cloud/greedy_readback.py): each row's
argmax and its top k hints, packed where the logits lie. Checked on the CPU against torch's own argmax and the
plain hints (`top_k_hints_plain`, what the engine ran off the CPU before), eager and compiled."""

from __future__ import annotations

import logging

import pytest
import torch

from specedge.cloud.greedy_readback import GreedyReadback, pack
from specedge.cloud.hints import top_k_hints_plain


def logits_of(rows: int, dtype: torch.dtype, vocab: int = 3000) -> torch.Tensor:
    return (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_reads_back_its_argmax_and_its_top_k_with_their_probabilities(dtype):
    logits = logits_of(7, dtype)
    back = GreedyReadback()(logits, 8)
    assert back.packed.shape == (7, 17)
    assert torch.equal(back.argmax(0, 7), logits.argmax(-1)) and torch.equal(back.argmax(2, 5), logits[2:5].argmax(-1))
    for k in (8, 3):  # fewer than were packed: the first k of the top 8
        want, got = top_k_hints_plain(logits[1:6], k), back.hints(1, 6, k)
        assert got.ids == want.ids
        assert max(abs(a - b) for x, y in zip(got.probs, want.probs) for a, b in zip(x, y)) <= 1e-6
    with pytest.raises(ValueError, match="hints of 9 tokens asked from rows packed with 8"):
        back.hints(0, 7, 9)


def test_without_hints_only_the_argmax_is_packed():
    logits = logits_of(5, torch.float32)
    assert pack(logits, 0).shape == (5, 1)
    assert torch.equal(GreedyReadback()(logits, 0).argmax(0, 5), logits.argmax(-1))


def test_compiled_it_packs_what_it_packs_eagerly(caplog):
    """Compiled as the engine's layers are off the CPU; one graph serves row counts and k's that vary."""
    compiled, eager = GreedyReadback(compiled=True), GreedyReadback()
    with caplog.at_level(logging.WARNING):
        for rows, k in ((9, 8), (17, 8), (4, 3), (12, 0)):
            logits = logits_of(rows, torch.float32)
            a, b = compiled(logits, k).packed, eager(logits, k).packed
            assert (a[:, : 1 + k] == b[:, : 1 + k]).all()  # argmax and ids
            assert abs(a[:, 1 + k :].view("float32") - b[:, 1 + k :].view("float32")).max(initial=0) <= 1e-6
    assert not [r for r in caplog.records if "runs eagerly" in r.message], "it must have run compiled"
