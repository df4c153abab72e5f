"""Trees sent ahead of the verdict in flight (edge pipelining over long round trips): the verifier verifies
what is left of such a tree once the verdicts before it are committed, so output stays exactly the
target's; over a long round trip the edge keeps two trees in flight (when it does is the controller's
rule, tests/test_tree_size_controller.py); where nothing of a tree ahead is left, the verifier drafts for it
when asked (it knows the verdict before it, the edge did not), output unchanged; a drafter that drafts
beyond the in-flight tree's likeliest path (the model drafter) sends its trees below that path, and sampled
such trees keep the target distribution; a link that resets mid-stream loses nothing, trees in flight
included. Tiny model (its greedy output soon repeats itself: what
the verifier's retrieval drafts need), real gRPC on 127.0.0.1, the network-emulating proxy for the round
trip."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grpc import PROMPT, V, solo_output, tiny_verifier

from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.controller import TreeSizeController
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableSession
from specedge.edge.transport import RemoteVerifier
from specedge.netem.proxy import EmbeddedProxy, NetworkConditions

LONG = SamplingParams(max_new_tokens=60)


@pytest.fixture(scope="module")
def server():
    with tiny_verifier() as s:
        s.service.scheduler.costs = StatedCosts()
        yield s


@pytest.fixture(scope="module")
def reference(server) -> list[int]:
    return solo_output(server, params=LONG)


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down, in node order."""
    return [tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(len(tree))]


@st.composite
def trees(draw) -> DraftTree:
    n = draw(st.integers(0, 24))
    tokens, parents = [], []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        taken = {tokens[c] for c in range(i) if parents[c] == parent}
        tokens.append(draw(st.integers(0, 5).filter(lambda t: t not in taken)))
        parents.append(parent)
    probs = draw(st.lists(st.floats(0.01, 1.0), min_size=n, max_size=n))
    accept = []
    for i, p in enumerate(probs):  # path probabilities: never above the parent's
        accept.append(p if parents[i] < 0 else min(p, accept[parents[i]]))
    return DraftTree(tokens, parents, accept_probs=accept)


@settings(max_examples=300, deadline=None)
@given(tree=trees(), path=st.lists(st.integers(0, 5), max_size=4))
def test_what_is_left_of_a_tree_is_exactly_the_nodes_below_the_committed_path(tree, path):
    rest = tree.after(path)
    rest.validate(vocab_size=6)
    below = [p[len(path) :] for p in token_paths(tree) if len(p) > len(path) and list(p[: len(path)]) == path]
    spelled = not path or tuple(path) in token_paths(tree)
    assert token_paths(rest) == (below if spelled else [])  # same nodes, same (best-first) order
    for i, p in enumerate(token_paths(rest)):  # estimates now given the path
        whole = tree.accept_probs[token_paths(tree).index(tuple(path) + p)]
        given_path = tree.accept_probs[token_paths(tree).index(tuple(path))] if path else 1.0
        assert rest.accept_probs[i] == pytest.approx(min(1.0, whole / given_path))


@settings(max_examples=200, deadline=None)
@given(tree=trees(), sent=st.integers(0, 24), path=st.lists(st.integers(0, 5), max_size=4))
def test_the_nodes_sent_keep_the_whole_draft_they_were_cut_from_through_what_is_left(tree, sent, path):
    rest = tree.prefix(sent).after(path)  # (a drafter learns from its unsent nodes by it: edge/retrieval.py)
    whole = rest.drafted if rest.drafted is not None else rest
    assert token_paths(whole) == token_paths(tree.after(path))


def test_proposals_follow_their_nodes_into_what_is_left():
    tree = DraftTree([1, 2, 3, 4], [-1, 0, 1, 0], proposals={-1: ([1], [1.0]), 0: ([2, 4], [0.6, 0.4]),
                                                            1: ([3], [1.0])})
    rest = tree.after([1])
    assert rest.tokens == [2, 3, 4] and rest.parents == [-1, 0, -1]
    assert rest.proposals == {-1: ([2, 4], [0.6, 0.4]), 0: ([3], [1.0])}


