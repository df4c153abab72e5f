"""Acceptance rules: greedy reproduces argmax decoding; the sampling rules reproduce the target distribution."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specedge.cloud import acceptance
from specedge.cloud.acceptance import verify_tree
from specedge.cloud.sampling import Draws, target_probs
from specedge.cloud.tree_mask import ancestor_mask
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams

GREEDY = SamplingParams()


def logits_with_argmax(argmaxes: list[int], vocab_size: int = 8) -> torch.Tensor:
    """One row of random logits per entry, whose argmax is that entry."""
    logits = torch.randn(len(argmaxes), vocab_size, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_accepts_the_longest_prefix_matching_the_argmax_then_adds_the_argmax_as_bonus():
    tree = DraftTree.chain([3, 5, 7])
    verdict = verify_tree(tree, logits_with_argmax([3, 5, 2, 4]), GREEDY)
    assert verdict == acceptance.Verdict(accepted=[0, 1], tokens=[3, 5, 2], bonus=2)


def test_greedy_accepts_a_fully_matching_chain_and_takes_the_bonus_from_its_last_node():
    tree = DraftTree.chain([3, 5, 7])
    verdict = verify_tree(tree, logits_with_argmax([3, 5, 7, 1]), GREEDY)
    assert verdict == acceptance.Verdict(accepted=[0, 1, 2], tokens=[3, 5, 7, 1], bonus=1)


def test_greedy_with_a_mismatching_first_token_commits_only_the_argmax():
    verdict = verify_tree(DraftTree.chain([3, 5]), logits_with_argmax([6, 5, 0]), GREEDY)
    assert verdict == acceptance.Verdict(accepted=[], tokens=[6], bonus=6)


def test_greedy_on_an_empty_tree_commits_the_argmax_of_the_root_row():
    verdict = verify_tree(DraftTree.empty(), logits_with_argmax([4]), GREEDY)
    assert verdict == acceptance.Verdict(accepted=[], tokens=[4], bonus=4)


def test_greedy_finds_the_matching_branch_even_when_it_is_not_the_first_child():
    #        root
    #     /   |   \
    #   1(0) 4(1) 6(2)
    #             /   \
    #          5(3)   0(4)
    tree = DraftTree(tokens=[1, 4, 6, 5, 0], parents=[-1, -1, -1, 2, 2])
    rows = logits_with_argmax([6, 1, 1, 0, 1, 7])  # root -> 6, node 2 -> 0, node 4 -> 7
    verdict = verify_tree(tree, rows, GREEDY)
    assert verdict == acceptance.Verdict(accepted=[2, 4], tokens=[6, 0, 7], bonus=7)


def random_tree(gen: torch.Generator, n: int, vocab_size: int) -> DraftTree:
    tokens: list[int] = []
    parents: list[int] = []
    while len(tokens) < n:
        parent = int(torch.randint(-1, len(tokens), (), generator=gen))
        token = int(torch.randint(0, vocab_size, (), generator=gen))
        if all(not (parents[i] == parent and tokens[i] == token) for i in range(len(tokens))):
            tokens.append(token)
            parents.append(parent)
    return DraftTree(tokens, parents)


def test_greedy_commits_exactly_the_argmax_chain_on_random_trees():
    """Every committed token is the argmax after the previous one, and the walk stops only when no child has it."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        tree = random_tree(gen, n=int(torch.randint(0, 12, (), generator=gen)), vocab_size=3)
        logits = torch.randn(len(tree) + 1, 3, generator=gen)
        verdict = verify_tree(tree, logits, GREEDY)
        rows = [0] + [i + 1 for i in verdict.accepted]
        assert verdict.tokens == [int(logits[r].argmax()) for r in rows]
        assert verdict.accepted == (tree.path_to(verdict.accepted[-1]) if verdict.accepted else [])
        last = verdict.accepted[-1] if verdict.accepted else -1
        assert verdict.bonus not in [tree.tokens[c] for c in tree.children()[last + 1]]


def test_logits_must_have_one_row_per_node_plus_the_root():
    with pytest.raises(ValueError, match="logits must be"):
        verify_tree(DraftTree.chain([1, 2]), torch.zeros(2, 8), GREEDY)


# --- DraftTree ---------------------------------------------------------------------------------


