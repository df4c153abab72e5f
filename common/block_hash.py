"""The identity of a cached prompt block: a hash chained over every token from the start of the sequence.

The verifier's KV pool keys its prefix cache by it, and routers compute the same chain over a prompt to
find which verifier already holds its prefix; so it must be stable across processes and machines (Python's
`hash` of a tuple is not promised to be), and it fits a 64-bit protobuf field.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def chain_hash(previous: int | None, block: Sequence[int]) -> int:
    """The hash of a block of token ids that follows the block hashed `previous` (None: the first block)."""
    data = struct.pack(f"<Q{len(block)}I", 0 if previous is None else previous, *block)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of a prompt that a verifier can take from its prefix cache: the
    last token's block never (the verifier computes the last prompt token itself, for its logits)."""
    hashes: list[int] = []
    previous = None
    for i in range((len(token_ids) - 1) // block_size):
        previous = chain_hash(previous, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(previous)
    return hashes