@settings(max_examples=200, deadline=None)
@given(in_flight=trees(), draft=trees())
def test_a_draft_hung_below_the_likeliest_path_is_exactly_what_is_left_once_that_path_is_committed(in_flight, draft):
    """The tree a model drafter sends ahead (edge/generation.py): the in-flight tree's likeliest path as a chain,
    its draft below. Once the verdict before commits that path, what is left is the draft itself: its nodes,
    order, notes, proposals and (given the path) estimates; the whole is a valid tree, the chain's estimates
    above the draft's."""
    from specedge.edge.generation import _below

    path = in_flight.likeliest_path()
    assert all(in_flight.parents[b] == a for a, b in zip([-1] + path, path))
    assert not in_flight.children()[path[-1] + 1 if path else 0]  # down to a leaf
    assert all(in_flight.accept_probs[c] <= in_flight.accept_probs[b] for a, b in zip([-1] + path, path)
               for c in in_flight.children()[a + 1])  # each the likeliest child
    in_flight.notes = [("in flight", i) for i in range(len(in_flight))]
    draft.notes = [("draft", i) for i in range(len(draft))]
    if len(draft):
        draft.proposals = {-1: ([t for t in range(6)], [1 / 6] * 6)}
    tree = _below(in_flight, path, draft)
    tree.validate(vocab_size=6)
    chain, below = tree.accept_probs[: len(path)], tree.accept_probs[len(path) :]
    assert chain == sorted(chain, reverse=True) and all(p <= (chain[-1] if chain else 1.0) for p in below)
    rest = tree.after([in_flight.tokens[i] for i in path])
    assert (rest.tokens, rest.parents, rest.notes, rest.proposals) == (draft.tokens, draft.parents, draft.notes,
                                                                      draft.proposals)
    assert rest.accept_probs == pytest.approx(draft.accept_probs)


def test_a_tree_sent_ahead_is_verified_below_what_the_verdict_before_it_committed(server, reference):
    session = RemoteVerifier(server.target).open(PROMPT, LONG)
    session.send(DraftTree.chain(reference[:3]))  # opens; commits reference[:4] (3 drafts + its own token)
    session.send(DraftTree.chain(reference[:9]), root_length=len(PROMPT))  # drafted before that verdict
    first, second = session.receive(), session.receive()
    assert first.tokens == reference[:4]
    assert second.tokens == reference[4:10] and second.accepted == [0, 1, 2, 3, 4]  # the 5 nodes left
    assert (first.verified_nodes, second.verified_nodes) == (3, 5)  # what each pass's time paid for
    # A tree that does not spell what was committed since its root: only the verifier's own next token.
    session.send(DraftTree.chain([(reference[10] + 1) % V, 7]), root_length=len(PROMPT) + 9)
    assert session.receive().tokens == [reference[10]]
    # An empty tree ahead (what the controller sends where no draft is worth a node): the next token.
    session.send(DraftTree.chain(reference[11:13]))
    session.send(DraftTree.empty(), root_length=len(PROMPT) + 11)
    assert session.receive().tokens == reference[11:14] and session.receive().tokens == [reference[14]]
    session.close()


def test_where_nothing_of_a_tree_ahead_is_left_the_verifier_drafts_for_it_when_asked(server, reference):
    """The verdict then commits the verifier's draft as far as the target agrees, plus its own token; it
    accepts none of the client's nodes and hints at the root only, as it would have without the draft."""
    session = RemoteVerifier(server.target).open(PROMPT, LONG, hints_top_k=4)
    session.send(DraftTree.chain(reference[:8]))  # opens; commits reference[:9]
    session.send(DraftTree.chain([(reference[0] + 1) % V]), root_length=len(PROMPT), fill_tokens=8)
    first, second = session.receive(), session.receive()
    assert first.tokens == reference[:9]
    assert len(second.tokens) > 1 and second.tokens == reference[9 : 9 + len(second.tokens)]
    assert second.accepted == [] and second.verifier_drafted == len(second.tokens) - 1
    assert len(second.hints) == 1 and second.verified_nodes >= second.verifier_drafted  # its own nodes, all verified
    # Not asked (fill_tokens 0): the bare pass's one token, as before.
    end = len(PROMPT) + len(first.tokens) + len(second.tokens)
    session.send(DraftTree.empty())
    session.send(DraftTree.chain([(reference[0] + 1) % V]), root_length=end)
    third, fourth = session.receive(), session.receive()
    assert len(third.tokens) == len(fourth.tokens) == 1 and fourth.verifier_drafted == fourth.verified_nodes == 0
    session.close()