def test_draft_tree_structure_helpers():
    #          root
    #        /      \
    #     5(0)      2(1)
    #    /    \
    #  7(2)   1(3)
    #           |
    #         3(4)
    tree = DraftTree(tokens=[5, 2, 7, 1, 3], parents=[-1, -1, 0, 0, 3])
    tree.validate(vocab_size=8)
    assert len(tree) == 5
    assert tree.children() == [[0, 1], [2, 3], [], [], [4], []]
    assert tree.depths() == [1, 1, 2, 2, 3]
    assert tree.path_to(4) == [0, 3, 4]
    assert tree.path_to(1) == [1]
    mask = ancestor_mask(tree)
    assert mask.dtype == torch.bool and mask.shape == (6, 6)
    # rows/columns: root, then node i at i + 1
    assert mask[5].tolist() == [True, True, False, False, True, True]  # node 4: root, 0, 3, itself
    assert mask[0].tolist() == [True, False, False, False, False, False]
    assert mask[:, 0].all()


def test_chain_and_empty():
    assert DraftTree.chain([4, 4, 1]) == DraftTree(tokens=[4, 4, 1], parents=[-1, 0, 1])
    assert len(DraftTree.empty()) == 0
    assert DraftTree.empty().children() == [[]]
    assert ancestor_mask(DraftTree.empty()).tolist() == [[True]]


Q3 = ([1, 2, 3], [0.5, 0.25, 0.25])


@pytest.mark.parametrize(
    "tokens, parents, proposals, message",
    [
        ([1, 2], [-1], None, "differ in length"),
        ([1, -1], [-1, 0], None, "outside the vocabulary"),
        ([1, 8], [-1, 0], None, "outside the vocabulary"),
        ([1, 2], [-1, 1], None, r"parent 1 must be in \[-1, 1\)"),  # its own parent
        ([1, 2], [1, -1], None, r"parent 1 must be in \[-1, 0\)"),  # parent after child
        ([1], [-2], None, "parent -2"),
        ([1, 1], [-1, -1], None, "same token"),
        ([1, 2, 2], [-1, 0, 0], None, "same token"),
        ([1], [-1], {-1: ([1, 9], [0.5, 0.5])}, "outside the vocabulary"),
        ([1], [-1], {-1: ([1, 2], [1.5, -0.5])}, "non-negative"),
        ([1], [-1], {-1: ([1, 2], [0.5, 0.4])}, "sum to"),
        ([1], [-1], {-1: ([1, 2], [1.0])}, "2 token ids but 1 probabilities"),
        ([1], [-1], {-1: ([1, 1], [0.5, 0.5])}, "repeated"),
        ([1], [-1], {3: Q3}, "no such node"),
        ([1, 5], [-1, -1], {-1: Q3}, "token 5.* q = 0"),  # child absent from q
        ([1, 2], [-1, -1], {-1: ([1, 2], [1.0, 0.0])}, "token 2.* q = 0"),  # child with q = 0
        ([1, 2, 4], [-1, 0, 0], {-1: Q3, 0: Q3}, "node 0.*token 4.* q = 0"),  # deeper proposal
    ],
)
def test_validate_rejects(tokens, parents, proposals, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents, proposals).validate(vocab_size=8)


def test_validate_accepts_a_well_formed_sampled_tree():
    DraftTree([1, 3, 2], [-1, -1, 0], {-1: Q3, 0: Q3, 2: Q3}).validate(vocab_size=8)


# --- SamplingParams and target_probs -----------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampling_params_reject_invalid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_draws_depend_on_seed_position_and_index_only():
    draws = Draws.for_seed(7)
    forward = [draws.uniform(pos, i) for pos in range(50) for i in range(3)]
    backward = [Draws.for_seed(7).uniform(pos, i) for pos in reversed(range(50)) for i in reversed(range(3))]
    assert forward == backward[::-1]  # the order of the draws does not matter: a replay draws the same
    assert len(set(forward)) == len(forward) and all(0 <= u < 1 for u in forward)
    assert Draws.for_seed(8).uniform(0) != draws.uniform(0)
    assert Draws.for_seed(None).seed != Draws.for_seed(None).seed  # no seed: fresh numbers


def test_draws_are_uniform():
    u = np.array([Draws(3).uniform(pos, i) for pos in range(4000) for i in range(5)])
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert chisquare(counts).pvalue > 1e-3
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.03  # neighbours are not correlated


