"""Hints at the prompt's positions (cloud/prompt_hints.py): the prefill's rows, sent with the first verdict to
a session that asks, and learned by the edge's recycling table."""

from __future__ import annotations

import pytest
import torch

from specedge.cloud.config import ServerConfig
from specedge.cloud.engine import Engine
from specedge.cloud.launch import EmbeddedVerifier
from specedge.cloud.local import LocalVerifier
from specedge.cloud.prompt_hints import COMMON, candidates
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.generation import generate
from specedge.edge.recycling import Recycler
from specedge.edge.retrieval import RetrievalDrafter
from specedge.edge.transport import RemoteVerifier
from tiny_models import tiny_llama

V = 4096  # more than COMMON: the rows choose among candidates, not the whole vocabulary
K = 4
GREEDY = SamplingParams(max_new_tokens=12)
PROMPT = [(37 * i) % 3000 + 1000 for i in range(30)] + [5, 6, 7, 8] * 3  # tokens above COMMON too


@pytest.fixture(scope="module")
def hf():
    model = tiny_llama(vocab_size=V)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture()
def engine(hf):
    return Engine.from_hf_model(hf, kv_pool_bytes=16 << 20, block_size=4)


def reference(hf, prompt: list[int], k: int = K, temperature: float = 0.0) -> Hints:
    """The rows as specified: the target's top k among the prompt's tokens and the first COMMON ids after each
    prompt token but the last, probabilities normalised over those candidates."""
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0, :-1]
        ids = torch.tensor(sorted(set(range(COMMON)) | set(prompt)))
        logits = hidden @ hf.lm_head.weight[ids].T
        probs, at = (logits / (temperature or 1.0)).softmax(-1).topk(k, dim=-1)
    return Hints(ids[at].tolist(), probs.tolist())


def assert_rows_equal(got: Hints, want: Hints) -> None:
    assert got.ids == want.ids
    assert all(abs(a - b) < 1e-4 for r, w in zip(got.probs, want.probs) for a, b in zip(r, w))


def test_candidates_are_the_vocabularys_first_ids_and_the_prompts_own_tokens():
    got = candidates([5000, 7, 5000, 9000], vocab_size=8192)
    assert got.tolist() == list(range(COMMON)) + [5000]  # (9000 is no token of this vocabulary)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_first_verdict_has_a_row_after_every_prompt_token_but_the_last(hf, engine, temperature):
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=1)
    seq = engine.add_sequence(PROMPT, params, hints_top_k=K, prompt_hints=True)
    (first,) = engine.step([(seq, DraftTree.chain([5, 6]))])
    assert first.prompt_hints_start == 0 and len(first.prompt_hints) == len(PROMPT) - 1
    assert_rows_equal(first.prompt_hints, reference(hf, PROMPT, temperature=temperature))
    (second,) = engine.step([(seq, DraftTree.chain([5]))])
    assert second.prompt_hints is None and second.hints is not None  # once only; the tree's rows as before
    engine.release(seq)


def test_no_rows_unless_asked_and_none_without_hints(engine):
    for hints_top_k, asked in ((K, False), (0, True)):
        seq = engine.add_sequence(PROMPT, GREEDY, hints_top_k=hints_top_k, prompt_hints=asked)
        (verdict,) = engine.step([(seq, DraftTree.empty())])
        assert verdict.prompt_hints is None
        engine.release(seq)


def test_a_prefill_in_chunks_gathers_the_rows_of_every_chunk(hf, engine):
    seq = engine.add_sequence(PROMPT, GREEDY, hints_top_k=K, prompt_hints=True)
    assert engine.step([], chunks=[(seq, 16)]) == []
    assert engine.step([], chunks=[(seq, 16)]) == []
    (verdict,) = engine.step([(seq, DraftTree.empty())])
    assert_rows_equal(verdict.prompt_hints, reference(hf, PROMPT))
    engine.release(seq)


def test_rows_start_after_the_prefix_the_cache_held(hf, engine):
    first = engine.add_sequence(PROMPT, GREEDY)
    engine.step([(first, DraftTree.empty())])
    engine.release(first)  # its blocks stay in the prefix cache
    longer = PROMPT + [9, 10, 11]
    seq = engine.add_sequence(longer, GREEDY, hints_top_k=K, prompt_hints=True)
    assert seq.num_cached > 0
    (verdict,) = engine.step([(seq, DraftTree.empty())])
    assert verdict.prompt_hints_start == seq.prompt_len - len(verdict.prompt_hints) - 1 > 0
    want = reference(hf, longer)
    start = verdict.prompt_hints_start
    assert_rows_equal(verdict.prompt_hints, Hints(want.ids[start:], want.probs[start:]))
    engine.release(seq)