def test_where_nodes_of_a_tree_ahead_are_left_the_verifier_adds_its_draft_below_them_when_asked(server, reference):
    """It knows the verdict before, which the tree's sender did not: the verdict accepts the client's nodes
    left and commits the verifier's below them as far as the target agrees; the client reads the verdict
    and hints of its own nodes only."""
    session = RemoteVerifier(server.target).open(PROMPT, LONG, hints_top_k=4)
    session.send(DraftTree.chain(reference[:8]))  # opens; commits reference[:9]
    ahead = DraftTree.chain(reference[:10])  # drafted before that verdict: reference[9] is left of it
    ahead.accept_probs = [0.9 ** (i + 1) for i in range(10)]
    session.send(ahead, root_length=len(PROMPT), fill_tokens=8)
    first, second = session.receive(), session.receive()
    assert first.tokens == reference[:9]
    assert second.accepted == [0] and second.tokens == reference[9 : 9 + len(second.tokens)]
    assert second.verifier_drafted == len(second.tokens) - 2 > 0
    assert len(second.hints) == 2 and second.verified_nodes >= 1 + second.verifier_drafted  # its node and the draft
    session.close()


@pytest.mark.parametrize("left", [0, 1], ids=["nothing left", "a node left"])
def test_the_verifiers_draft_leaves_a_token_of_the_budget_for_the_tree_after_it(server, reference, left):
    """So a client that sends a tree ahead of such a verdict (which it does only while that verdict cannot
    end the budget: edge/generation.py) never sends one past the end."""
    session = RemoteVerifier(server.target).open(PROMPT, SamplingParams(max_new_tokens=12))
    out = session.step(DraftTree.chain(reference[:6])).tokens  # 7 of 12
    while len(out) < 12:
        n = left if 12 - len(out) >= 3 else 0  # (a node left commits two tokens at least)
        ahead = DraftTree.chain(out[-1:] + reference[len(out) : len(out) + n] if n else [(reference[0] + 1) % V])
        ahead.accept_probs = [0.9] * len(ahead)
        session.send(ahead, root_length=len(PROMPT) + (len(out) - 1 if n else 0), fill_tokens=8)
        verdict = session.receive()
        assert len(verdict.tokens) <= max(1, 12 - len(out) - 1)
        assert verdict.verifier_drafted <= max(0, 12 - len(out) - 2)
        out += verdict.tokens
    assert out == reference[:12]
    session.close()


def test_the_verifier_keeps_a_clients_drafting_state_for_its_next_sessions():
    """What its drafter learned in a client's session that it filled (cloud/verifier_drafter.py, WarmDrafters)
    goes to the client's next session that it fills; the client is its identity and the name it gives."""
    with tiny_verifier() as server:
        warm = server.running.service.warm_drafters

        def filled_session(client_id: str) -> None:
            session = RemoteVerifier(server.target).open(PROMPT, LONG, client_id=client_id)
            first = session.step(DraftTree.empty()).tokens
            wrong = DraftTree.chain([(first[0] + 1) % V])  # rooted at the prompt's end: nothing of it is left
            session.send(wrong, root_length=len(PROMPT), fill_tokens=8)
            session.receive()
            session.close()

        def kept(n: int) -> None:  # the server files a session's state once the session's stream has ended
            deadline = time.monotonic() + 30
            while len(warm) != n:
                assert time.monotonic() < deadline, f"{len(warm)} clients kept, not {n}"
                time.sleep(0.01)

        filled_session("app")
        kept(1)
        (key,) = warm._kept
        assert key.endswith("|app")
        model = warm._kept[key].model
        filled_session("app")  # takes the state and gives it back
        kept(1)
        assert warm._kept[key].model is model and warm._kept[key].history.n > 0
        filled_session("other app")
        kept(2)


@pytest.mark.parametrize("fill", [True, False])
def test_an_edge_with_nothing_to_draft_commits_the_verifiers_drafts_over_a_long_round_trip(server, reference, fill):
    nothing = FunctionDrafter(lambda committed: DraftTree.empty())
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=nothing, controller=Priced(max_nodes=8, fill=fill))
    assert got.token_ids == reference and got.ahead >= 2
    if fill:
        assert got.verifier_drafted > len(reference) / 2 and got.rounds < len(reference) / 2
    else:
        assert got.verifier_drafted == 0 and got.rounds == len(reference)


@pytest.mark.parametrize("drafts", ["none", "the output's next 6"])
def test_seeded_sampling_gives_the_same_tokens_with_the_verifiers_drafts_as_without(server, drafts):
    """The draws depend on the seed and the position only (tests/test_acceptance.py), so any draft, the
    verifier's own included, beside the client's or in their place, leaves a seeded output as it is."""
    params = SamplingParams(max_new_tokens=60, temperature=1.0, seed=3)
    expected = solo_output(server, params=params)
    drafter = FunctionDrafter(lambda committed: DraftTree.empty()) if drafts == "none" else oracle(expected, depth=6)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target, params), drafter=drafter, controller=Priced(max_nodes=8))
    assert got.token_ids == expected and got.ahead >= 2


