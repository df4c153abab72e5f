"""`specedge bench` with one client: every method against one verifier, prompt by prompt (bench/serving.py's
run_interleaved), over real gRPC to a tiny model. No method may find another's prefill of the same prompt in
the verifier's prefix cache, and methods take turns so that none is always first after another."""

from __future__ import annotations

from specedge.bench.serving import RunningVerifier, run_interleaved
from specedge.cloud.config import ServerConfig
from specedge.cloud.launch import EmbeddedVerifier
from specedge.common.draft_tree import DraftTree
from specedge.edge.drafter import FunctionDrafter
from tiny_models import tiny_llama

V = 512


def test_methods_take_turns_prompt_by_prompt_and_none_finds_anothers_prefill():
    hf = tiny_llama(vocab_size=V)
    hf.generation_config.eos_token_id = None
    config = ServerConfig(model="tiny", port=0, kv_pool_mb=8, max_tree_tokens=32, max_new_tokens=64, gather_ms=1.0)
    jobs = [list(range(1 + k, 50 + k)) for k in range(3)]  # 3 full blocks each, before the last token's
    began: list[tuple[str, int]] = []

    def drafter(method: str) -> FunctionDrafter:
        d = FunctionDrafter(lambda committed: DraftTree.chain([(committed[-1] + 1) % V]))
        d.begin = lambda prompt, params=None, d=d: (began.append((method, jobs.index(prompt))),
                                                    setattr(d, "committed", list(prompt)))
        return d

    with EmbeddedVerifier(config, (hf, None)) as v:
        results = run_interleaved(RunningVerifier(v.target), ["a", "b", "c"], jobs, max_new_tokens=6, eos=[],
                                  make_drafter=drafter, max_tree=8)
        prompt_tokens = v.service.metrics.prompt_tokens
        cached = prompt_tokens.labels("cached")._value.get()
        computed = prompt_tokens.labels("computed")._value.get()

    assert began == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    assert cached == 0 and computed == 9 * 49  # every generation prefilled its whole prompt
    for method in "abc":
        assert [r.prompt for r in results[method]] == [0, 1, 2]
        assert [r.tokens for r in results[method]] == [r.tokens for r in results["a"]]
        assert all(len(r.tokens) == 6 and r.wall_s > 0 for r in results[method])
