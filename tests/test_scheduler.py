"""VerifyScheduler: batches sessions into shared steps, trims drafts to what pays at the current load,
lets concurrent prompts share a prefix, and queues work the KV pool cannot hold yet."""

from __future__ import annotations

import threading
import time

import pytest

from specedge.cloud.engine import Engine
from specedge.cloud.kv_pool import KVBlockPool, KVPoolExhausted
from specedge.cloud.scheduler import VerifyScheduler
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.sampling import SamplingParams
from specedge.common.tiny_models import tiny_llama

GREEDY = SamplingParams(max_new_tokens=64)


def make(kv_blocks: int = 256, **kw) -> VerifyScheduler:
    hf = tiny_llama(vocab_size=64)
    block = KVBlockPool.block_bytes(4, 2, 2, 16)
    return VerifyScheduler(Engine.from_hf_model(hf, kv_pool_bytes=kv_blocks * block, block_size=4), **kw)


def scored_chain(tokens: list[int], p: float) -> DraftTree:
    return DraftTree(tokens, list(range(-1, len(tokens) - 1)), scores=[p ** (i + 1) for i in range(len(tokens))])


def open_many(s: VerifyScheduler, prompts: list[list[int]]):
    futures = [s.open(p, GREEDY, DraftTree.empty()) for p in prompts]
    return [f.result(timeout=30)[0] for f in futures]


def test_concurrent_verifications_share_one_step_and_keep_trees_that_pay():
    s = make(gather_ms=50)
    steps = []
    s.on_step = steps.append
    seqs = open_many(s, [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    s.costs.measured = {}  # a cost model where extra tokens are nearly free: drafts pay
    s.costs.base_ms = 10.0
    futures = [s.verify(q, scored_chain([10, 11, 12, 13], 0.9)) for q in seqs]
    outcomes = [f.result(timeout=30) for f in futures]
    assert steps[-1].sessions == 3  # one step for all three
    assert all(o.tree_sent > 0 for o in outcomes)
    s.stop()


def test_a_step_waits_briefly_for_sessions_still_drafting_their_next_tree():
    """The engine is slowed to 50 ms a step (a real engine; the sleep stands in for a larger model), and
    one of two clients takes 3 ms to draft after each verdict, longer than the 1 ms gather window: it
    must still share every step with the quick one instead of missing every other step."""
    s = make(gather_ms=1)
    step = s.engine.step
    s.engine.step = lambda work: (time.sleep(0.05), step(work))[1]
    steps = []
    s.on_step = steps.append
    seqs = open_many(s, [[1, 2, 3], [4, 5, 6]])
    steps.clear()

    def client(seq, think_s: float) -> None:
        for _ in range(8):
            time.sleep(think_s)
            s.verify(seq, DraftTree.empty()).result(timeout=30)

    threads = [threading.Thread(target=client, args=a) for a in ((seqs[0], 0.0), (seqs[1], 0.003))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [st.sessions for st in steps] == [2] * 8
    s.stop()


def test_under_load_unlikely_drafts_are_trimmed_away():
    s = make(gather_ms=50)
    seqs = open_many(s, [[i, i + 1, i + 2] for i in range(1, 13, 3)])
    steep = CostModel(((0, 10.0), (4, 20.0), (16, 60.0), (64, 200.0)))  # every token costs
    s.costs.model = lambda: steep
    futures = [s.verify(q, scored_chain([20, 21, 22], 0.05)) for q in seqs]
    assert [f.result(timeout=30).tree_sent for f in futures] == [0, 0, 0, 0]
    futures = [s.verify(q, scored_chain([20, 21, 22], 0.99)) for q in seqs]
    assert all(f.result(timeout=30).tree_sent == 3 for f in futures)
    s.stop()


def test_a_lone_session_keeps_its_whole_tree_and_unscored_trees_share_the_budget():
    s = make(max_batch_tokens=9, gather_ms=50)
    (a,) = open_many(s, [[1, 2, 3]])
    assert s.verify(a, scored_chain([4, 5, 6, 7], 0.01)).result(timeout=30).tree_sent == 4
    b, c = open_many(s, [[9, 8, 7], [6, 5, 4]])
    futures = [s.verify(q, DraftTree.chain(list(range(20, 30)))) for q in (b, c)]
    assert [f.result(timeout=30).tree_sent for f in futures] == [3, 3]  # (9 - 2 roots) // 2 each
    s.stop()


def test_concurrent_prompts_with_a_common_prefix_store_it_once():
    s = make(gather_ms=50)
    document = list(range(1, 41))  # ten blocks of four
    futures = [s.open(document + [50 + i], GREEDY, DraftTree.empty()) for i in range(4)]
    outcomes = [f.result(timeout=30)[1] for f in futures]
    cached = sorted(o.cached_prompt_tokens for o in outcomes)
    assert cached[0] == 0 and cached[1:] == [40, 40, 40]  # the first prefills, the others reuse it
    assert s.engine.pool.stats().used <= 10 + 4 * 1 + 4  # the document's blocks once, plus each one's own
    s.stop()


def test_a_waiting_prompt_is_not_refused_while_sessions_keep_giving_blocks_back():
    s = make(kv_blocks=12, gather_ms=1, admission_timeout_s=0.5)
    small, large = open_many(s, [list(range(1, 9)), list(range(9, 33))])  # 3 + 7 of 12 blocks
    waiting = s.open(list(range(33, 61)), GREEDY, DraftTree.empty())  # needs 7
    time.sleep(0.4)
    s.close(small)  # progress, but not yet room for it
    time.sleep(0.4)
    assert not waiting.done()  # waited longer than the timeout, but blocks came back 0.4 s ago
    s.close(large)
    seq, _ = waiting.result(timeout=30)
    assert len(seq.token_ids) == 29
    s.stop()


def test_sessions_that_outgrow_the_pool_together_do_not_deadlock_the_youngest_is_refused():
    s = make(kv_blocks=12, gather_ms=1)
    older, younger = open_many(s, [list(range(1, 17)), list(range(17, 33))])  # 5 + 5 of 12 blocks
    outcome = {}

    def decode(name, seq) -> None:  # like a client: the next step as soon as the last one is back
        try:
            for _ in range(20):
                s.verify(seq, DraftTree.empty()).result(timeout=30)
            outcome[name] = len(seq.token_ids)
        except KVPoolExhausted as e:
            outcome[name] = str(e)
        s.close(seq)

    threads = [threading.Thread(target=decode, args=a) for a in (("older", older), ("younger", younger))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert "youngest" in outcome["younger"]  # refused with a reason, instead of both waiting forever
    assert outcome["older"] == 17 + 20  # the older one finished once the younger's blocks came back
    s.stop()


def test_work_waits_for_kv_blocks_and_a_prompt_that_can_never_fit_is_refused():
    s = make(kv_blocks=12, gather_ms=1, admission_timeout_s=10)
    (first,) = open_many(s, [list(range(1, 33))])  # 8 of 12 blocks
    second = s.open(list(range(33, 57)), GREEDY, DraftTree.empty())  # needs 6: must wait
    time.sleep(0.3)
    assert not second.done()
    s.close(first)
    seq, _ = second.result(timeout=30)
    assert seq.num_cached > 0
    with pytest.raises(KVPoolExhausted, match="KV pool full"):
        s.open(list(range(1, 60)) * 2, GREEDY, DraftTree.empty()).result(timeout=30)
    s.stop()