def test_a_sequence_batched_with_others_gets_its_own_rows(hf, engine):
    other = engine.add_sequence([3, 4, 5, 6, 7], GREEDY, hints_top_k=K)
    engine.step([(other, DraftTree.empty())])
    seq = engine.add_sequence(PROMPT, GREEDY, hints_top_k=K, prompt_hints=True)
    verdicts = engine.step([(other, DraftTree.chain([8, 9])), (seq, DraftTree.chain([5]))])
    assert verdicts[0].prompt_hints is None and verdicts[0].hints is not None and len(verdicts[0].hints) == 3
    assert_rows_equal(verdicts[1].prompt_hints, reference(hf, PROMPT))
    for s in (other, seq):
        engine.release(s)


def test_the_recycling_table_keeps_a_row_per_text_position():
    recycler = Recycler(K)
    text = [50, 51, 52, 53, 51, 54]
    rows = Hints([[10 + j] * K for j in range(8)], [[0.5] * K for _ in range(8)])  # more rows than text
    recycler.learn_text(text, start=1, hints=rows)
    row, kind = recycler.table.row((50, 51))  # after text[1], by its last two tokens
    assert row[0] >> 8 == 10 and kind == 1
    row, kind = recycler.table.row((99, 51))  # an unknown pair: the newest row by one token (after text[4])
    assert row[0] >> 8 == 13 and kind == 0
    assert recycler.table.row((54,))[0][0] >> 8 == 14  # rows beyond the text are dropped
    assert len(recycler.table) == 4


def test_the_retrieval_drafter_drafts_from_the_prompts_rows():
    drafter = RetrievalDrafter(hints_top_k=K)
    prompt = [100, 101, 102, 103]
    drafter.begin(prompt, GREEDY)
    assert len(drafter.propose()) == 0  # nothing repeats, no table yet
    rows = Hints([[200 + j, 300, 301, 302] for j in range(3)], [[0.9, 0.05, 0.03, 0.02]] * 3)
    drafter.observe(DraftTree.empty(), StepResult(tokens=[101], accepted=[], compute_ms=1.0, prompt_hints=rows,
                                                  prompt_hints_start=0))
    # The text now ends ... 103, 101: the row after 101 (prompt position 1) says 201.
    assert drafter.propose().tokens[:1] == [201]
    drafter.end()


def test_in_process_generation_with_prompt_rows_is_unchanged(engine):
    want = generate(LocalVerifier(engine).open(PROMPT, GREEDY)).token_ids
    for prompt_hints in (True, False):
        session = LocalVerifier(engine).open(PROMPT, GREEDY, hints_top_k=K, prompt_hints=prompt_hints)
        got = generate(session, drafter=RetrievalDrafter(hints_top_k=K))
        assert got.token_ids == want


def test_a_served_session_that_asks_for_hints_gets_the_prompts_rows_in_a_byte_each(hf):
    config = ServerConfig(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, gather_ms=1.0, max_hints_top_k=K)
    with EmbeddedVerifier(config, (hf, None)) as server:
        verifier = RemoteVerifier(server.target)
        session = verifier.open(PROMPT, GREEDY, hints_top_k=K)
        first = session.step(DraftTree.chain([5, 6]))
        second = session.step(DraftTree.chain([5]))
        session.close()
        want = reference(hf, PROMPT)
        assert first.prompt_hints_start == 0 and first.prompt_hints.ids == want.ids
        assert all(abs(a - b) <= 0.5 / 255 + 1e-4 for r, w in zip(first.prompt_hints.probs, want.probs)
                   for a, b in zip(r, w))
        assert second.prompt_hints is None
        plain = verifier.open(PROMPT, GREEDY)
        assert plain.step(DraftTree.empty()).prompt_hints is None
        plain.close()
        verifier.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU visible: runs on a GPU machine")])])
def test_the_rows_come_the_same_where_the_logits_are_read_back_as_off_the_cpu(hf, device):
    """On the CPU with `read_back_logits` switched on: the GPU's code path (the step's logits computed where they
    lie and read back), and on a GPU when one is visible."""
    engine = Engine.from_hf_model(tiny_llama(vocab_size=V), kv_pool_bytes=16 << 20, block_size=4, device=device,
                                  dtype=torch.float32)
    engine.read_back_logits = True
    seq = engine.add_sequence(PROMPT, GREEDY, hints_top_k=K, prompt_hints=True)
    (verdict,) = engine.step([(seq, DraftTree.chain([5, 6]))])
    assert_rows_equal(verdict.prompt_hints, reference(hf, PROMPT))
    assert len(verdict.hints) == 3
    engine.release(seq)
