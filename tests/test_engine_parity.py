"""The engine's own forward pass gives transformers' logits (fp32, max abs diff <= 1e-3) for prefill,
incremental decoding, tree verification, batches of ragged sequences and reused prefix blocks, on the CPU
and (where a GPU is visible) on CUDA, whose attention takes the padded-group path (cloud/padded_attention.py)."""

from __future__ import annotations

import random

import pytest
import torch

from specedge.cloud.acceptance import Verdict
from specedge.cloud.engine import Engine
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from tiny_models import DEVICES, tiny_gemma3, tiny_llama

TOL = 1e-3
GREEDY = SamplingParams()


def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids], device=hf.device)).logits[0].float().cpu()


def random_tree(true_next: list[int], vocab: int, rng: random.Random, size: int) -> tuple[DraftTree, list[int]]:
    """A tree of `size` nodes whose true path (the given tokens) sits among random siblings.

    Returns the tree and the node indices of the true path."""
    tokens, parents, true_path = [], [], []

    def add_decoy(parent: int, avoid: int | None = None) -> None:
        siblings = {tokens[i] for i, p in enumerate(parents) if p == parent} | {avoid}
        token = rng.randrange(vocab)
        if token not in siblings:
            tokens.append(token), parents.append(parent)

    parent = -1
    for tok in true_next:
        for _ in range(rng.randint(0, 2)):  # decoys before the true child so it is not always first
            add_decoy(parent, avoid=tok)
        tokens.append(tok), parents.append(parent)
        parent = len(tokens) - 1
        true_path.append(parent)
    while len(tokens) < size:  # more decoys hanging anywhere
        add_decoy(rng.randrange(-1, len(tokens)))
    tree = DraftTree(tokens, parents)
    tree.validate(vocab)
    return tree, true_path


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got.float().cpu() - want).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.2e} > {TOL}"


def run_parity(hf, engine: Engine, prompt: list[int], continuation: list[int], seed: int, offpath_checks: int = 100):
    rng = random.Random(seed)
    vocab = engine.vocab_size
    full = prompt + continuation
    ref = reference_logits(hf, full)
    seq = engine.add_sequence(prompt, GREEDY)

    # Prefill together with a chain of the first continuation tokens.
    tree = DraftTree(continuation[:3], [-1, 0, 1])
    (logits,) = engine.forward([(seq, tree)])
    assert_close(logits, ref[len(prompt) - 1 : len(prompt) + 3], "prefill + chain")
    engine.commit(seq, tree, Verdict([0, 1, 2], continuation[:4], continuation[3]))

    checks = 0
    while len(seq.token_ids) < len(full) - 1:
        at = len(seq.token_ids)  # continuation tokens from here on are the "true" drafts
        depth = rng.randint(0, min(4, len(full) - 1 - at))
        tree, true_path = random_tree(full[at : at + depth], vocab, rng, size=depth + rng.randint(0, 6))
        (logits,) = engine.forward([(seq, tree)])
        assert_close(logits[0], ref[at - 1], f"root at {at}")
        for j, node in enumerate(true_path):
            assert_close(logits[1 + node], ref[at + j], f"true node depth {j + 1} at {at}")
        for node in set(range(len(tree))) - set(true_path):
            if checks < offpath_checks:
                path = [tree.tokens[i] for i in tree.path_to(node)]
                want = reference_logits(hf, seq.token_ids + path)[-1]
                assert_close(logits[1 + node], want, f"decoy node {node} at {at}")
                checks += 1
        accepted = rng.randint(0, len(true_path))  # commit part of the true path, then the true bonus
        engine.commit(seq, tree, Verdict(true_path[:accepted], full[at : at + accepted + 1], full[at + accepted]))
    return seq


@pytest.fixture(params=["llama", "gemma3"])
def arch(request) -> str:
    return request.param


@pytest.fixture(params=DEVICES)
def tiny(request, arch):
    hf = tiny_llama() if arch == "llama" else tiny_gemma3(sliding_window=8)
    return hf, Engine.from_hf_model(hf, kv_pool_bytes=4 << 20, block_size=4, device=request.param)


@pytest.mark.parametrize("seed", range(3))
def test_tiny_prefill_decode_and_trees_match_transformers(tiny, seed):
    hf, engine = tiny
    rng = random.Random(seed)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(1, 20))]
    continuation = [rng.randrange(engine.vocab_size) for _ in range(30)]  # past gemma's 8-token window
    seq = run_parity(hf, engine, prompt, continuation, seed)
    engine.release(seq)
    assert engine.pool.stats().used == 0


