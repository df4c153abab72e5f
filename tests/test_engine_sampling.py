"""Sampled generation on the engine follows the target model's own distribution, for all three rules:
plain sampling (no draft), sample-and-descend over deterministic (retrieval-like) drafts, and recursive
rejection sampling over drafts sampled from a drafter model's proposal q. Tiny model, 16-token vocabulary,
thousands of seeds batched into engine steps, chi-square against the exact pair distribution
p(x1) p(x2 | x1) computed from transformers' logits (on the CPU). The engine runs on the CPU, and on CUDA
where a GPU is visible."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specedge.cloud.engine import Engine
from specedge.cloud.sampling import target_probs
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from tiny_models import DEVICES, tiny_llama

V = 16
PROMPT = [3, 5, 7]
TRIALS = 3000
BATCH = 500


@pytest.fixture(scope="module", params=DEVICES)
def models(request):
    target, drafter = tiny_llama(vocab_size=V, seed=0), tiny_llama(vocab_size=V, seed=1)
    with torch.no_grad():  # sharper than the flat default init, so that mistakes show (see the power test)
        target.lm_head.weight.mul_(4)
    engine = Engine.from_hf_model(copy.deepcopy(target), kv_pool_bytes=64 << 20, block_size=4, device=request.param)
    return target, drafter, engine


def next_logits(model, contexts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor(contexts)).logits[:, -1].float()


def pair_probs(target, params: SamplingParams) -> np.ndarray:
    first = target_probs(next_logits(target, [PROMPT])[0], params).double()
    second = target_probs(next_logits(target, [PROMPT + [t] for t in range(V)]), params).double()
    return (first[:, None] * second).numpy()


def deterministic_tree(trial: int) -> DraftTree:
    """Three root children with two grandchildren each, varying with the trial (no proposals)."""
    rng = np.random.default_rng(trial)
    first = rng.choice(V, 3, replace=False).tolist()
    second = [rng.choice(V, 2, replace=False).tolist() for _ in first]
    return DraftTree(first + sum(second, []), [-1, -1, -1, 0, 0, 1, 1, 2, 2])


def sampled_tree(drafter, q_root: torch.Tensor, q_next: torch.Tensor, trial: int) -> DraftTree:
    """Three children drawn without replacement from the drafter's q at the root, two under each."""
    gen = torch.Generator().manual_seed(10_000 + trial)

    def draw(q: torch.Tensor, k: int) -> list[int]:  # Gumbel-top-k = k draws without replacement
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, dtype=torch.float64, generator=gen)))
        return torch.topk(q.log() + gumbel, k).indices.tolist()

    first = draw(q_root, 3)
    tokens, parents = list(first), [-1, -1, -1]
    proposals = {-1: (list(range(V)), q_root.tolist())}
    for i, t in enumerate(first):
        tokens += draw(q_next[t], 2)
        parents += [i, i]
        proposals[i] = (list(range(V)), q_next[t].tolist())
    return DraftTree(tokens, parents, proposals)


def run(engine: Engine, params: SamplingParams, tree_for) -> np.ndarray:
    """[TRIALS, 2] first two committed tokens, one seed per trial, BATCH sequences per engine step."""
    pairs = np.empty((TRIALS, 2), dtype=np.int64)
    for start in range(0, TRIALS, BATCH):
        trials = range(start, min(start + BATCH, TRIALS))
        seqs = [engine.add_sequence(PROMPT, SamplingParams(**{**params.__dict__, "seed": t})) for t in trials]
        verdicts = engine.step([(s, tree_for(t)) for s, t in zip(seqs, trials)])
        short = [s for s, v in zip(seqs, verdicts) if len(v.tokens) == 1]
        engine.step([(s, DraftTree.empty()) for s in short])
        for t, s in zip(trials, seqs):
            pairs[t] = s.output_ids[:2]
            engine.release(s)
    assert engine.pool.stats().used == 0
    return pairs


def p_value(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    if counts[probs == 0].any():
        return 0.0
    observed, expected = counts[probs > 0], probs[probs > 0] / probs.sum() * len(samples)
    sparse = expected < 5  # pool sparse cells so that the chi-square approximation holds
    if sparse.any():
        observed = np.append(observed[~sparse], observed[sparse].sum())
        expected = np.append(expected[~sparse], expected[sparse].sum())
    return float(chisquare(observed, expected).pvalue)


SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-k10-p0.9"])
@pytest.mark.parametrize("rule", ["no_draft", "deterministic_drafts", "sampled_drafts"])
def test_engine_sampling_follows_the_target_distribution(models, rule, params):
    target, drafter, engine = models
    probs = pair_probs(target, params)
    if rule == "no_draft":
        tree_for = lambda t: DraftTree.empty()  # noqa: E731
    elif rule == "deterministic_drafts":
        tree_for = deterministic_tree
    else:
        q_root = next_logits(drafter, [PROMPT])[0].double().softmax(-1)
        q_next = next_logits(drafter, [PROMPT + [t] for t in range(V)]).double().softmax(-1)
        tree_for = lambda t: sampled_tree(drafter, q_root, q_next, t)  # noqa: E731
    pairs = run(engine, params, tree_for)
    assert p_value(pairs[:, 0], probs.sum(1)) > 1e-3
    assert p_value(pairs[:, 0] * V + pairs[:, 1], probs.ravel()) > 1e-3


def test_the_target_is_neither_flat_nor_deterministic_and_the_drafter_differs_so_the_tests_have_power(models):
    target, drafter, _ = models
    p = pair_probs(target, SETTINGS[0]).sum(1)
    assert 0.1 < p.max() < 0.9 and -(p * np.log(p)).sum() > 1.0
    q = next_logits(drafter, [PROMPT])[0].double().softmax(-1).numpy()
    assert 0.5 * np.abs(p - q).sum() > 0.2  # total variation: accepting drafts blindly would show
