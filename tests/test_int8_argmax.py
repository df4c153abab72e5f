"""The int8 argmax gives exactly the float32 output layer's argmax, however close the race, for a quarter of its
bytes read; where it cannot promise that, it is not used."""

from __future__ import annotations

import pytest
import torch

from specedge.cloud.int8_argmax import FEW, MAX_ROWS, Int8Argmax
from specedge.cloud.linear import Linear
from specedge.cloud.output_layer import OutputLayer

pytestmark = pytest.mark.skipif(Int8Argmax.build(torch.randn(64, 16)) is None,
                                reason="this torch or CPU has no exact fbgemm int8 kernel")


def hidden_like_a_model(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """Final hidden states as real models have them: a few dimensions tens of times larger than the rest
    (Gemma 3's reach 120 where the median is 2): what makes per-row int8 activations too coarse alone."""
    h = torch.randn(rows, dim, generator=g) * 2
    h[:, :3] *= 40
    return h


@pytest.mark.parametrize("vocab,dim", [(5000, 64), (2048, 576)])
def test_the_argmax_equals_the_float32_layers_on_random_rows(vocab, dim):
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, dim, generator=g) * 0.05
    head, full = Int8Argmax.build(weight), Linear(weight)
    for rows in (1, 3, MAX_ROWS):
        for _ in range(20):
            h = hidden_like_a_model(rows, dim, g)
            assert torch.equal(head(h), full(h).argmax(-1))


def test_a_race_closer_than_int8_can_see_is_settled_in_float32():
    """Two tokens whose weights differ by far less than an int8 step quantise alike, so their int8 logits
    tie; the exact rescoring must still pick the one whose float32 logit is larger, whichever id it has."""
    g = torch.Generator().manual_seed(1)
    dim = 64
    weight = torch.randn(300, dim, generator=g) * 0.05
    h = hidden_like_a_model(1, dim, g)
    winner = h[0] / h[0].norm() * 2  # far ahead of every random row
    weight[10] = winner
    weight[200] = winner + 1e-6 * h[0] / h[0].norm()  # a hair ahead of row 10
    head = Int8Argmax.build(weight)
    assert (weight[200] @ h[0]) > (weight[10] @ h[0])
    assert head(h).tolist() == [200] == Linear(weight)(h).argmax(-1).tolist()
    weight[200] = winner - 1e-6 * h[0] / h[0].norm()  # now a hair behind
    head = Int8Argmax.build(weight)
    assert head(h).tolist() == [10] == Linear(weight)(h).argmax(-1).tolist()


def test_an_exact_tie_goes_to_the_lowest_id_as_torch_argmax_does():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(500, 32, generator=g) * 0.05
    h = hidden_like_a_model(2, 32, g)
    weight[77] = weight[333] = h[0] / h[0].norm()
    assert Int8Argmax.build(weight)(h)[0] == 77 == Linear(weight)(h)[0].argmax()


def test_it_is_not_built_where_it_cannot_be_exact():
    assert Int8Argmax.build(torch.randn(100, 16, dtype=torch.float64)) is None
    assert Int8Argmax.build(torch.randn(100, 16).to(torch.bfloat16)) is None


def test_the_output_layer_rebuilds_it_when_the_weight_changes_in_place():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(400, 32, generator=g) * 0.05
    layer = OutputLayer(weight)
    h = hidden_like_a_model(4, 32, g)
    assert torch.equal(layer.argmax(h), layer.logits(h).argmax(-1))
    with torch.no_grad():
        weight[123] = h[0] / h[0].norm() * 10  # token 123 now wins row 0
    layer.linear = Linear(weight)  # what a runner would rebuild; the int8 copy notices by itself
    assert layer.argmax(h)[0] == 123


def test_output_layers_over_one_weight_share_one_int8_copy():
    weight = torch.randn(400, 32) * 0.05
    a, b = OutputLayer(weight), OutputLayer(weight)
    h = torch.randn(2, 32)
    a.argmax(h), b.argmax(h)
    assert a._fast is b._fast is not None


def test_many_rows_use_the_float32_layer():
    """Past MAX_ROWS the int8 kernel, which reads two rows per row, costs as much as float32 does."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(400, 32, generator=g) * 0.05
    layer = OutputLayer(weight)
    h = hidden_like_a_model(MAX_ROWS + 5, 32, g)
    assert torch.equal(layer.argmax(h), layer.logits(h).argmax(-1))
    assert layer._fast is None  # not even built


def test_a_row_too_flat_to_settle_cheaply_is_left_to_float32():
    """When more than FEW tokens lie within the bound of the best (all weights alike here), rescoring them
    would cost more than the float32 layer: the row comes back unsettled and the output layer decides it."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(1, 32, generator=g) * 0.05
    weight = base + torch.randn(FEW + 500, 32, generator=g) * 1e-6  # far below an int8 step of any row
    h = hidden_like_a_model(2, 32, g)
    assert Int8Argmax.build(weight)(h).tolist() == [-1, -1]
    layer = OutputLayer(weight)
    assert torch.equal(layer.argmax(h), layer.logits(h).argmax(-1))


def test_hints_from_it_have_the_exact_top_k_and_near_exact_probabilities():
    """A greedy session's hints come from the int8 copy too: the top k ids and their logits are computed
    exactly; only the softmax's normaliser counts the other tokens at their int8 logits."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(3000, 64, generator=g) * 0.05
    layer = OutputLayer(weight)
    h = hidden_like_a_model(5, 64, g)
    argmax, hints = layer.argmax_and_hints(h, 4)
    logits = layer.logits(h)
    want = logits.softmax(-1).topk(4, dim=-1)
    assert torch.equal(argmax, logits.argmax(-1))
    assert hints.ids == want.indices.tolist()
    assert torch.allclose(torch.tensor(hints.probs), want.values, rtol=1e-2)
