"""One logit shift per generation: none without evidence, towards what the generation accepts as evidence
grows, the shifted estimates calibrated once there is plenty of it, and gone when the next generation begins."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.edge.calibration import Calibration
from specedge.edge.generation_shift import fit_shift, shifted


def test_without_evidence_there_is_no_shift_and_no_shift_changes_nothing():
    assert fit_shift(np.zeros(0), np.zeros(0, dtype=bool)) == 0.0
    p = np.array([0.0, 0.2, 0.7, 1.0])
    assert np.array_equal(shifted(p, 0.0), p)


@pytest.mark.parametrize("rate, sign", [(0.3, -1), (0.9, 1)])
def test_the_shift_follows_what_the_generation_accepts_and_grows_with_its_evidence(rate, sign):
    p = np.full(400, 0.6)
    accepted = np.arange(400) % 10 < rate * 10
    few, many = fit_shift(p[:10], accepted[:10]), fit_shift(p, accepted)
    assert sign * few > 0 and sign * many > sign * few
    assert shifted(p, many).mean() == pytest.approx(rate, abs=0.02)


def test_estimates_of_zero_or_one_move_with_the_shift():
    moved = shifted(np.array([0.0, 1.0]), -1.0)
    assert 0.0 < moved[0] < 1e-3 and 0.99 < moved[1] < 1.0


def test_starting_from_an_earlier_shift_reaches_the_same_fit():
    rng = np.random.default_rng(1)
    p, accepted = rng.uniform(0.05, 0.95, 300), rng.random(300) < 0.35
    assert fit_shift(p, accepted, start=1.5, steps=8) == pytest.approx(fit_shift(p, accepted, steps=8), abs=1e-6)


def test_one_step_per_verdict_tracks_the_converged_fit():
    """A generation that accepts far less than earlier ones: after every verdict, the shift refitted by one
    Newton step from the last stays close to the fit converged afresh on the same nodes."""
    calibration, rng = Calibration(), np.random.default_rng(2)
    for _ in range(20):  # earlier generations accept 80%
        calibration.generation.begin()
        calibration.update(Calibration.buckets(rng.uniform(0.3, 0.95, 400)), rng.random(400) < 0.8)
    shift = calibration.generation
    shift.begin()
    for _ in range(60):  # this one 30%, a verdict on 30 nodes at a time
        calibration.update(Calibration.buckets(rng.uniform(0.3, 0.95, 30)), rng.random(30) < 0.3)
        n = min(shift._seen, len(shift._keys))
        converged = fit_shift(calibration._long_run(shift._keys[:n]), shift._accepted[:n], steps=8)
        assert shift.value == pytest.approx(converged, abs=1e-3)
    assert shift.value < -0.5  # it did move a long way


def test_a_drafting_models_calibration_shifts_within_a_generation_and_starts_the_next_from_its_buckets():
    calibration, raw = Calibration(), np.full(50, 0.85)
    rng = np.random.default_rng(0)
    for _ in range(20):  # generations in which the verifier accepts 80% of these nodes
        calibration.generation.begin()
        calibration.update(Calibration.buckets(raw), rng.random(50) < 0.8)
    long_run = float(calibration.probs(0.85))
    assert 0.75 < long_run < 0.85
    calibration.generation.begin()
    calibration.update(Calibration.buckets(raw[:30]), np.arange(30) < 9)  # this one accepts 30%
    assert float(calibration.probs(0.85)) < 0.6
    calibration.generation.begin()
    assert float(calibration.probs(0.85)) > 0.75
