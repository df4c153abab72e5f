"""Placement (cloud/router/placement.py): prefix-cache affinity balanced against load, per request."""

from __future__ import annotations

import pytest

from specedge.cloud.router.placement import Candidate, NoVerifier, place


def candidate(address: str, load: float = 0, cached: int = 0, placed: int = 0) -> Candidate:
    return Candidate(address, load, cached, placed)


def test_the_verifier_holding_the_longest_prefix_wins():
    chosen = place([candidate("a", cached=32), candidate("b", cached=96), candidate("c")])
    assert (chosen.address, chosen.reason, chosen.cached_tokens) == ("b", "affinity", 96)


def test_a_busier_holder_keeps_the_request_within_the_threshold_and_loses_it_beyond():
    assert place([candidate("a", load=4, cached=64), candidate("b")], balance_threshold=4).address == "a"
    over = place([candidate("a", load=5, cached=64), candidate("b")], balance_threshold=4)
    assert (over.address, over.reason) == ("b", "load")


def test_beyond_the_threshold_the_best_cached_of_the_others_wins():
    chosen = place([candidate("a", load=9, cached=96), candidate("b", load=1, cached=32), candidate("c")],
                   balance_threshold=4)
    assert (chosen.address, chosen.reason) == ("b", "affinity")


def test_a_saturated_verifier_does_not_turn_affinity_off_for_the_others():
    """The fleet is imbalanced (a holds 20 sessions), yet b still gets the prompts it has cached rather than
    c, the least loaded: the threshold is measured per request against the candidates, not fleet-wide."""
    fleet = [candidate("a", load=20, cached=64), candidate("b", load=3, cached=64), candidate("c", load=0)]
    assert place(fleet).address == "b"


def test_without_a_cached_prefix_the_least_loaded_wins_and_ties_spread():
    assert place([candidate("a", load=2), candidate("b", load=1)]).reason == "load"
    assert place([candidate("a", load=2), candidate("b", load=1)]).address == "b"
    assert place([candidate("a", placed=3), candidate("b", placed=2)]).address == "b"


def test_round_robin_and_least_loaded_ignore_the_cache():
    fleet = [candidate("b", cached=64), candidate("a")]
    assert [place(fleet, "round-robin", turn=t).address for t in range(4)] == ["a", "b", "a", "b"]
    assert place([candidate("a", load=1, cached=64), candidate("b")], "least-loaded").address == "b"


def test_no_candidate_and_an_unknown_policy_are_errors():
    with pytest.raises(NoVerifier):
        place([])
    with pytest.raises(ValueError, match="unknown placement policy"):
        place([candidate("a")], "random")


def test_a_verifier_load_counts_sessions_queue_and_kv_use_with_its_own_sessions_known_now():
    from specedge.cloud.router.fleet import KV_WEIGHT, Member
    from specedge.protos import verifier_pb2 as pb

    member = Member("a", channel=None, load=pb.Load(active_sessions=3, waiting=2, kv_used=0.5))
    assert member.load_score == 3 + 2 + 0.5 * KV_WEIGHT
    member.relayed_at_report = member.relayed = 1  # one of the 3 was this router's when the report came
    member.relayed = 3  # since then it placed two more; the others' two are known from the report only
    assert member.load_score == 2 + 3 + 2 + 0.5 * KV_WEIGHT
    member.relayed = 0  # and all of its own ended
    assert member.load_score == 2 + 0 + 2 + 0.5 * KV_WEIGHT
