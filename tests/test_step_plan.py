"""plan_step, the scheduler's policy as a pure function: which waiting requests run in the next engine step
with how much of their trees, which wait for KV blocks, and which are refused. No engine, no threads, no
sleeps: a real KV pool in a given state and an explicit clock."""

from __future__ import annotations

from specedge.cloud.engine import Sequence
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.requests import OpenRequest, VerifyRequest
from specedge.cloud.step_plan import PoolProgress, StepLimits, plan_step
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=64)
BLOCK = 4
FLAT = CostModel(((0, 10.0), (128, 10.5)))  # extra tokens nearly free: every likely node pays
STEEP = CostModel(((0, 10.0), (4, 20.0), (16, 60.0), (64, 200.0)))  # every token costs


def pool_of(blocks: int) -> KVBlockPool:
    return KVBlockPool(blocks * KVBlockPool.block_bytes(BLOCK, 1, 1, 2), BLOCK, 1, 1, 2)


def open_seq(pool: KVBlockPool, seq_id: int, tokens: list[int]) -> Sequence:
    """A sequence as after a step: KV for every committed token but the last (the next step's root)."""
    pool.open(seq_id, tokens)
    pool.reserve(seq_id, len(tokens) - 1)
    pool.commit(seq_id, tokens[:-1])
    return Sequence(seq_id, list(tokens), len(tokens) - 1, GREEDY, None, len(tokens) - 1)


def chain(tokens: list[int], p: float | None = None) -> DraftTree:
    probs = None if p is None else [p ** (i + 1) for i in range(len(tokens))]
    return DraftTree(tokens, list(range(-1, len(tokens) - 1)), accept_probs=probs)


def plan(waiting, pool, cost=FLAT, now=100.0, progress=PoolProgress(), **limits):
    return plan_step(waiting, pool, cost, StepLimits(**limits), now, progress)


def sent(p) -> dict:
    """Request -> draft nodes it verifies in this step."""
    return {id(r): len(tree) for r, tree in p.batch}


def test_concurrent_verifications_share_one_step_and_keep_trees_that_pay():
    pool = pool_of(64)
    requests = [VerifyRequest(open_seq(pool, i, [i + 1] * 3), chain([10, 11, 12, 13], 0.9)) for i in range(3)]
    p = plan(requests, pool)
    assert [r for r, _ in p.batch] == requests and sent(p) == {id(r): 4 for r in requests}
    assert not p.refused


def test_under_load_unlikely_drafts_are_trimmed_away_and_likely_ones_kept():
    pool = pool_of(64)
    seqs = [open_seq(pool, i, [i + 1] * 3) for i in range(4)]
    unlikely = [VerifyRequest(s, chain([20, 21, 22], 0.05)) for s in seqs]
    assert list(sent(plan(unlikely, pool, STEEP)).values()) == [0, 0, 0, 0]  # each session still gets its token
    likely = [VerifyRequest(s, chain([20, 21, 22], 0.99)) for s in seqs]
    assert list(sent(plan(likely, pool, STEEP)).values()) == [3, 3, 3, 3]


def test_the_best_nodes_of_all_sessions_win_not_an_equal_share():
    pool = pool_of(64)
    strong = VerifyRequest(open_seq(pool, 0, [1, 2, 3]), chain(list(range(20, 28)), 0.97))
    weak = VerifyRequest(open_seq(pool, 1, [4, 5, 6]), chain(list(range(30, 38)), 0.3))
    got = sent(plan([strong, weak], pool, STEEP))
    assert got[id(strong)] > got[id(weak)]


def test_a_lone_session_keeps_its_whole_tree_and_trees_without_estimates_share_the_budget():
    pool = pool_of(64)
    lone = VerifyRequest(open_seq(pool, 0, [1, 2, 3]), chain([4, 5, 6, 7], 0.01))
    assert sent(plan([lone], pool, STEEP, max_batch_tokens=9)) == {id(lone): 4}  # its client sized it
    pair = [VerifyRequest(open_seq(pool, i, [9, 8, 7 - i]), chain(list(range(20, 30)))) for i in (1, 2)]
    assert list(sent(plan(pair, pool, max_batch_tokens=9)).values()) == [3, 3]  # (9 - 2 roots) // 2 each


def test_a_tree_is_shrunk_to_what_the_pool_can_hold():
    pool = pool_of(4)
    request = VerifyRequest(open_seq(pool, 0, [1, 2, 3, 4, 5, 6, 7]), chain(list(range(10, 26))))  # 2 blocks
    assert sent(plan([request], pool)) == {id(request): 8}  # 16 nodes need 4 more blocks; 2 are left: halve twice


def test_concurrent_prompts_with_a_common_first_block_are_prefilled_one_per_step():
    pool = pool_of(64)
    document = list(range(1, 41))
    opens = [OpenRequest(document + [50 + i], GREEDY, DraftTree.empty()) for i in range(3)]
    other = OpenRequest([60, 61, 62, 63, 64], GREEDY, DraftTree.empty())
    p = plan(opens + [other], pool)
    assert [r for r, _ in p.batch] == [opens[0], other]  # the others reuse its prefix next step


