"""AffinityIndex: a verifier's cached prefix as its WatchCache stream reports it, plus the blocks of
prompts just placed there until their prefill is reported (or the expectation runs out)."""

from __future__ import annotations

from specedge.cloud.router.affinity_index import AffinityIndex
from specedge.common.block_hash import prompt_block_hashes

BLOCK = 4
DOCUMENT = list(range(10, 30))  # 5 blocks
PROMPT = DOCUMENT + [1, 2]  # its cacheable prefix: the document's 5 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_longest_reported_prefix_counts_and_evictions_cut_it():
    index = AffinityIndex()
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    index.replace("a", BLOCK, hashes[:3])
    index.replace("b", BLOCK, [])
    assert index.cached_tokens(["a", "b", "c"], PROMPT) == {"a": 12, "b": 0, "c": 0}
    index.update("b", stored=hashes, removed=[])
    index.update("a", stored=[], removed=[hashes[1]])  # a hole: only the prefix before it counts
    assert index.cached_tokens(["a", "b"], PROMPT) == {"a": 4, "b": 20}
    index.forget("b")
    assert index.cached_tokens(["b"], PROMPT) == {"b": 0} and index.blocks("b") == 0


def test_a_placed_prompt_counts_as_held_until_its_expectation_runs_out():
    clock = Clock()
    index = AffinityIndex(expect_s=10, clock=clock)
    index.replace("a", BLOCK, [])
    index.expect("a", PROMPT)
    assert index.cached_tokens(["a"], DOCUMENT + [7, 7, 7]) == {"a": 20}  # the next question follows it
    clock.now += 11  # its blocks were never reported (evicted at once, or the prefill failed)
    assert index.cached_tokens(["a"], PROMPT) == {"a": 0}


def test_expectations_die_with_the_verifier():
    index = AffinityIndex()
    index.replace("a", BLOCK, [])
    index.expect("a", PROMPT)
    index.forget("a")
    index.replace("a", BLOCK, [])
    assert index.cached_tokens(["a"], PROMPT) == {"a": 0}


def test_a_reported_eviction_ends_the_expectation():
    index = AffinityIndex()
    index.replace("a", BLOCK, [])
    index.expect("a", PROMPT)
    hashes = prompt_block_hashes(PROMPT, BLOCK)
    index.update("a", stored=hashes, removed=[])
    index.update("a", stored=[], removed=hashes[:1])
    assert index.cached_tokens(["a"], PROMPT) == {"a": 0}