def test_sampling_commits_what_plain_sampling_draws_whatever_the_tree_without_proposals():
    """The matching rule draws the token at each position with that position's number; so a seeded
    generation gives the same tokens with any drafts as with none (and so after a replay elsewhere)."""
    params = SamplingParams(temperature=1.0)
    draws = Draws(11)
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(V, V, generator=gen)  # the next token's logits depend on the last token

    def plain(n: int) -> list[int]:
        out = [0]
        for pos in range(1, n + 1):
            out += verify_tree(DraftTree.empty(), table[out[-1]][None], params, draws, pos).tokens
        return out[1:]

    want = plain(40)
    for trial in range(20):
        out = [0]
        while len(out) <= 40:
            tree = random_tree(gen, n=int(torch.randint(0, 8, (), generator=gen)), vocab_size=V)
            rows = [table[out[-1]]] + [table[t] for t in tree.tokens]
            out += verify_tree(tree, torch.stack(rows), params, draws, len(out)).tokens
        assert out[1:41] == want


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' generate samples from: float32 logits through its warpers, in its order."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    warpers.append(TopPLogitsWarper(top_p))
    scores = logits.float()
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 10, 1.0), (1.0, 0, 0.9), (0.8, 40, 0.95), (1.2, 1, 1.0), (1.0, 0, 0.05),
     (0.5, 600, 0.5)],
)
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "ties"])
def test_target_probs_matches_transformers_warpers(temperature, top_k, top_p, kind):
    logits = 3 * torch.randn(4, 500, generator=torch.Generator().manual_seed(3))
    if kind == "bfloat16":
        logits = logits.bfloat16()
    elif kind == "ties":  # many exact ties, also at the top-k boundary
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = target_probs(logits, params)
    expected = transformers_probs(logits, temperature, top_k, top_p)
    assert got.dtype == torch.float32
    assert torch.equal(got == 0, expected == 0)
    torch.testing.assert_close(got, expected)


def test_target_probs_refuses_greedy():
    with pytest.raises(ValueError, match="temperature > 0"):
        target_probs(torch.zeros(1, 8), GREEDY)


# --- statistical losslessness ------------------------------------------------------------------
#
# A synthetic target over V = 8 tokens: logits for the first token, and for the second token given the
# first. A node at depth 1 with token t gets the row COND[t]; deeper nodes only influence the third
# token, which is not tested. When the first token is not in the tree the round ends after it, and the
# second token comes from the next round (an empty tree over COND[x1]), so the pair (x1, x2) must follow
# p(x1) * p(x2 | x1) whatever the draft was. (Conditioning on "x1 is in the tree" instead would not give
# p restricted to the tree for sampled drafts: which tokens are in the tree depends on the same draw.)

V = 8
TRIALS = 20_000
_gen = torch.Generator().manual_seed(2024)
ROOT = 1.5 * torch.randn(V, generator=_gen)
COND = 1.5 * torch.randn(V, V, generator=_gen)
DEEP = torch.randn(V, generator=_gen)
# The drafter's proposals: q at the root (dense, far from p) and q after token t (sparse, 3 to 5 tokens).
Q_ROOT = torch.randn(V, generator=_gen).mul(2).softmax(-1).double()
Q_COND = torch.zeros(V, V, dtype=torch.float64)
for _t in range(V):
    _support = torch.randperm(V, generator=_gen)[: 3 + _t % 3]
    Q_COND[_t, _support] = torch.rand(len(_support), generator=_gen, dtype=torch.float64) + 0.1
Q_COND /= Q_COND.sum(-1, keepdim=True)


# Every row a tree can need: ROOT, then COND[t] at 1 + t, then DEEP.
ROWS = torch.cat([ROOT[None], COND, DEEP[None]])


def logits_for(tree: DraftTree) -> torch.Tensor:
    rows = [0] + [1 + t if d == 1 else 1 + V for t, d in zip(tree.tokens, tree.depths())]
    return ROWS[rows]


def retrieval_drafts(trials: int, gen: torch.Generator) -> list[DraftTree]:
    """The same two-level tree without proposals each time: 3, 1 and 6 at the root, 3 with 2 children, 6 with 3."""
    return [DraftTree(tokens=[3, 1, 6, 0, 4, 6, 5, 1], parents=[-1, -1, -1, 0, 0, 2, 2, 2])] * trials


