"""Drafting with a small model on the edge (llama.cpp): the runtime's rollback is exact, sampled drafts keep
the target's distribution (same vocabulary: rejection sampling against the drafter's q; across
vocabularies: TLI), and the drafter adapts its trees. Greedy equality with transformers for every mode is
in test_greedy_equality.py (kinds model_same and model_cross)."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specedge.cloud.engine import Engine
from specedge.cloud.model_registry import eos_token_ids
from specedge.cloud.sampling import target_probs
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.calibration import Calibration, reached_and_accepted
from specedge.edge.draft_model import BATCH as BATCH_TOKENS
from specedge.edge.draft_model import DraftModel
from specedge.edge.draft_models import draft_model_path
from specedge.edge.model_drafter import CATCH_UP_BATCH
from specedge.edge.registry import make_drafter
from specedge.edge.tokenizer import EdgeTokenizer

pytestmark = pytest.mark.real_model

PROMPT = "My favourite animal is the"
TRIALS = 800
BATCH = 200


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_rollback_gives_the_logits_of_a_fresh_model(name):
    """Keep a prefix, drop the rest, feed other tokens: the logits are bit for bit those of a fresh model
    fed the same tokens in the same pieces (llama.cpp rounds differently for other batch splits), also past
    Gemma 3's 512-token sliding window (its window layers keep every position for this)."""
    model = DraftModel(draft_model_path(name), context=2048)
    rng = np.random.default_rng(0)
    text = rng.integers(100, 5000, size=900).tolist()
    keep = 5 * BATCH_TOKENS  # past the window; a batch boundary, so a fresh model can be fed the same pieces
    model.logits(text[:800])
    rolled_back = model.logits(text[:keep] + text[850:900])  # drop the positions after keep, feed 50 others
    assert model.tokens == text[:keep] + text[850:900]
    fresh = DraftModel(draft_model_path(name), context=2048)
    fresh.logits(text[:keep])
    assert np.array_equal(rolled_back, fresh.logits(text[:keep] + text[850:900]))
    kept = DraftModel(draft_model_path(name), context=2048)  # the dropped positions still in the cache
    kept.logits(text[:800])
    assert np.abs(kept.logits(text[:800] + text[850:900]) - rolled_back).max() > 1.0
    again = model.logits(text[:keep] + text[850:900])  # nothing new to feed: the same logits, no forward
    assert np.array_equal(again, rolled_back)


def test_a_stopped_prefill_leaves_a_prefix_that_logits_goes_on_from():
    model = DraftModel(draft_model_path("smollm2-135m"), context=2048)
    tokens = np.random.default_rng(1).integers(100, 5000, size=3 * BATCH_TOKENS).tolist()
    assert not model.prefill(tokens, stop=lambda: True)  # one batch goes in before the first check
    assert model.tokens == tokens[:BATCH_TOKENS]
    fresh = DraftModel(draft_model_path("smollm2-135m"), context=2048)
    assert np.array_equal(model.logits(tokens), fresh.logits(tokens))


