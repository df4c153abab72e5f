"""VerifyScheduler, the thread that carries out plans (its policy is tested as a pure function in
test_step_plan.py): sessions share engine steps, a step waits briefly for sessions still drafting,
concurrent prompts share a prefix, and work the KV pool cannot hold waits, or is refused, end to end."""

from __future__ import annotations

import threading
import time

import pytest

from specedge.cloud.engine import Engine
from specedge.cloud.kv_pool import KVBlockPool, KVPoolExhausted
from specedge.cloud.scheduler import SchedulerFailed, VerifyScheduler
from specedge.cloud.step_plan import StepLimits
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from tiny_models import tiny_llama

GREEDY = SamplingParams(max_new_tokens=64)


def make(kv_blocks: int = 256, **kw) -> VerifyScheduler:
    hf = tiny_llama(vocab_size=64)
    block = KVBlockPool.block_bytes(4, 2, 2, 16)
    return VerifyScheduler(Engine.from_hf_model(hf, kv_pool_bytes=kv_blocks * block, block_size=4), **kw)


def scored_chain(tokens: list[int], p: float) -> DraftTree:
    return DraftTree(tokens, list(range(-1, len(tokens) - 1)), accept_probs=[p ** (i + 1) for i in range(len(tokens))])


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
    """The engine is slowed to 200 ms a step (a real engine; the sleep stands in for a larger model), and
    one of two clients takes 3 ms to draft after each verdict, longer than the 1 ms gather window: it
    must still share every step with the quick one instead of missing every other step. (The scheduler
    waits up to 10% of a step for it: 20 ms here, so a loaded machine's late thread wake-ups, several ms,
    cannot decide the outcome, as they could with 50 ms steps and a 5 ms wait.)"""
    s = make(gather_ms=1)
    step = s.engine.step
    s.engine.step = lambda work, chunks: (time.sleep(0.2), step(work, chunks))[1]
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


def test_only_an_idle_verifier_waits_for_newcomers_to_share_its_step():
    """Opens on an idle verifier wait `gather_ms`, so that concurrent newcomers share a step. Once the
    sessions of the last step have all sent their next work, the step starts at once: a lone client would
    otherwise pay the gathering wait every round (2 ms by default, most of a small model's pass on a GPU)."""
    s = make(gather_ms=400)
    seq, opened = s.open([1, 2, 3], GREEDY, DraftTree.empty()).result(timeout=30)
    assert opened.queue_ms >= 400
    for _ in range(3):
        assert s.verify(seq, DraftTree.empty()).result(timeout=30).queue_ms < 200
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


def test_a_prompt_waiting_for_kv_blocks_runs_once_a_session_closes_and_one_that_never_fits_is_refused():
    s = make(kv_blocks=12, gather_ms=1)
    (first,) = open_many(s, [list(range(1, 33))])  # 8 of 12 blocks
    second = s.open(list(range(33, 57)), GREEDY, DraftTree.empty())  # needs 6: waits (test_step_plan.py)
    s.close(first)
    seq, _ = second.result(timeout=30)
    assert seq.num_cached == 24
    with pytest.raises(KVPoolExhausted, match="KV pool full"):
        s.open(list(range(1, 60)) * 2, GREEDY, DraftTree.empty()).result(timeout=30)
    s.stop()


def decode_alone(prompt: list[int], tokens: int) -> list[int]:
    """Greedy output of `prompt` from a scheduler that prefills it in one step."""
    s = make()
    seq, outcome = s.open(prompt, GREEDY, DraftTree.empty()).result(timeout=30)
    while len(seq.output_ids) < tokens:
        s.verify(seq, DraftTree.empty()).result(timeout=30)
    s.stop()
    return seq.output_ids[:tokens]