def draw_without_replacement(q: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """k tokens per row of q [..., V], in draw order. The top k of log q + Gumbel noise are distributed
    exactly like k successive draws without replacement (Gumbel-top-k), and vectorise over many trials."""
    gumbel = -torch.log(-torch.log(torch.rand(q.shape, dtype=torch.float64, generator=gen)))
    return torch.topk(q.log() + gumbel, k, dim=-1).indices


def sampled_drafts(trials: int, gen: torch.Generator) -> list[DraftTree]:
    """Three children drawn without replacement from q at the root, then three under each of them from
    q after that token (whose support is 3 to 5 tokens, so some nodes use q up)."""
    firsts = draw_without_replacement(Q_ROOT.expand(trials, V), 3, gen)  # [trials, 3]
    seconds = draw_without_replacement(Q_COND[firsts], 3, gen)  # [trials, 3, 3]
    q_root = (list(range(V)), Q_ROOT.tolist())
    q_cond = [(list(range(V)), row) for row in Q_COND.tolist()]
    trees = []
    for first, second in zip(firsts.tolist(), seconds.tolist()):
        proposals = {-1: q_root} | {i: q_cond[t] for i, t in enumerate(first)}
        tokens = first + [t for kids in second for t in kids]
        trees.append(DraftTree(tokens, [-1] * 3 + [0] * 3 + [1] * 3 + [2] * 3, proposals))
    return trees


DRAFTS = {"retrieval": retrieval_drafts, "sampled": sampled_drafts}


def simulate(draft: str, params: SamplingParams, trials: int = TRIALS) -> np.ndarray:
    """[trials, 2]: the first two committed tokens, from rounds verified with acceptance.verify_tree."""
    pairs = np.empty((trials, 2), dtype=np.int64)
    for n, tree in enumerate(DRAFTS[draft](trials, torch.Generator().manual_seed(1))):
        draws = Draws(n)
        tokens = acceptance.verify_tree(tree, logits_for(tree), params, draws).tokens
        if len(tokens) == 1:
            tokens += acceptance.verify_tree(DraftTree.empty(), ROWS[1 + tokens[0]][None], params, draws, 1).tokens
        pairs[n] = tokens[:2]
    return pairs


simulate_cached = functools.cache(simulate)


def target_pair_probs(params: SamplingParams) -> np.ndarray:
    """[V, V]: p(x1) * p(x2 | x1) under the sampling settings."""
    first = target_probs(ROOT[None], params)[0].double()
    second = target_probs(COND, params).double()
    return (first[:, None] * second).numpy()


def chi_square_p_value(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `samples` (category indices) being drawn from `probs`; 0 if an impossible category occurs."""
    counts = np.bincount(samples, minlength=len(probs))
    if counts[probs == 0].any():
        return 0.0
    observed, expected = counts[probs > 0], probs[probs > 0]
    expected = expected / expected.sum() * len(samples)
    sparse = expected < 5  # pool sparse cells so that the chi-square approximation holds
    if sparse.any():
        observed = np.append(observed[~sparse], observed[sparse].sum())
        expected = np.append(expected[~sparse], expected[sparse].sum())
    return float(chisquare(observed, expected).pvalue)


# Plain sampling with many trials; each filtered variant with fewer (a top-k / top-p mistake commits a
# token of probability 0, which fails at once).
SETTINGS = [
    (SamplingParams(temperature=1.0), TRIALS),
    (SamplingParams(temperature=0.6, top_k=4), TRIALS // 4),
    (SamplingParams(temperature=1.4, top_p=0.7), TRIALS // 4),
    (SamplingParams(temperature=0.9, top_k=6, top_p=0.85), TRIALS // 4),
]
SETTING_IDS = [f"T{p.temperature}-k{p.top_k}-p{p.top_p}" for p, _ in SETTINGS]


@pytest.mark.parametrize("params, trials", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_first_token_follows_the_target_distribution(draft, params, trials):
    first = simulate_cached(draft, params, trials)[:, 0]
    assert chi_square_p_value(first, target_pair_probs(params).sum(1)) > 1e-3


@pytest.mark.parametrize("params, trials", SETTINGS, ids=SETTING_IDS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_first_two_tokens_follow_the_target_distribution(draft, params, trials):
    pairs = simulate_cached(draft, params, trials)
    assert chi_square_p_value(pairs[:, 0] * V + pairs[:, 1], target_pair_probs(params).ravel()) > 1e-3


def test_the_sampled_draft_is_far_from_the_target_so_the_tests_have_power():
    p = target_pair_probs(SETTINGS[0][0]).sum(1)
    assert 0.5 * np.abs(p - Q_ROOT.numpy()).sum() > 0.3  # total variation distance


@pytest.mark.parametrize(
    "function, wrong",
    [
        # Accepting the first proposed child with probability 1 commits the drafter's distribution.
        ("_rejection_sample", lambda p, proposal, child_tokens, uniforms: (0, p)),
        # After a rejection, going on with p instead of normalise(max(0, p - q)) over-weights rejected tokens.
        ("_residual", lambda p, ids, q: p),
    ],
)
def test_a_wrong_rule_fails_the_same_tests(monkeypatch, function, wrong):
    monkeypatch.setattr(acceptance, function, wrong)
    params = SETTINGS[0][0]
    pairs = simulate("sampled", params, trials=TRIALS // 4)
    assert chi_square_p_value(pairs[:, 0], target_pair_probs(params).sum(1)) < 1e-6
    assert chi_square_p_value(pairs[:, 0] * V + pairs[:, 1], target_pair_probs(params).ravel()) < 1e-6
