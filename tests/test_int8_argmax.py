"""The int8 argmax gives exactly the float32 output layer's argmax, however close the race, for a quarter of its
bytes read; where it cannot promise that, it is not used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specedge.cloud.int8_argmax import FEW, MAX_K, Int8Argmax
from specedge.cloud.linear import Linear
from specedge.cloud.output_layer import OutputLayer

pytestmark = pytest.mark.skipif(Int8Argmax.build(torch.randn(64, 16)) is None,
                                reason="the int8 logits kernel cannot be built or is not exact here")


def hidden_like_a_model(rows: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """Final hidden states as real models have them: a few dimensions tens of times larger than the rest
    (Gemma 3's reach 120 where the median is 2): what makes per-row int8 activations too coarse alone."""
    h = torch.randn(rows, dim, generator=g) * 2
    h[:, :3] *= 40
    return h


def heads_by_instructions(weight: torch.Tensor) -> list[Int8Argmax]:
    """The int8 argmax of `weight` with the AVX2 kernel, and with the AVX-512 VNNI one where this CPU has it."""
    heads = []
    for isa in (1, 2):
        head = Int8Argmax.build(weight)
        if isa <= head.isa:
            head.isa = isa
            heads.append(head)
    return heads


@pytest.mark.parametrize("vocab,dim", [(5000, 64), (2048, 576), (1001, 35)])
def test_the_argmax_equals_the_float32_layers_on_random_rows(vocab, dim):
    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, dim, generator=g) * 0.05
    full = Linear(weight)
    for head in heads_by_instructions(weight):
        for rows in (1, 3, 7, 13, 25):
            for _ in range(8):
                h = hidden_like_a_model(rows, dim, g)
                assert torch.equal(head(h), full(h).argmax(-1))


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_integer_sums_are_exact_for_every_row_count(threads):
    """Every row group the kernels unroll (1-6 rows with AVX2, 1-12 with VNNI, then again), a vocabulary that is
    not a multiple of a panel, an odd dimension, and rows at the extremes of their levels."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(1003, 37, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for head in heads_by_instructions(weight):
            q = head.packed.transpose(1, 2).reshape(-1, 38)[:1003].double()
            for rows in range(1, 27):
                x = torch.randint(-head.levels, head.levels + 1, (rows, 38), generator=g, dtype=torch.int16)
                x[0] = head.levels
                row_scale = torch.rand(rows, generator=g) + 0.5
                want = (x.double() @ q.T) * row_scale.double()[:, None] * head.scale[:1003].double()
                got = head._logits(x, row_scale).double()
                assert torch.allclose(got, want, rtol=1e-6, atol=0), (head.isa, rows)
    finally:
        torch.set_num_threads(previous)


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


def test_many_rows_use_the_float32_layer(monkeypatch):
    """Past its max_rows (fewer with AVX2 alone) the int8 kernel's arithmetic costs as much as float32 logits."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(400, 32, generator=g) * 0.05
    layer = OutputLayer(weight)
    assert layer.prepare()
    monkeypatch.setattr(Int8Argmax, "top_k", lambda *args: pytest.fail("the int8 argmax was used"))
    h = hidden_like_a_model(layer._fast.max_rows + 1, 32, g)
    assert torch.equal(layer.argmax(h), layer.logits(h).argmax(-1))


def test_a_row_with_nan_is_left_to_float32_and_the_others_settled():
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(400, 32, generator=g) * 0.05
    layer = OutputLayer(weight)
    h = hidden_like_a_model(3, 32, g)
    h[1, 5] = float("nan")
    assert layer.prepare()
    assert layer._fast(h)[1] == -1
    assert torch.equal(layer.argmax(h), layer.logits(h).argmax(-1))


def test_it_gives_at_most_max_k_largest_logits():
    head = Int8Argmax.build(torch.randn(400, 32))
    with pytest.raises(ValueError, match="1 to 64"):
        head.top_k(torch.randn(2, 32), MAX_K + 1)


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


def test_turned_off_by_the_environment_greedy_steps_take_float32_logits():
    code = ("import torch; from specedge.cloud.output_layer import OutputLayer; "
            "print(OutputLayer(torch.randn(64, 16)).prepare())")
    env = {**os.environ, "SPECEDGE_CPU_ARGMAX": "float32"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