def test_trees_sent_ahead_of_the_verdict_that_ends_the_budget_get_empty_verdicts(server, reference):
    """A deep pipeline has many trees in flight when a verdict reaches max_new_tokens: those sent before that
    verdict get empty verdicts, without a pass; a tree sent after it is refused as before."""
    session = RemoteVerifier(server.target).open(PROMPT, SamplingParams(max_new_tokens=6))
    session.send(DraftTree.chain(reference[:5]))  # opens; commits reference[:6], the whole budget
    session.send(DraftTree.empty(), root_length=len(PROMPT), fill_tokens=8)  # sent before that verdict
    session.send(DraftTree.chain(reference[6:8]), root_length=len(PROMPT) + 3)
    first, second, third = session.receive(), session.receive(), session.receive()
    assert first.tokens == reference[:6]
    assert second.tokens == third.tokens == [] and second.compute_ms == third.compute_ms == 0
    session.send(DraftTree.empty(), root_length=len(PROMPT) + 6)  # knowing every verdict: past the budget
    with pytest.raises(grpc.RpcError) as caught:
        session.receive()
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "max_new_tokens" in caught.value.details()


def test_trees_sent_ahead_of_the_verdict_that_commits_an_end_of_sequence_get_empty_verdicts(reference):
    """The same at an end-of-sequence token; a tree sent after that verdict is verified (a client may go on)."""
    eos = reference[5]
    stop = reference.index(eos)  # where the target first says it
    with tiny_verifier(eos_token_id=eos) as server:
        session = RemoteVerifier(server.target).open(PROMPT, LONG)
        session.send(DraftTree.chain(reference[:stop]))  # opens; commits up to and including the end of sequence
        session.send(DraftTree.empty(), root_length=len(PROMPT), fill_tokens=8)
        first, second = session.receive(), session.receive()
        assert first.tokens == reference[: stop + 1] and second.tokens == []
        assert session.step(DraftTree.empty()).tokens == [reference[stop + 1]]
        session.close()


def test_over_a_round_trip_of_many_passes_more_trees_stay_in_flight_and_the_output_is_unchanged(server, reference):
    """With a round trip of eight passes (the controller's stated timings), the edge keeps more than two trees
    in flight, the verifier drafting the bare ones; the generation ends with trees still in flight, cleanly."""
    nothing = FunctionDrafter(lambda committed: DraftTree.empty())
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=nothing, controller=Priced(max_nodes=8))
    assert got.token_ids == reference
    in_flight = [sum(sent < verdict for sent in got.sent_ms[i:]) for i, verdict in enumerate(got.verdict_ms)]
    assert max(in_flight) > 2, in_flight
    assert got.verifier_drafted > len(reference) / 2


def test_a_tree_rooted_outside_the_committed_sequence_is_invalid(server):
    session = RemoteVerifier(server.target).open(PROMPT, LONG)
    session.step(DraftTree.empty())
    session.send(DraftTree.chain([1]), root_length=len(PROMPT) + 5)  # only one token is committed
    with pytest.raises(grpc.RpcError) as caught:
        session.receive()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "root_length" in caught.value.details()
    assert solo_output(server) == solo_output(server)  # the server serves on


def oracle(reference: list[int], depth: int = 24, confidence: float = 0.9) -> FunctionDrafter:
    """Drafts the true continuation (then a wrong token where it runs out), acceptance estimates
    confidence^d."""

    def draft(committed: list[int]) -> DraftTree:
        n = len(committed) - len(PROMPT)
        tokens = reference[n : n + depth] or [(committed[-1] + 1) % V]
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)),
                         accept_probs=[confidence ** (i + 1) for i in range(len(tokens))])

    return FunctionDrafter(draft)


# The tiny verifier's pass as it measures on an idle machine (about 9 ms bare, 14 ms with 8 nodes), and the
# proxy's round trip (40 ms each way)
PASS = CostModel(((0, 10.0), (64, 74.0)))
ROUND_TRIP_MS = 80.0


class Priced(TreeSizeController):
    """The controller with its timings stated, not measured: a pass as PASS says, a round trip of ROUND_TRIP_MS.
    On a loaded test machine the tiny verifier's passes now and then measure several times slower, and
    whether a tree ahead pays rightly changes with them; the tests here are of what trees ahead do, those of
    when they pay are in tests/test_tree_size_controller.py."""

    def __init__(self, **kwargs) -> None:
        super().__init__(overhead_ms=ROUND_TRIP_MS, alpha=0.0, **kwargs)

    def choose(self, draft, cost, remaining) -> int:
        return super().choose(draft, PASS, remaining)

    def ahead(self, draft, cost, remaining, covered, beyond=False) -> int | None:
        return super().ahead(draft, PASS, remaining, covered, beyond)

    def deeper(self, draft, cost, remaining, covered) -> int:
        return super().deeper(draft, PASS, remaining, covered)

    def depth(self, cost) -> int:
        return super().depth(PASS)