def test_admission_counts_the_cached_prefix_blocks_it_takes_back_from_the_available_ones():
    pool = pool_of(6)
    document = list(range(1, 17))  # four blocks
    open_seq(pool, 0, document + [0])
    pool.close(0)  # its four blocks stay cached, unreferenced: available to anyone
    again = OpenRequest(document + [99], GREEDY, DraftTree.empty())  # 4 cached + 1 new block
    assert pool.blocks_to_open(again.prompt_ids, 17) == 5
    open_seq(pool, 1, [7, 7, 7, 7, 7])  # one block: 5 available
    assert [r for r, _ in plan([again], pool).batch] == [again]
    open_seq(pool, 2, [8, 8, 8, 8, 8])  # another: 4 available, though only one block is new
    p = plan([again], pool)
    assert not p.batch and not p.refused  # it waits: it could fit once the others are gone


def test_a_prompt_that_could_never_fit_is_refused_at_once_without_retry():
    pool = pool_of(12)
    request = OpenRequest(list(range(1, 60)) * 2, GREEDY, DraftTree.empty(), submitted=100.0)
    p = plan([request], pool, now=100.0)
    ((refused, error),) = p.refused
    assert refused is request and "KV pool full" in str(error) and error.retry_after_s is None


def test_a_prompt_waits_for_blocks_while_sessions_give_some_back_and_is_refused_once_they_stop():
    pool = pool_of(12)
    open_seq(pool, 0, list(range(1, 33)))  # 8 of 12 blocks
    waiting = OpenRequest(list(range(33, 57)), GREEDY, DraftTree.empty(), submitted=100.0)  # needs 6
    timeout = dict(admission_timeout_s=10.0)
    assert not plan([waiting], pool, now=105.0, **timeout).refused  # within the timeout: waits
    progress = PoolProgress(last_release=108.0)  # a session gave blocks back, though not enough
    assert not plan([waiting], pool, now=115.0, progress=progress, **timeout).refused  # 7 s since then
    ((_, error),) = plan([waiting], pool, now=118.5, progress=progress, **timeout).refused
    assert "after waiting" in str(error) and error.retry_after_s > 0  # "not now": the client comes back


def test_sessions_that_outgrow_the_pool_together_the_youngest_is_refused_at_most_once_a_second():
    pool = pool_of(4)
    older, younger = open_seq(pool, 0, list(range(1, 10))), open_seq(pool, 1, list(range(10, 19)))  # 2 + 2 blocks
    stuck = [VerifyRequest(older, DraftTree.empty()), VerifyRequest(younger, DraftTree.empty())]
    p = plan(stuck, pool, now=100.0)
    ((refused, error),) = p.refused
    assert p.preempted and refused.seq is younger and "youngest" in str(error) and error.retry_after_s > 0
    assert not plan(stuck, pool, now=100.5, progress=PoolProgress(last_preempt=100.0)).refused


# ---- prefills in chunks -------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_its_last_token_left_for_its_tree():
    pool = pool_of(64)
    long = OpenRequest(list(range(1, 101)), GREEDY, chain([7, 8]))
    p = plan([long], pool, max_batch_tokens=32)
    assert not p.batch and [(r, n) for r, n in p.chunks] == [(long, 32)]
    long.seq = open_seq(pool, 0, long.prompt_ids)  # as the scheduler opens it; now one token is left
    long.seq.num_cached = 97  # 3 uncomputed + 2 tree nodes fit
    assert [r for r, _ in plan([long], pool, max_batch_tokens=32).batch] == [long]
    long.seq.num_cached = 60  # 40 uncomputed: another chunk, never the last token
    assert [n for _, n in plan([long], pool, max_batch_tokens=32).chunks] == [32]
    long.seq.num_cached = 69
    assert [n for _, n in plan([long], pool, max_batch_tokens=32).chunks] == [30]  # 31 + 2 > 32: all but the last


def test_under_load_the_first_prefill_still_gets_a_quarter_of_the_budget():
    pool = pool_of(64)
    verifies = [VerifyRequest(open_seq(pool, i, [i + 1] * 3), chain(list(range(10, 26)))) for i in range(4)]
    first, second = (OpenRequest(list(range(1 + 40 * k, 41 + 40 * k)), GREEDY, DraftTree.empty()) for k in range(2))
    p = plan([*verifies, first, second], pool, max_batch_tokens=64)
    assert sum(1 + n for n in sent(p).values()) == 64  # the verifications take the whole budget
    assert [(r, n) for r, n in p.chunks] == [(first, 16)] and second not in [r for r, _ in p.batch]


def test_a_prefill_under_way_goes_before_new_ones_and_holds_its_prefix_for_them():
    pool = pool_of(64)
    document = list(range(1, 41))
    started = OpenRequest(document + [99], GREEDY, DraftTree.empty())
    started.seq = open_seq(pool, 0, started.prompt_ids)
    started.seq.num_cached = 8
    same_prefix = OpenRequest(document + [98], GREEDY, DraftTree.empty())
    other = OpenRequest([60, 61, 62], GREEDY, DraftTree.empty())
    p = plan([same_prefix, other, started], pool, max_batch_tokens=16)
    assert [(r, n) for r, n in p.chunks] == [(started, 16)]
    assert same_prefix not in [r for r, _ in p.batch] + [r for r, _ in p.chunks]  # it waits for the prefix
    assert [r for r, _ in p.batch] == [] and other not in [r for r, _ in p.chunks]  # the budget is spent
