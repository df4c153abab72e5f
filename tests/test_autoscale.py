"""The autoscaling rule (cloud/ray/autoscale.py) with an injected clock: it follows sessions per replica
within [min, max], and only once a change of want has held for its delay."""

from __future__ import annotations

import pytest

from specedge.cloud.ray.autoscale import Autoscaler


def test_grows_once_the_load_has_held_for_the_up_delay():
    scaler = Autoscaler(min_replicas=1, max_replicas=4, target_sessions=4, up_delay_s=10, down_delay_s=60)
    assert scaler.desired(current=1, sessions=9, now=0) == 1  # wants 3, but only just
    assert scaler.desired(current=1, sessions=9, now=9.9) == 1
    assert scaler.desired(current=1, sessions=9, now=10) == 3


def test_a_burst_shorter_than_the_delay_changes_nothing():
    scaler = Autoscaler(target_sessions=4, up_delay_s=10)
    assert scaler.desired(1, 20, now=0) == 1
    assert scaler.desired(1, 2, now=5) == 1  # the burst ended: the clock starts again next time
    assert scaler.desired(1, 20, now=8) == 1
    assert scaler.desired(1, 20, now=17) == 1
    assert scaler.desired(1, 20, now=18) == 4  # capped at max_replicas


def test_shrinks_after_the_down_delay_and_never_below_min():
    scaler = Autoscaler(min_replicas=2, max_replicas=6, target_sessions=8, up_delay_s=1, down_delay_s=60)
    assert scaler.desired(5, 0, now=0) == 5
    assert scaler.desired(5, 0, now=59) == 5
    assert scaler.desired(5, 0, now=60) == 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="min_replicas"):
        Autoscaler(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_sessions"):
        Autoscaler(target_sessions=0)