def test_a_long_prompt_is_prefilled_in_chunks_while_another_session_keeps_decoding_in_every_step():
    """max_batch_tokens 24: a 100-token prompt takes five steps; the decoding session is served in each of
    them instead of waiting for the whole prefill; both outputs are what they are alone. (Each step waits
    for the decoding session's next verification up to max(gather_ms, 10% of a step): 50 ms here, so that
    its thread's wake-up on a loaded machine, which can take more than a millisecond, cannot decide the
    outcome.)"""
    prompt, other_prompt = [(7 * i) % 61 + 1 for i in range(100)], [5, 6, 7]
    want, other_want = decode_alone(prompt, 8), decode_alone(other_prompt, 12)
    s = make(limits=StepLimits(max_batch_tokens=24), gather_ms=50)
    steps, reports = [], []
    s.on_step = steps.append
    (other,) = open_many(s, [other_prompt])
    steps.clear()
    stop = threading.Event()

    def decode() -> None:
        while not stop.is_set() and len(other.output_ids) < 12:
            s.verify(other, DraftTree.empty()).result(timeout=30)

    decoder = threading.Thread(target=decode)
    decoder.start()
    seq, _ = s.open(prompt, GREEDY, DraftTree.empty(), on_progress=lambda *r: reports.append(r)).result(timeout=30)
    stop.set()
    decoder.join(timeout=30)
    assert [total for _, total in reports] == [100] * len(reports) and len(reports) >= 4
    assert [done for done, _ in reports] == sorted(done for done, _ in reports) and reports[-1][0] < 100
    prefill_steps = [st for st in steps if st.prefills]
    assert len(prefill_steps) == len(reports) + 1
    assert all(st.sessions == 1 for st in prefill_steps[:-1])  # the decoding session's verification in each
    assert all(st.tokens <= 24 + 24 // 4 for st in steps)
    while len(seq.output_ids) < 8:
        s.verify(seq, DraftTree.empty()).result(timeout=30)
    assert seq.output_ids[:8] == want
    while len(other.output_ids) < 12:
        s.verify(other, DraftTree.empty()).result(timeout=30)
    assert other.output_ids[:12] == other_want
    s.stop()


def test_a_prefill_given_up_between_chunks_gives_its_blocks_back():
    s = make(limits=StepLimits(max_batch_tokens=8), gather_ms=1)
    asked, cancelled = threading.Event(), []

    def give_up_after_the_first_chunk(*progress) -> None:  # as the server does when its client goes away
        asked.wait(10)
        cancelled.append(opening.cancel())

    opening = s.open(list(range(1, 61)), GREEDY, DraftTree.empty(), on_progress=give_up_after_the_first_chunk)
    asked.set()
    deadline = time.monotonic() + 10
    while not (cancelled and s.active_sessions == 0) and time.monotonic() < deadline:  # released at the next step
        time.sleep(0.01)
    assert cancelled == [True] and s.active_sessions == 0 and s.engine.pool.stats().used == 0
    s.stop()


def test_an_error_inside_a_step_fails_every_request_now_and_later_instead_of_leaving_them_waiting():
    """The engine's error is injected (no real one is known). The request in the failing step, one waiting
    behind it, and one asked afterwards all fail with SchedulerFailed; `on_failure` hears the error once."""
    failures = []
    s = make(on_failure=failures.append)
    seq = open_many(s, [[1, 2, 3]])[0]
    entered, release = threading.Event(), threading.Event()

    def failing_step(work, chunks):
        entered.set()
        release.wait(10)
        raise SystemError("injected engine fault")

    s.engine.step = failing_step
    in_step = s.verify(seq, DraftTree.empty())
    assert entered.wait(10)
    behind = s.open([4, 5, 6], GREEDY, DraftTree.empty())  # arrives while the failing step runs
    release.set()
    for future in (in_step, behind):
        with pytest.raises(SchedulerFailed, match="injected engine fault"):
            future.result(timeout=10)
    with pytest.raises(SchedulerFailed):
        s.open([7, 8, 9], GREEDY, DraftTree.empty()).result(timeout=1)
    assert len(failures) == 1 and isinstance(failures[0], SystemError) and s.failure is failures[0]
    s._thread.join(timeout=10)
    assert not s._thread.is_alive()


def test_a_request_still_in_the_inbox_at_a_stop_is_refused_not_left_waiting():
    s = make(own_thread=False)  # steps run only inside run(): the request stays in the inbox until then
    asked = s.open([1, 2, 3], GREEDY, DraftTree.empty())
    s.stop()
    s.run()
    with pytest.raises(RuntimeError, match="shutting down"):
        asked.result(timeout=1)
    with pytest.raises(RuntimeError, match="shutting down"):
        s.open([4, 5, 6], GREEDY, DraftTree.empty()).result(timeout=1)