def test_tiny_batch_of_ragged_sequences_matches_solo_logits(tiny):
    hf, engine = tiny
    rng = random.Random(7)
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(n)] for n in (1, 5, 13, 21)]
    seqs = [engine.add_sequence(p, GREEDY) for p in prompts]
    trees = [DraftTree([], []), DraftTree([5, 6, 7], [-1, -1, 0]), DraftTree([9], [-1]), DraftTree([3, 4], [-1, 0])]
    outputs = engine.forward(list(zip(seqs, trees)))
    for p, tree, logits in zip(prompts, trees, outputs):
        for node in range(-1, len(tree)):
            path = [] if node < 0 else [tree.tokens[i] for i in tree.path_to(node)]
            assert_close(logits[node + 1], reference_logits(hf, p + path)[-1], f"prompt len {len(p)} node {node}")


def test_tiny_reused_prefix_blocks_give_the_same_logits(tiny):
    hf, engine = tiny
    rng = random.Random(3)
    shared = [rng.randrange(engine.vocab_size) for _ in range(17)]
    first = engine.add_sequence(shared + [1, 2], GREEDY)
    engine.step([(first, DraftTree([], []))])
    engine.release(first)  # its full blocks stay cached
    second = engine.add_sequence(shared + [3], GREEDY)
    assert second.num_cached == 16  # four full blocks of 4 reused; the last token is always recomputed
    (logits,) = engine.forward([(second, DraftTree([4], [-1]))])
    assert_close(logits, reference_logits(hf, shared + [3, 4])[-2:], "after prefix reuse")


# ---- real models --------------------------------------------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_model_parity(name, real_model):
    hf, tokenizer = real_model(name)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=256 << 20)
    text = open(__file__).read()
    ids = tokenizer(text)["input_ids"]
    # Gemma 3's local layers see 512 tokens; start below and end above that boundary.
    prompt, continuation = ids[:490], ids[490:560]
    seq = run_parity(hf, engine, prompt, continuation, seed=0, offpath_checks=6)
    engine.release(seq)
    assert engine.pool.stats().used == 0


def test_tiny_long_prefill_takes_the_causal_kernel_and_matches_transformers(tiny):
    hf, engine = tiny
    rng = random.Random(11)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(150)]  # long enough for the flash path
    seq = engine.add_sequence(prompt, GREEDY)
    tree = DraftTree([7, 8, 9], [-1, 0, -1])
    (logits,) = engine.forward([(seq, tree)])
    ref = reference_logits(hf, prompt + [7, 8])
    assert_close(logits[:3], ref[-3:], "prefill + chain")
    assert_close(logits[3], reference_logits(hf, prompt + [9])[-1], "prefill + sibling")
    engine.release(seq)


def test_tiny_prefill_in_chunks_beside_another_sequence_matches_transformers(tiny):
    """A long prompt prefilled over three steps (chunks of 70, 1 and 60 tokens, the first with no cached
    prefix, the others after one), each shared with another sequence's decode step, then its tree: the same
    logits as one pass, and the other sequence is undisturbed. Chunks cross gemma's 8-token window."""
    hf, engine = tiny
    rng = random.Random(5)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(140)]
    other_prompt = [rng.randrange(engine.vocab_size) for _ in range(9)]
    other = engine.add_sequence(other_prompt, GREEDY)
    engine.step([(other, DraftTree.empty())])
    seq = engine.add_sequence(prompt, GREEDY)
    for n in (70, 1, 60):
        (logits,) = engine.forward([(other, DraftTree.empty())], [(seq, n)])
        assert_close(logits[0], reference_logits(hf, other.token_ids)[-1], "the other sequence's step")
        engine.step([(other, DraftTree.empty())], [(seq, n)])
    assert seq.num_cached == 131
    tree = DraftTree([7, 8, 9], [-1, 0, -1])
    (logits,) = engine.forward([(seq, tree)])
    ref = reference_logits(hf, prompt + [7, 8])
    assert_close(logits[:3], ref[-3:], "the last chunk + chain")
    assert_close(logits[3], reference_logits(hf, prompt + [9])[-1], "the last chunk + sibling")


def test_a_chunk_must_leave_the_prompts_last_token_for_the_verdict(tiny):
    _, engine = tiny
    seq = engine.add_sequence(list(range(1, 11)), GREEDY)
    with pytest.raises(ValueError, match="must leave the last"):
        engine.step([], [(seq, 10)])
    assert engine.step([], [(seq, 9)]) == [] and seq.num_cached == 9
