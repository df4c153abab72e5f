"""CacheWatchers: the KV pool's stored and evicted prompt-block hashes, fanned out to the routers that
watch this verifier (the WatchCache RPC), so that their index of what it holds is exact, not guessed."""

from __future__ import annotations

import asyncio
import threading

from specedge.cloud.kv_pool import KVBlockPool


class CacheWatchers:
    def __init__(self, pool: KVBlockPool) -> None:
        """Hooks into `pool`; create it before the scheduler thread starts changing the pool."""
        self._lock = threading.Lock()
        self._held: set[int] = set(pool.hash_to_block)
        self._queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._closed = False
        pool.on_change = self._on_change

    def subscribe(self) -> tuple[list[int], asyncio.Queue]:
        """Every hash held now, and a queue (of this event loop) of the (stored, removed) changes after it,
        ended by a None once the watchers are closed."""
        updates: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closed:
                updates.put_nowait(None)
            self._queues.append((asyncio.get_running_loop(), updates))
            return list(self._held), updates

    def close(self) -> None:
        """End every watch, and any opened later: the verifier is stopping. (A server's stop waits for its
        open calls, and a router's watch would otherwise last out the whole grace period.)"""
        with self._lock:
            self._closed = True
            for loop, updates in self._queues:
                loop.call_soon_threadsafe(updates.put_nowait, None)

    def unsubscribe(self, updates: asyncio.Queue) -> None:
        with self._lock:
            self._queues = [(loop, q) for loop, q in self._queues if q is not updates]

    def _on_change(self, stored: list[int], removed: list[int]) -> None:  # on the scheduler thread
        with self._lock:
            self._held.update(stored)
            self._held.difference_update(removed)
            for loop, updates in self._queues:
                loop.call_soon_threadsafe(updates.put_nowait, (stored, removed))


def net_changes(changes: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """Changes applied in order, as one (stored, removed) pair: what is held after them, against before."""
    held: dict[int, bool] = {}
    for stored, removed in changes:
        held.update(dict.fromkeys(stored, True))
        held.update(dict.fromkeys(removed, False))
    return [h for h, now in held.items() if now], [h for h, now in held.items() if not now]
