"""KVBlockPool: a fixed budget of blocks, per-sequence block tables, hash-chained prefix sharing with
reference counts, LRU eviction of unreferenced cached blocks, all-or-nothing reservation, no leaks."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from specedge.cloud.kv_pool import KVBlockPool, KVPoolExhausted
from specedge.common.block_hash import prompt_block_hashes

BLOCK = 4


def make_pool(num_blocks: int) -> KVBlockPool:
    block = KVBlockPool.block_bytes(BLOCK, num_layers=2, num_kv_heads=1, head_dim=2)
    return KVBlockPool(num_blocks * block, BLOCK, num_layers=2, num_kv_heads=1, head_dim=2)


def check_invariants(pool: KVBlockPool) -> None:
    refs = Counter(b for table in pool.tables.values() for b in table.blocks)
    for table in pool.tables.values():
        assert len(set(table.blocks)) == len(table.blocks), "a block appears twice in one table"
    free, cached = set(pool.free_ids), set(pool.cached_ids)
    assert len(free) == len(pool.free_ids) and not free & cached
    for block in pool.blocks:
        assert block.ref_count == refs[block.block_id]
        if block.block_id in free:
            assert block.ref_count == 0 and block.hash is None
        elif block.block_id in cached:
            assert block.ref_count == 0 and pool.hash_to_block[block.hash] == block.block_id
        else:
            assert block.ref_count > 0, f"block {block.block_id} leaked: unreferenced, not free, not cached"
    for h, block_id in pool.hash_to_block.items():
        assert pool.blocks[block_id].hash == h
    stats = pool.stats()
    assert stats.used + stats.cached + stats.free == pool.num_blocks


def test_budget_is_divided_into_whole_blocks():
    pool = KVBlockPool(10_000, block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
    assert pool.bytes_per_block == 2 * 2 * 4 * 1 * 8 * 4
    assert pool.num_blocks == 10_000 // pool.bytes_per_block
    assert pool.k.shape == (2, pool.num_blocks * 4, 1, 8)
    with pytest.raises(ValueError, match="smaller than one block"):
        KVBlockPool(100, block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def test_same_prompt_shares_full_blocks_but_recomputes_the_last_token():
    pool = make_pool(16)
    prompt = list(range(13))
    assert pool.open(1, prompt) == 0
    pool.reserve(1, 13)
    pool.commit(1, prompt)
    assert pool.open(2, prompt) == 12  # 3 full blocks; token 13 is recomputed for its logits
    assert pool.tables[2].blocks == pool.tables[1].blocks[:3]
    assert pool.open(3, prompt[:12]) == 8  # exactly 3 blocks long: the last block is not reused
    assert pool.open(4, [99] + prompt[1:]) == 0  # the chain breaks at the first block
    check_invariants(pool)


def test_cached_blocks_outlive_their_sequence_and_are_evicted_lru():
    pool = make_pool(4)
    for seq_id, first in ((1, 100), (2, 200)):
        prompt = [first, 1, 2, 3, first, 5, 6, 7]
        pool.open(seq_id, prompt)
        pool.reserve(seq_id, 8)
        pool.commit(seq_id, prompt)
        pool.close(seq_id)
    assert pool.stats().cached == 4
    pool.open(3, [7] * 9)
    pool.reserve(3, 8)  # needs two blocks: evicts sequence 1's, released first
    assert pool.open(4, [100, 1, 2, 3, 100, 5, 6, 7, 0]) == 0
    assert pool.open(5, [200, 1, 2, 3, 200, 5, 6, 7, 0]) == 8
    check_invariants(pool)


def test_reservation_is_all_or_nothing():
    pool = make_pool(3)
    pool.open(1, [1, 2])
    pool.reserve(1, 8)
    before = pool.stats()
    with pytest.raises(KVPoolExhausted, match="need 2 more blocks"):
        pool.reserve(1, 16)
    assert pool.stats() == before
    check_invariants(pool)


def test_truncate_releases_speculative_blocks_but_never_committed_ones():
    pool = make_pool(8)
    tokens = list(range(9))
    pool.open(1, tokens)
    pool.reserve(1, 20)  # room for a draft tree
    pool.truncate(1, 9)
    assert len(pool.tables[1].blocks) == 3
    pool.commit(1, tokens)
    with pytest.raises(ValueError):
        pool.truncate(1, 4)
    check_invariants(pool)


def test_move_copies_kv_between_slots_in_every_layer():
    pool = make_pool(4)
    pool.open(1, [1])
    pool.reserve(1, 8)
    slots = pool.slots(1, 0, 8)
    pool.k[:, slots] = torch.arange(8.0)[None, :, None, None]
    pool.move(slots[torch.tensor([5, 7])], slots[torch.tensor([4, 5])])
    assert pool.k[1, slots, 0, 0].tolist() == [0, 1, 2, 3, 5, 7, 6, 7]


@pytest.mark.parametrize("seed", range(40))
def test_random_session_histories_keep_the_books_straight_and_leak_nothing(seed):
    rng = random.Random(seed)
    pool = make_pool(rng.randint(6, 24))
    announced: set[int] = set()  # what a router hears of: the pool's hashes, from its on_change events
    pool.on_change = lambda stored, removed: (announced.update(stored), announced.difference_update(removed))
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    committed: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25 or not committed:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            cached = pool.open(next_id, prompt)
            assert cached % BLOCK == 0 and cached < len(prompt)
            try:
                pool.reserve(next_id, len(prompt))
            except KVPoolExhausted:
                pool.close(next_id)
            else:
                pool.commit(next_id, prompt)
                committed[next_id] = prompt
            next_id += 1
        elif op < 0.8:  # one verification round: room for a tree, keep an accepted prefix of it
            seq_id = rng.choice(list(committed))
            tokens = committed[seq_id]
            tree = rng.randint(1, 9)
            try:
                pool.reserve(seq_id, len(tokens) + tree)
            except KVPoolExhausted:
                continue
            tokens.extend(rng.randrange(50) for _ in range(rng.randint(1, tree)))
            pool.truncate(seq_id, len(tokens))
            pool.commit(seq_id, tokens)
        else:
            seq_id = rng.choice(list(committed))
            pool.close(seq_id)
            del committed[seq_id]
        check_invariants(pool)
        assert announced == set(pool.hash_to_block)
    for seq_id in committed:
        pool.close(seq_id)
    check_invariants(pool)
    assert pool.stats().used == 0


def test_drop_cached_frees_unreferenced_prefixes_and_keeps_used_ones():
    pool = make_pool(8)
    for seq_id, first in ((1, 100), (2, 200)):
        prompt = [first, 1, 2, 3, 4]
        pool.open(seq_id, prompt)
        pool.reserve(seq_id, 5)
        pool.commit(seq_id, prompt)
    pool.close(1)
    assert pool.stats().cached == 1
    assert pool.drop_cached() == 1
    assert pool.stats().cached == 0 and pool.stats().used == 2
    assert pool.open(3, [100, 1, 2, 3, 9]) == 0  # sequence 1's prefix is gone
    assert pool.open(4, [200, 1, 2, 3, 9]) == 4  # sequence 2's is still in use and shared
    check_invariants(pool)


def test_a_router_computes_from_the_prompt_the_hashes_the_pool_announced():
    pool = make_pool(16)
    announced: list[int] = []
    pool.on_change = lambda stored, removed: announced.extend(stored)
    document = list(range(10, 23))  # 13 tokens: 3 full blocks
    pool.open(1, document)
    pool.reserve(1, len(document))
    pool.commit(1, document)
    question = document + [7, 8]  # shares the document's 3 blocks
    hashes = prompt_block_hashes(question, BLOCK)
    assert hashes == announced
    assert pool.open(2, question) == len(hashes) * BLOCK
    assert prompt_block_hashes(document[:12], BLOCK) == announced[:2]  # the last token's block is never reused
