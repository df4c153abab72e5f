"""The verifier's advertised cost model: measured pass times where it has them, the prior of its device's
kind scaled to them elsewhere (so that clients size trees sensibly before every size has been seen)."""

from __future__ import annotations

import pytest
import torch

from specedge.cloud.cost_tracker import GPU_PRIOR_RELATIVE, PRIOR_RELATIVE, CostTracker


def test_unmeasured_sizes_are_priced_from_the_prior_scaled_to_the_measured_ones():
    tracker = CostTracker.for_device(torch.device("cpu"))
    assert tracker.model().ms(32) == pytest.approx(50.0 * PRIOR_RELATIVE[32])  # nothing measured: the base
    tracker.observe(0, 20.0)
    model = tracker.model()
    assert model.ms(0) == 20.0 and model.ms(32) == pytest.approx(20.0 * PRIOR_RELATIVE[32])
    tracker.observe(32, 70.0)  # a measurement replaces the prior at its size
    assert tracker.model().ms(32) == 70.0


def test_sizes_beyond_the_measured_ones_follow_the_prior_from_the_largest_measured_below_them():
    """A steeper model than the prior's (Gemma 3 270M on this CPU: 100 ms at no draft, 226 at 8 tokens) must not
    make 12 tokens look as cheap as 8."""
    tracker = CostTracker.for_device("cpu")
    tracker.observe(0, 100.0)
    tracker.observe(8, 226.0)
    model = tracker.model()
    assert model.ms(4) == pytest.approx(100.0 * PRIOR_RELATIVE[4])  # between: from the one below
    assert model.ms(12) == pytest.approx(226.0 * PRIOR_RELATIVE[12] / PRIOR_RELATIVE[8])
    assert model.ms(12) > model.ms(8)
    tracker = CostTracker.for_device("cpu")
    tracker.observe(8, 150.0)  # only a size above: scaled from it
    assert tracker.model().ms(0) == pytest.approx(150.0 / PRIOR_RELATIVE[8])


def test_a_gpu_verifier_advertises_nearly_flat_costs_before_measuring_them():
    gpu, cpu = CostTracker.for_device("cuda"), CostTracker.for_device("cpu")
    for tracker in (gpu, cpu):
        tracker.observe(0, 10.0)
    assert gpu.model().ms(32) == pytest.approx(10.0 * GPU_PRIOR_RELATIVE[32])
    assert gpu.model().ms(32) < 13.0
    assert cpu.model().ms(32) == pytest.approx(10.0 * PRIOR_RELATIVE[32]) and cpu.model().ms(32) > 2 * gpu.model().ms(32)