class StatedCosts:
    """The verifier's pass times stated (PASS), not measured, as `Priced` states the edge's: how many nodes the
    verifier's own draft adds to a tree ahead is priced by them, and on a loaded test machine a measured pass
    now and then reads several times slower, which rightly stops that draft from adding any."""

    def observe(self, tree_tokens: int, ms: float) -> None:
        pass

    def model(self) -> CostModel:
        return PASS


def through(link: str, params=LONG, client: str = "c") -> ResumableSession:
    """`client`: the verifier keeps each client's drafting state across its sessions (what its own drafts learned)."""
    return ResumableSession(lambda: RemoteVerifier(link), PROMPT, params, client, "", retries=20, backoff_s=0.01)


def test_over_a_long_round_trip_trees_go_out_ahead_and_commit_drafts_and_the_output_is_unchanged(server, reference):
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=oracle(reference), controller=Priced(max_nodes=8))
    assert got.token_ids == reference
    assert got.ahead >= 2  # rounds whose tree went out before the verdict ahead of it
    # The rounds' times say which: a tree ahead went out before the verdict before it came in
    went_ahead = [sent < before for sent, before in zip(got.sent_ms[1:], got.verdict_ms)]
    assert len(got.sent_ms) == len(got.verdict_ms) == got.rounds and sum(went_ahead) == got.ahead
    assert all(sent < verdict for sent, verdict in zip(got.sent_ms, got.verdict_ms))
    ahead_accepted = [a for a, sent in zip(got.accepted, got.tree_sizes) if sent]
    assert max(ahead_accepted) > 1  # trees sent ahead did get drafts accepted


def test_overlap_can_be_turned_off(server, reference):
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=oracle(reference),
                       controller=TreeSizeController(max_nodes=8, overlap=False))
    assert got.token_ids == reference and got.ahead == 0


@pytest.mark.parametrize("beyond", [False, True], ids=["bare trees beyond the second", "trees below each other"])
def test_a_link_that_resets_with_trees_in_flight_loses_nothing(server, reference, beyond):
    conditions = NetworkConditions(delay_ms=20, reset_probability=0.05, seed=3)
    drafter = oracle(reference, depth=6)
    with EmbeddedProxy(server.target, conditions) as link:
        session = through(link.target)
        got = generate(session, drafter=BeyondOracle(drafter.fn) if beyond else drafter,
                       controller=Priced(max_nodes=4))
    assert got.token_ids == reference
    assert session.resumes >= 1 and got.ahead >= 1


def test_the_retrieval_drafter_with_hints_learns_from_trees_sent_ahead_and_stays_lossless(server, reference):
    """Each verdict is learned from with the notes of the nodes it judged (DraftTree.notes travel through
    `after`), even when the drafter has proposed another tree since."""
    from specedge.edge.retrieval import RetrievalDrafter

    drafter = RetrievalDrafter(hints_top_k=8)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        session = ResumableSession(lambda: RemoteVerifier(link.target), PROMPT, LONG, "c", "", hints_top_k=8)
        got = generate(session, drafter=drafter, controller=Priced(max_nodes=8))
    assert got.token_ids == reference and got.ahead >= 2
    assert sum(reached for reached, _ in drafter.verdicts_by_source.values()) > 0


def test_a_verdict_is_learned_from_while_the_next_is_on_its_way(server, reference):
    """Over a session that sends without waiting, the retrieval drafter learns from a verdict (`learn`) after
    the next tree went out and before its verdict is awaited, off the edge's time between a verdict and the
    next draft; and it still learns from every verdict."""
    from specedge.edge.retrieval import RetrievalDrafter

    drafter = RetrievalDrafter(hints_top_k=0)
    session = ResumableSession(lambda: RemoteVerifier(server.target), PROMPT, LONG, "c", "")
    receive, unlearned_at_receive = session.receive, []

    def receive_watched():
        unlearned_at_receive.append(drafter._unlearned is not None)
        return receive()

    session.receive = receive_watched
    got = generate(session, drafter=drafter, controller=TreeSizeController(max_nodes=8))
    assert got.token_ids == reference and len(unlearned_at_receive) == got.rounds
    assert not any(unlearned_at_receive)
    assert drafter.model.reached.sum() > 0




