"""Verifier hints: with every verdict a session that asked for them gets the target's own top k tokens and
their probabilities at the root and at every draft node of the pass, accepted or not, in process and over
gRPC; a verifier caps k and advertises the cap; a session that did not ask pays nothing."""

from __future__ import annotations

import pytest
import torch

from specedge.cloud.config import ServerConfig
from specedge.cloud.engine import Engine
from specedge.cloud.hints import top_k_hints, top_k_hints_plain
from specedge.cloud.launch import EmbeddedVerifier
from specedge.cloud.local import LocalVerifier
from specedge.common import wire
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.transport import RemoteVerifier
from specedge.protos import verifier_pb2 as pb
from tiny_models import tiny_llama

V = 512
PROMPT = [3, 4, 5, 6, 7, 8, 9, 10] * 3
GREEDY = SamplingParams(max_new_tokens=12)


@pytest.mark.parametrize("vocab", [10, 300, 4096, 49152, 49157])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("way", ["cpu", "plain"])  # plain: what runs off the CPU, here on CPU tensors
def test_hints_are_the_top_k_of_the_softmax_at_the_sessions_temperature(vocab, temperature, way):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
    if way == "cpu":
        hints = top_k_hints(logits, 8, temperature)
    else:
        hints = top_k_hints_plain(logits, 8, 1.0 / temperature if temperature else 1.0)
    want = torch.softmax(logits / (temperature or 1.0), dim=-1).topk(min(8, vocab), dim=-1)
    assert hints.ids == want.indices.tolist()
    assert torch.allclose(torch.tensor(hints.probs), want.values, rtol=1e-4, atol=1e-7)


def test_hints_cross_the_wire_in_a_byte_per_probability():
    hints = Hints([[5, 9, 2], [7, 1, 0]], [[0.5, 0.25, 0.004], [1.0, 0.0, 0.0]])
    msg = wire.hints_to_pb(hints)
    assert msg.k == 3 and len(msg.probs) == 6
    back = wire.hints_from_pb(pb.Verdict.FromString(pb.Verdict(hints=msg).SerializeToString()).hints)
    assert back.ids == hints.ids
    assert all(abs(a - b) <= 0.5 / 255 for row, sent in zip(back.probs, hints.probs) for a, b in zip(row, sent))
    assert wire.hints_from_pb(pb.Verdict().hints) is None  # a verdict without hints
    with pytest.raises(ValueError, match="malformed hints"):
        wire.hints_from_pb(pb.Hints(k=2, token_ids=[1, 2, 3], probs=b"\x01\x02\x03"))


@pytest.fixture(scope="module")
def engine():
    return Engine.from_hf_model(tiny_llama(vocab_size=V), kv_pool_bytes=16 << 20, block_size=4)


def test_a_verdict_has_a_row_for_the_root_and_every_node_accepted_or_not(engine):
    seq = engine.add_sequence(PROMPT, GREEDY, hints_top_k=4)
    engine.step([(seq, DraftTree.empty())])  # the prefill
    root = len(seq.token_ids)
    tree = DraftTree([11, 12, 13, 14], [-1, -1, 0, 2])
    (logits,) = engine.forward([(seq, tree)])
    want = top_k_hints(logits, 4)
    engine.pool.truncate(seq.seq_id, seq.num_cached)  # forget that forward: step() repeats it
    (verdict,) = engine.step([(seq, tree)])
    assert len(verdict.hints) == 1 + len(tree) and all(len(row) == 4 for row in verdict.hints.ids)
    assert verdict.hints.ids == want.ids
    # Greedy: the bonus token is the top hint of the last accepted node (or of the root).
    last = verdict.accepted[-1] + 1 if verdict.accepted else 0
    assert verdict.hints.ids[last][0] == verdict.bonus and len(seq.token_ids) == root + len(verdict.tokens)
    engine.release(seq)


def test_a_sequence_that_did_not_ask_gets_no_hints(engine):
    seq = engine.add_sequence(PROMPT, GREEDY)
    (verdict,) = engine.step([(seq, DraftTree.chain([11, 12]))])
    assert verdict.hints is None
    engine.release(seq)


def test_in_process_sessions_hand_hints_to_the_drafter_and_the_output_does_not_change(engine):
    seen: list[tuple[int, int]] = []

    class Recording(FunctionDrafter):
        hints_top_k = 3

        def observe(self, tree, result):
            seen.append((len(tree), len(result.hints)))
            assert all(len(row) == 3 for row in result.hints.ids)
            super().observe(tree, result)

    want = generate(LocalVerifier(engine).open(PROMPT, GREEDY)).token_ids
    drafter = Recording(lambda c: DraftTree([c[-1], 7, 8], [-1, -1, 0]))
    got = generate(LocalVerifier(engine).open(PROMPT, GREEDY, hints_top_k=3), drafter=drafter)
    assert got.token_ids == want
    assert seen and all(rows == 1 + nodes for nodes, rows in seen)


@pytest.fixture(scope="module")
def server():
    hf = tiny_llama(vocab_size=V)
    hf.generation_config.eos_token_id = None
    config = ServerConfig(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, gather_ms=1.0, max_hints_top_k=5)
    with EmbeddedVerifier(config, (hf, None)) as s:
        yield s


def test_get_info_advertises_the_cap_and_a_larger_ask_is_served_at_it(server):
    verifier = RemoteVerifier(server.target)
    assert verifier.info.limits.max_hints_top_k == 5
    session = verifier.open(PROMPT, GREEDY, hints_top_k=50)
    first = session.step(DraftTree.chain([11, 12, 13]))
    assert len(first.hints) == 4 and {len(row) for row in first.hints.ids} == {5}
    local = LocalVerifier(server.engine).open(PROMPT, GREEDY, hints_top_k=5)
    want = local.step(DraftTree.chain([11, 12, 13]))
    local.close()
    assert first.hints.ids == want.hints.ids
    assert all(abs(a - b) <= 0.5 / 255 + 1e-6
               for r, w in zip(first.hints.probs, want.hints.probs) for a, b in zip(r, w))
    session.close()
    plain = verifier.open(PROMPT, GREEDY)
    assert plain.step(DraftTree.chain([11])).hints is None
    plain.close()
    verifier.close()


def test_a_negative_ask_is_no_ask(server):
    verifier = RemoteVerifier(server.target)
    session = verifier.open(PROMPT, GREEDY, hints_top_k=-3)
    assert session.step(DraftTree.empty()).hints is None
    session.close()
    verifier.close()