def test_the_first_rounds_go_without_model_drafts_while_the_drafter_reads_the_prompt(real_model):
    hf, tokenizer = real_model("gemma3-270m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    gate, read = threading.Event(), drafter.model.prefill

    def gated_prefill(tokens, *args):  # the prompt is read only once the test opens the gate
        gate.wait()
        return read(tokens, *args)

    drafter.model.prefill = gated_prefill
    drafter.begin(edge_tokenizer.encode(PROMPT), SamplingParams())
    assert not drafter.ready(timeout=0)
    assert len(drafter.propose()) == 0
    gate.set()
    assert drafter.ready(timeout=60)
    assert len(drafter.propose()) > 0


def test_a_new_generation_begins_without_waiting_for_the_last_prompts_reader(real_model):
    """llama.cpp cannot stop inside a batch: a reader still on the last prompt is told to stop and left to
    end its batch. The next generation begins at once (waiting cost ~150 ms a generation on long prompts),
    its rounds go without model drafts until that batch is done, then the model reads the new prompt."""
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    gate, read = threading.Event(), drafter.model.prefill

    def gated_prefill(tokens, *args):  # the last prompt's batch ends only once the test opens the gate
        gate.wait()
        return read(tokens, *args)

    drafter.model.prefill = gated_prefill
    last, new = edge_tokenizer.encode(PROMPT * 60), edge_tokenizer.encode("Say something else.")
    assert len(last) > BATCH_TOKENS
    drafter.begin(last, SamplingParams())
    begun = threading.Thread(target=drafter.begin, args=(new, SamplingParams()))
    begun.start()
    begun.join(timeout=30)
    assert not begun.is_alive()
    assert drafter.reading and len(drafter.propose()) == 0
    gate.set()
    assert drafter.ready(timeout=60) and drafter._unread() == 0
    assert len(drafter.propose()) > 0


def test_the_end_of_a_generation_stops_reading_its_prompt(real_model):
    """What is left of a prompt is of no use to the next one; read on, it would only take the CPU."""
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    gate, read = threading.Event(), drafter.model.prefill

    def gated_prefill(tokens, *args):
        gate.wait()
        return read(tokens, *args)

    drafter.model.prefill = gated_prefill
    prompt = edge_tokenizer.encode(PROMPT * 60)
    drafter.begin(prompt, SamplingParams())
    drafter.end()
    gate.set()
    assert drafter.ready(timeout=60)
    assert drafter.model.tokens == prompt[:BATCH_TOKENS]  # the batch under way, no more


def _drafter_past_prompt(real_model, target: str) -> tuple:
    """A smollm2-135m drafter for `target`'s vocabulary that has read PROMPT; and the target's edge tokenizer."""
    hf, tokenizer = real_model(target)
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    drafter.begin(edge_tokenizer.encode(PROMPT), SamplingParams())
    assert drafter.ready(timeout=60)
    return drafter, edge_tokenizer


def test_catching_up_on_many_committed_tokens_stops_when_the_verdict_comes(real_model):
    """Rounds the model sat out (a long prompt read, or verdicts longer than a pass could read) leave many
    committed tokens unread: speculation reads them in forwards of CATCH_UP_BATCH and stops between two once
    the verdict is in, instead of delaying the next round by one long forward."""
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    prompt = edge_tokenizer.encode(PROMPT)
    drafter.begin(prompt, SamplingParams())
    assert drafter.ready(timeout=60)
    committed = edge_tokenizer.encode(" a cat, because cats are quiet and clean and they sleep all day long" * 3)
    drafter.observe(DraftTree.empty(), StepResult(tokens=committed, accepted=[], compute_ms=50.0))
    assert len(committed) > 3 * CATCH_UP_BATCH
    # Speculation also stops at the round's expected end; a round far longer than any host's forwards
    # leaves the verdict as the only stop, whatever the host's speed.
    drafter.round_ms = 600_000.0
    drafter.speculate(stop=lambda: True)
    drafter.settle()  # the forward the verdict came in during ends alone
    assert drafter.model.tokens == prompt + committed[:CATCH_UP_BATCH]  # one forward, then the verdict
    read = len(prompt) + 3 * CATCH_UP_BATCH  # the verdict comes in once the third batch has been read
    drafter.speculate(stop=lambda: len(drafter.model.tokens) >= read)
    drafter.settle()
    assert drafter.model.tokens == prompt + committed[:3 * CATCH_UP_BATCH]
    assert len(drafter.propose()) > 0  # the next draft reads the rest first
    assert drafter.model.tokens[: len(prompt) + len(committed)] == prompt + committed


def test_reading_ahead_the_likely_verdict_leaves_only_what_it_did_not_foresee(real_model):
    """During the pass the model reads the tokens another drafter expects the verdict to commit (`then`): a
    verdict that takes them, or part of them, leaves only the rest to read before the next draft (the
    model's cache keeps the longest common prefix)."""
    drafter, edge_tokenizer = _drafter_past_prompt(real_model, "smollm2-135m")
    drafter.round_ms = 600_000.0  # the verdict is the only stop, whatever the host's speed
    likely = edge_tokenizer.encode(" a cat, because cats are quiet")
    for taken, bonus in ((likely, 13), (likely[:3], 7)):
        drafter.speculate(stop=lambda: False, steps=1, then=likely)
        assert drafter.model.tokens[-len(likely):] == likely
        drafter.observe(DraftTree.empty(), StepResult(tokens=[*taken, bonus], accepted=[], compute_ms=50.0))
        assert drafter._unread() == 1  # the bonus token
        drafter.propose()
        assert drafter._unread() == 0


@pytest.mark.parametrize("target", ["smollm2-135m", "gemma3-270m"], ids=["same-vocab", "SLEM"])
def test_a_known_only_draft_runs_no_forward_and_holds_what_speculation_computed(real_model, target, monkeypatch):
    """A tree sent ahead must not wait on the model (the hybrid's, edge/hybrid.py): with `known_only` it is
    drafted beyond the path it hangs below from the logits speculation computed there, and no forward runs.
    Before speculation there is nothing; after it, the draft's likeliest chain is the start of the full one."""
    drafter, edge_tokenizer = _drafter_past_prompt(real_model, target)
    drafter.round_ms = 600_000.0  # the step count is the only stop, whatever the host's speed
    path = edge_tokenizer.encode(" a cat, because cats are")
    forwards = []
    for name in ("logits", "prefill"):
        run = getattr(drafter.model, name)
        monkeypatch.setattr(drafter.model, name, lambda *a, run=run, **k: forwards.append(1) or run(*a, **k))
    assert len(drafter.propose_after(path, known_only=True)) == 0 and not forwards
    drafter.speculate(stop=lambda: False, steps=2, then=path)  # after the path, then after its likeliest next
    assert forwards
    forwards.clear()
    known = drafter.propose_after(path, known_only=True)
    assert len(known) > 0 and not forwards
    full = drafter.propose_after(path)
    assert len(full) > len(known) and forwards
    chain = [known.tokens[i] for i in known.likeliest_path()]
    # (its last token aside: SLEM may split the end of a shorter text otherwise)
    assert [full.tokens[i] for i in full.likeliest_path()][: len(chain) - 1] == chain[:-1]


def test_a_verdict_that_comes_during_a_speculated_forward_does_not_wait_for_it(real_model):
    """The verdict ends speculation at once: the forward under way ends alone, the next draft from known logits
    runs no forward and does not wait for it, and the next use of the model keeps what it computed."""
    drafter, edge_tokenizer = _drafter_past_prompt(real_model, "smollm2-135m")
    drafter.round_ms = 600_000.0  # the verdict is the only stop, whatever the host's speed
    drafter.speculate(stop=lambda: False, steps=1)  # the logits after the committed text
    gate, started, logits = threading.Event(), threading.Event(), drafter.model.logits

    def gated_logits(tokens):
        started.set()
        gate.wait()
        return logits(tokens)

    drafter.model.logits = gated_logits
    # The verdict comes in as the forward after the likeliest next token starts.
    speculating = threading.Thread(target=drafter.speculate, kwargs={"stop": started.is_set, "steps": 2}, daemon=True)
    speculating.start()
    speculating.join(timeout=30)
    assert not speculating.is_alive()  # back while the forward waits on the gate
    before = drafter.propose(known_only=True)
    assert len(before) > 0
    gate.set()
    drafter.settle()
    after = drafter.propose(known_only=True)  # one level deeper: the tail's logits were kept
    assert after.tokens[: len(before)] == before.tokens and len(after) > len(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have priorities of their own on Linux")
def test_the_models_forwards_beside_the_rounds_run_at_the_lowest_priority(real_model):
    """On a one-core edge the prompt's reader and a speculated forward left running at the verdict must not take
    the core from the next tree's drafting and sending, which the verifier waits for."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if own >= 19:
        pytest.skip("this test runs at the lowest priority already: nothing to tell the model's threads apart by")
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    priorities: dict[str, set[int]] = {"prefill": set(), "logits": set()}

    def recorded(name, call):
        def run(*args):
            priorities[name].add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return call(*args)
        return run

    drafter.model.prefill = recorded("prefill", drafter.model.prefill)
    drafter.model.logits = recorded("logits", drafter.model.logits)
    drafter.begin(edge_tokenizer.encode(PROMPT), SamplingParams())
    assert drafter.ready(timeout=60)
    drafter.round_ms = 600_000.0
    drafter.speculate(stop=lambda: False, steps=2)
    assert priorities == {"prefill": {19}, "logits": {19}}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own  # the generation's own thread


def _pair_probs(hf, prompt: list[int], params: SamplingParams, firsts: int) -> tuple[np.ndarray, np.ndarray, list]:
    """The target's exact p(x1) and, for its `firsts` most likely x1, p(x1, x2)."""
    with torch.inference_mode():
        first = target_probs(hf(torch.tensor([prompt])).logits[0, -1].float(), params).double().numpy()
        top = np.argsort(-first)[:firsts].tolist()
        second = hf(torch.tensor([prompt + [t] for t in top])).logits[:, -1].float()
        pairs = first[top][:, None] * target_probs(second, params).double().numpy()
    return first, pairs, top


def _p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square of observed counts against probabilities; cells expected below 5 pooled with the rest."""
    expected = probs / probs.sum() * counts.sum()
    if counts[expected == 0].any():
        return 0.0
    dense = expected >= 5
    observed, expected = counts[dense], expected[dense]
    if (rest := probs[~dense].sum() / probs.sum() * counts.sum()) > 0:
        observed, expected = np.append(observed, counts[~dense].sum()), np.append(expected, rest)
    return float(chisquare(observed, expected).pvalue)


@pytest.mark.parametrize(("target", "drafter_name", "prompt_text"), [
    ("smollm2-135m", "model:smollm2-135m", PROMPT),
    ("gemma3-270m", "model:smollm2-135m", PROMPT),
    # Retrieval proposes "purple zebra" from the context; where the model draws something else, both are
    # children of one node (checked as candidates), elsewhere the model's proposals stand.
    ("gemma3-270m", "hybrid:smollm2-135m", "I saw a purple zebra. Then I saw a purple zebra. At last I saw a"),
], ids=["same-vocab", "TLI", "hybrid"])
def test_sampled_drafts_keep_the_target_distribution(real_model, target, drafter_name, prompt_text):
    hf, tokenizer = real_model(target)
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter(drafter_name, tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf), max_nodes=8)
    model = drafter.sources[1] if drafter_name.startswith("hybrid") else drafter
    model.rng = np.random.default_rng(7)  # the drafts are random too: the same ones every run
    assert model.bridge.cross == (target != "smollm2-135m")
    model.max_depth = 2  # only the first two tokens are tested
    model.round_ms = 1e9  # draft both levels every time, whatever the clock says
    params = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=2)
    prompt = edge_tokenizer.encode(prompt_text)
    first, pairs, top = _pair_probs(hf, prompt, params, firsts=12)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=1 << 30)
    drafter.begin(prompt, params)
    assert model.ready(timeout=60)
    if drafter_name.startswith("hybrid"):  # its model drafts from what it computed during a pass
        model.speculate(stop=lambda: False)

    def propose() -> DraftTree:
        if drafter_name.startswith("hybrid"):
            drafter._speculated = True  # every trial's tree is drafted as after that pass
        return drafter.propose()
    seen = np.zeros((TRIALS, 2), dtype=np.int64)
    with_proposals = mixed = 0
    for start in range(0, TRIALS, BATCH):
        trials = range(start, min(start + BATCH, TRIALS))
        seqs = [engine.add_sequence(prompt, SamplingParams(**{**params.__dict__, "seed": t})) for t in trials]
        trees = [propose() for _ in trials]
        with_proposals += sum(bool(t.proposals) for t in trees)
        mixed += sum(any(kids and parent not in (t.proposals or {}) for parent, kids in enumerate(t.children(), -1))
                     for t in trees)
        verdicts = engine.step(list(zip(seqs, trees)))
        engine.step([(s, DraftTree.empty()) for s, v in zip(seqs, verdicts) if len(v.tokens) == 1])
        for t, s in zip(trials, seqs):
            seen[t] = s.output_ids[:2]
            engine.release(s)
    if drafter_name.startswith("hybrid"):  # both rules at work: proposals kept, and dropped under mixed nodes
        assert with_proposals > 0 and mixed > 0
    else:
        assert with_proposals == TRIALS  # every tree was a sampled draft with its proposals
    assert _p_value(np.bincount(seen[:, 0], minlength=len(first)), first) > 1e-3
    # Pairs whose first token is among the most likely ones, the rest pooled as one cell.
    index = {t: i for i, t in enumerate(top)}
    counts = np.zeros(pairs.size + 1)
    for a, b in seen:
        counts[index[a] * pairs.shape[1] + b if a in index else -1] += 1
    assert _p_value(counts, np.append(pairs.ravel(), 1 - pairs.sum())) > 1e-3
    # Power: accepting the drafter's samples as they come would show (its q differs from the target's p).
    q = model._probs([], model.bridge.allowed if model.bridge.cross else None)
    q_target = np.zeros_like(first)
    ids = np.flatnonzero(q > 0)
    q_target[model.bridge.targets[ids] if model.bridge.cross else ids] = q[ids]
    assert 0.5 * np.abs(first - q_target).sum() > 0.1


def test_what_a_sampled_draft_sends_never_depends_on_what_was_drawn(real_model):
    """Rejection sampling is exact only if a draw's presence does not depend on the drawn token: the root's
    number of draws and every estimate there are the same whatever the draws."""
    hf, tokenizer = real_model("gemma3-270m")
    drafter = make_drafter("model:smollm2-135m", tokenizer=EdgeTokenizer.from_transformers(tokenizer),
                           eos_ids=eos_token_ids(hf), max_nodes=8)
    drafter.begin(EdgeTokenizer.from_transformers(tokenizer).encode(PROMPT), SamplingParams(temperature=1.0))
    assert drafter.ready(timeout=60)
    shapes, tokens = set(), set()
    for seed in range(20):
        drafter.rng = np.random.default_rng(seed)
        tree = drafter.propose()
        root = tree.children()[0]
        shapes.add(tuple(tree.accept_probs[c] for c in root))
        tokens.add(tuple(tree.tokens[c] for c in root))
    assert len(shapes) == 1 and len(next(iter(shapes))) > 1  # several draws, always the same estimates
    assert len(tokens) > 1  # while the draws themselves differ


def test_a_verdict_longer_than_a_pass_could_read_is_read_in_the_background(real_model):
    """A verdict may commit tens of tokens the model did not speculate through (a long retrieval match, the
    hybrid's). More unread than one pass could read in catch-up forwards goes to the background reader, in
    the prompt's large batches, at the next round the model speculates (or drafts) in; the rounds meanwhile
    go without model drafts."""
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    drafter.begin(edge_tokenizer.encode("Say something."), SamplingParams())
    assert drafter.ready(timeout=60) and len(drafter.propose()) > 0  # times the model's forwards
    verdict = edge_tokenizer.encode(PROMPT * 8)
    drafter.observe(DraftTree.empty(), StepResult(tokens=verdict, accepted=[], compute_ms=50.0))
    assert drafter._unread() > len(verdict) // 2
    drafter.round_ms = 1.0  # one pass reads next to nothing
    drafter.speculate(stop=lambda: False)
    assert drafter._reader is not None  # it reads in the background ...
    assert len(drafter.propose()) == 0 or not drafter.reading  # (no draft while it reads)
    assert drafter.ready(timeout=60) and drafter._unread() == 0  # ... all of it
    assert len(drafter.propose()) > 0


@pytest.mark.parametrize("target", ["smollm2-135m", "gemma3-270m"], ids=["same-vocab", "SLEM"])
def test_a_known_only_draft_starts_no_read_of_a_backlog(real_model, target, monkeypatch):
    """The hybrid asks for the model's part of every tree with `known_only`, also in the passes its model
    rests in (edge/model_worth.py): a backlog read started there would run beside the passes to come, which
    the rest is for. It reads when it next speculates."""
    drafter, edge_tokenizer = _drafter_past_prompt(real_model, target)
    verdict = edge_tokenizer.encode(PROMPT * 8)
    drafter.observe(DraftTree.empty(), StepResult(tokens=verdict, accepted=[], compute_ms=50.0))
    drafter.round_ms, drafter.read_ms = 1.0, 1.0  # far more unread than one pass could read
    forwards = []
    for name in ("logits", "prefill"):
        run = getattr(drafter.model, name)
        monkeypatch.setattr(drafter.model, name, lambda *a, run=run, **k: forwards.append(1) or run(*a, **k))
    assert len(drafter.propose(known_only=True)) == 0
    assert not drafter.reading and not forwards
    drafter.speculate(stop=lambda: False)
    assert drafter.reading or forwards  # (a fast host may be done already)
    assert drafter.ready(timeout=60) and drafter._unread() == 0


def test_a_verdicts_text_is_retokenised_only_when_the_models_context_is_next_wanted(real_model):
    """Re-tokenising a verdict for the drafter's vocabulary (~0.3 ms a round across vocabularies) waits until
    the context is wanted, and then takes every round's tokens at once, giving the context that committing
    each round gives."""
    hf, tokenizer = real_model("gemma3-270m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    lazy, each_round = (make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
                        for _ in range(2))
    prompt = edge_tokenizer.encode(PROMPT)
    text = edge_tokenizer.encode(" cat,\tbecause  cats are quiet: 猫は静か, and café owners like them 🐈.\n")
    for drafter in (lazy, each_round):
        drafter.begin(prompt, SamplingParams())
        assert drafter.ready(timeout=60)
    commits, commit = [], lazy.bridge.commit
    lazy.bridge.commit = lambda ids: commits.append(list(ids)) or commit(ids)
    for at in range(0, len(text), 3):
        for drafter in (lazy, each_round):
            drafter.observe(DraftTree.empty(), StepResult(tokens=text[at : at + 3], accepted=[], compute_ms=50.0))
        each_round.context  # noqa: B018 - committed round by round
    assert commits == []
    assert lazy.context == each_round.context and commits == [text]



def test_a_verdict_is_learned_from_with_the_probabilities_of_the_nodes_it_judged(real_model):
    """Over a long round trip the next tree is drafted before the verdict on the last one is observed (trees
    sent ahead): the acceptance model still learns from each node the verdict judged with the drafter's own
    probability of that node (which travels with the tree), not with the probabilities of the draft made
    since."""
    hf, tokenizer = real_model("smollm2-135m")
    edge_tokenizer = EdgeTokenizer.from_transformers(tokenizer)
    drafter = make_drafter("model:smollm2-135m", tokenizer=edge_tokenizer, eos_ids=eos_token_ids(hf))
    drafter.prefill_in_background = False
    drafter.begin(edge_tokenizer.encode(PROMPT), SamplingParams())
    context = list(drafter.context)
    sent = drafter.propose().prefix(4)
    assert len(sent) == 4
    own, fresh = [], DraftModel(draft_model_path("smollm2-135m"), context=2048)
    for i in range(len(sent)):  # the model's probability of each node given the path above it
        path = [sent.tokens[j] for j in sent.path_to(i)]
        logits = fresh.logits(context + path[:-1]).astype(np.float64)
        p = np.exp(logits - logits.max())
        own.append(p[path[-1]] / p.sum())
    # Another verdict commits other text, and the next tree is drafted from there before `sent` is answered.
    drafter.observe(DraftTree.empty(), StepResult(tokens=edge_tokenizer.encode(" zebra. Then I ran 42 km"),
                                                  accepted=[], compute_ms=50.0))
    assert len(drafter.propose())
    before = drafter.calibration.reached.copy()
    verdict = StepResult(tokens=[sent.tokens[0], 7], accepted=[0], compute_ms=50.0)
    drafter.observe(sent, verdict)
    reached, _ = reached_and_accepted(sent.parents, verdict.accepted)
    want = np.bincount(Calibration.buckets(np.array(own)[reached]), minlength=len(before))
    assert np.array_equal(drafter.calibration.reached - before, want)