def test_a_drafter_that_uses_the_wait_sends_trees_ahead_too_and_uses_only_waits_with_nothing_ahead(server, reference):
    """A speculating drafter (the model drafter: it drafts ahead during a verdict's wait) pipelines as any other
    over a long round trip; `speculate` is called only while a single tree is in flight (the generation loop
    drafts the tree ahead during the others), and the output is unchanged. Without overlap every wait is one.
    (Trees in flight: those sent less the verdicts observed, both counted on the generation's thread; at most
    two here: in a deeper pipeline no wait has a single tree in flight.)"""
    for overlap in (True, False):
        drafter, counts, at_speculate = oracle(reference), {"sent": 0, "observed": 0}, []
        drafter.speculate = lambda stop: at_speculate.append(counts["sent"] - counts["observed"])
        observe = drafter.observe

        def counted_observe(*args, observe=observe):
            counts["observed"] += 1
            return observe(*args)

        drafter.observe = counted_observe
        with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
            session = through(link.target)
            send = session.send

            def counted_send(*args, send=send, **kwargs):
                counts["sent"] += 1
                return send(*args, **kwargs)

            session.send = counted_send
            got = generate(session, drafter=drafter, controller=Priced(max_nodes=8, overlap=overlap, max_in_flight=2))
        assert got.token_ids == reference
        assert got.ahead >= 2 if overlap else got.ahead == 0
        assert at_speculate and set(at_speculate) == {1}
        assert len(at_speculate) < got.rounds if overlap else len(at_speculate) == got.rounds


class BeyondOracle(FunctionDrafter):
    """`oracle`'s drafts, and drafts beyond a path as if it were committed (as the model drafter makes them)."""

    def propose_after(self, path: list[int]) -> DraftTree:
        return self.fn(self.committed + path)


def test_a_drafter_that_drafts_beyond_a_path_sends_trees_below_the_likeliest_path_in_flight(server, reference):
    """A tree ahead drafted from the committed end repeats what the tree in flight holds (half the rounds
    verify nothing of it); a drafter that can draft beyond a path (`propose_after`) drafts below the in-flight
    tree's likeliest path, so each tree ahead adds what lies beyond that verdict: a confident drafter of 4
    tokens that is right has every round commit its drafts, trees ahead as well."""
    drafter = BeyondOracle(oracle(reference, depth=4, confidence=0.99).fn)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=drafter, controller=Priced(max_nodes=8, fill=False))
    assert got.token_ids == reference
    assert got.ahead >= got.rounds / 2
    assert sum(a >= 3 for a in got.accepted) >= got.rounds - 3


def test_while_a_tree_ahead_is_in_flight_a_drafter_beyond_paths_reads_on_past_its_likeliest_path(server, reference):
    """A drafter that drafts beyond a path gets the waits with a tree ahead in flight too, told that tree's
    likeliest path: its next draft will start beyond it (the model drafter computes those logits meanwhile)."""
    drafter = BeyondOracle(oracle(reference, depth=4, confidence=0.99).fn)
    sent, observed, calls = [], [0], []
    drafter.speculate = lambda stop, then=(): calls.append((len(sent) - observed[0], list(then), sent[-1].tokens))
    observe = drafter.observe

    def counted_observe(*args):
        observed[0] += 1
        return observe(*args)

    drafter.observe = counted_observe
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        session = through(link.target)
        send = session.send

        def recorded_send(tree, *args, **kwargs):
            sent.append(tree)
            return send(tree, *args, **kwargs)

        session.send = recorded_send
        got = generate(session, drafter=drafter, controller=Priced(max_nodes=8, fill=False))
    assert got.token_ids == reference
    with_ahead = [(then, last) for in_flight, then, last in calls if in_flight == 2]
    assert len(with_ahead) >= got.ahead / 2
    assert all(then == last for then, last in with_ahead)  # (the trees are chains: the whole tree is the path)


def test_over_a_round_trip_of_many_passes_a_drafter_beyond_paths_keeps_its_trees_in_flight_below_each_other(
        server, reference):
    """With a round trip of eight passes, a drafter that drafts beyond a path keeps more than two trees in flight
    too, each drafted below the likeliest path through the trees before it (the last one's chain): the first
    trees go out together, before any verdict, and a confident drafter of 4 tokens that is right has the third
    commit its drafts; the output is the target's. (Later trees' nodes are mostly gone by their turn: the
    verifier adds its own draft below what is left of a tree, and its verdict then commits past the path the
    trees behind it were drafted below.)"""
    drafter = BeyondOracle(oracle(reference, depth=4, confidence=0.99).fn)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target, client="fresh"), drafter=drafter, controller=Priced(max_nodes=8))
    assert got.token_ids == reference
    in_flight = [sum(sent < verdict for sent in got.sent_ms[i:]) for i, verdict in enumerate(got.verdict_ms)]
    assert max(in_flight) > 2, in_flight
    assert got.sent_ms[2] < got.verdict_ms[0] and got.accepted[2] >= 3, (got.sent_ms, got.accepted)


class SampledChains:
    """Sampled drafts with their proposal q sent along (as the model drafter's): a chain of one draw from the
    committed end, of two draws beyond a path. q is fixed, so that the verifier's rejection sampling, not q,
    decides. `claimed`: the q the tree says its draws came from (the true one unless a test lies)."""

    def __init__(self, q: np.ndarray, seed: int, claimed: np.ndarray | None = None) -> None:
        self.q, self.rng = q, np.random.default_rng(seed)
        self.claimed = q if claimed is None else claimed

    def begin(self, prompt_ids, params=None) -> None:
        pass

    def propose(self, depth: int = 1) -> DraftTree:
        tokens = [int(t) for t in self.rng.choice(len(self.q), size=depth, p=self.q)]
        q = (list(range(len(self.q))), self.claimed.tolist())
        return DraftTree(tokens, list(range(-1, depth - 1)), {p: q for p in range(-1, depth - 1)},
                         accept_probs=[0.5 ** (i + 1) for i in range(depth)])

    def propose_after(self, path: list[int]) -> DraftTree:
        return self.propose(depth=2)

    def observe(self, tree, result) -> None:
        pass

    def end(self) -> None:
        pass


class AlwaysAhead(TreeSizeController):
    """Sends every draft whole, and a tree ahead whenever the budget allows: the trees do not depend on
    timing, so a seeded run gives the same tokens every time."""

    def choose(self, draft, cost, remaining) -> int:
        return len(draft)

    def ahead(self, draft, cost, remaining, covered, beyond=False) -> int:
        return len(draft)


def third_token_counts(q: np.ndarray, trials: int, claimed: np.ndarray | None = None):
    """(counts of the third sampled token over seeded trials, its exact probabilities, rounds sent ahead) for
    a model with len(q) tokens whose third token is decided by a tree sent ahead where that tree is left."""
    from tiny_models import tiny_llama

    from specedge.cloud.config import ServerConfig
    from specedge.cloud.launch import EmbeddedVerifier

    hf = tiny_llama(vocab_size=len(q), seed=1)
    hf.generation_config.eos_token_id = None
    prompt = [2, 3, 1, 0, 2]
    config = ServerConfig(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, max_new_tokens=64, gather_ms=1.0)
    counts, ahead = np.zeros(len(q)), 0
    with EmbeddedVerifier(config, (hf, None)) as server:
        for seed in range(trials):
            params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed)
            session = ResumableSession(lambda: RemoteVerifier(server.target), prompt, params, "c", "")
            got = generate(session, drafter=SampledChains(q, seed, claimed), controller=AlwaysAhead(fill=False))
            counts[got.token_ids[2]] += 1
            ahead += got.ahead
    v, n = len(q), len(prompt)
    sequences = torch.tensor([prompt + [a, b] for a in range(v) for b in range(v)])
    with torch.inference_mode():
        p = torch.softmax(hf(sequences).logits.double(), dim=-1)
    first, second, third = p[0, n - 1], p[::v, n], p[:, n + 1].reshape(v, v, v)  # x1; x2 given x1; x3 given both
    return counts, torch.einsum("a,ab,abc->c", first, second, third).numpy(), ahead


def test_sampled_drafts_sent_ahead_beyond_a_path_keep_the_target_distribution():
    """The third token of each generation here is decided by a tree sent ahead where that tree is still
    standing (the first verdict took a one-token draft and its bonus token matched the first of the two
    draws below the path), by plain sampling otherwise; drafts come from q with q sent along. Over seeded
    runs (the seeds are fixed: the same tokens every run; p = 0.0066 for these 400, 0.57 for 1,600), its
    frequencies match the target's exact distribution; and a drafter that misstates q is caught by the same
    check (p ~ 1e-9), so the check can see a bias."""
    from scipy.stats import chisquare

    q = np.array([0.85, 0.05, 0.05, 0.05])
    counts, exact, ahead = third_token_counts(q, trials=400)
    assert ahead >= 400  # trees went ahead in every generation
    assert chisquare(counts, exact * counts.sum()).pvalue > 1e-3, (counts, exact)
    lying, _, _ = third_token_counts(q, trials=400, claimed=np.full(4, 0.25))
    assert chisquare(lying, exact * lying.sum()).pvalue < 1e-3, (lying, exact)


class TrueContinuation:
    """A hybrid's source (tests/test_hybrid.py has scripted ones): drafts `depth` tokens of the reference
    continuation of what it was told is committed (beyond `path` for a tree ahead), then `wrong` tokens that
    are not, estimates `confidence`^d; records every verdict it is told of."""

    hints_top_k = 0

    def __init__(self, reference: list[int], depth: int, wrong: int = 0, confidence: float = 0.9) -> None:
        self.reference, self.depth, self.wrong, self.confidence = reference, depth, wrong, confidence
        self.committed: list[int] = []
        self.told: list[tuple[DraftTree, object]] = []

    def begin(self, prompt_ids, params=None) -> None:
        self.committed = []

    def propose(self, known_only: bool = False) -> DraftTree:
        return self.propose_after([])

    def propose_after(self, path: list[int], known_only: bool = False) -> DraftTree:
        n = len(self.committed) + len(path)
        tokens = self.reference[n : n + self.depth]
        tokens += [(t + 1) % V for t in self.reference[n + len(tokens) : n + len(tokens) + self.wrong]]
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)),
                         accept_probs=[self.confidence ** (i + 1) for i in range(len(tokens))])

    def observe(self, tree: DraftTree, result) -> None:
        self.told.append((tree, result))
        self.committed += result.tokens

    def speculate(self, stop, then=()) -> None:
        pass

    def learn(self) -> None:
        pass

    def learn_hints(self, tree, hints) -> None:
        pass

    def end(self) -> None:
        pass


def test_the_hybrid_sends_trees_ahead_and_each_source_learns_from_its_own_nodes(server, reference):
    """The hybrid over a long round trip: retrieval drafts 2 true tokens and a wrong one, the model 5 true ones,
    each beyond the likeliest path of the tree in flight for a tree ahead. Trees go ahead, the model's nodes
    are committed in them, the output is the target's; and each verdict reaches each source on the nodes of
    its own draft that were verified (what was left of it once the verdict before was committed): its
    accepted nodes spell the committed tokens, and every source is told every committed token once, in order."""
    from specedge.edge.hybrid import HybridDrafter

    retrieval = TrueContinuation(reference, depth=2, wrong=1)
    model = TrueContinuation(reference, depth=5, confidence=0.95)
    drafter = HybridDrafter(retrieval, model, max_nodes=8)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=drafter, controller=Priced(max_nodes=8, fill=False))
    assert got.token_ids == reference
    assert got.ahead >= got.rounds / 2
    for source in (retrieval, model):
        # (the last verdict may run past the token budget: the generation cuts it, its drafter hears it whole)
        assert len(source.told) == got.rounds and source.committed[: len(reference)] == reference
        for tree, result in source.told:
            assert all(tree.parents[a] == (accepted[-1] if accepted else -1)
                       for a, accepted in ((a, result.accepted[:i]) for i, a in enumerate(result.accepted)))
            assert [tree.tokens[a] for a in result.accepted] == result.tokens[: len(result.accepted)]
    # The model's own tokens beyond retrieval's two (and wrong third) were committed, in trees ahead too
    assert sum(len(result.accepted) >= 3 for _, result in model.told) >= got.rounds / 2


def test_over_a_round_trip_of_many_passes_the_hybrid_keeps_a_round_for_every_tree_in_flight(server, reference):
    """The hybrid with more than two trees in flight, the verifier drafting where nothing of one is left: every
    tree it sent is its own round, each source is told every committed token once, in order, and the output is
    the target's."""
    from specedge.edge.hybrid import HybridDrafter

    retrieval = TrueContinuation(reference, depth=2, wrong=1)
    model = TrueContinuation(reference, depth=5, confidence=0.95)
    drafter = HybridDrafter(retrieval, model, max_nodes=8)
    with EmbeddedProxy(server.target, NetworkConditions(delay_ms=40)) as link:
        got = generate(through(link.target), drafter=drafter, controller=Priced(max_nodes=8))
    assert got.token_ids == reference
    in_flight = [sum(sent < verdict for sent in got.sent_ms[i:]) for i, verdict in enumerate(got.verdict_ms)]
    assert max(in_flight) > 2, in_flight
    for source in (retrieval, model):
        assert len(source.told) == got.rounds and source.committed[: len(reference)] == reference
