"""Client SDK: generate against a remote verifier over gRPC, drafting on this device.

    client = EdgeClient("127.0.0.1:50051", drafter="retrieval")
    result = client.generate("Summarize: ...", max_new_tokens=128, chat=True)
    for piece in client.stream("Tell me a story", max_new_tokens=64): print(piece, end="")

The client needs neither torch nor the model: the tokenizer comes from the verifier (GetTokenizer) and is
kept on disk under its fingerprint. A broken stream or a "come back later" is resumed (edge/resume.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from specedge.common.params import SamplingParams
from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.controller import TreeSizeController
from specedge.edge.corpus import open_corpus
from specedge.edge.datastore import Datastore
from specedge.edge.drafter import Drafter, hints_wanted
from specedge.edge.generation import GenerationResult, generate
from specedge.edge.registry import make_drafter
from specedge.edge.resume import ResumableSession
from specedge.edge.streaming import astream_events, stream_events
from specedge.edge.text_stream import cut_at_stops
from specedge.edge.tokenizer import EdgeTokenizer, stop_at_strings
from specedge.edge.tokenizer_cache import verifier_tokenizer
from specedge.edge.transport import ChannelConfig, RemoteVerifier

__all__ = ["AsyncEdgeClient", "ChannelConfig", "ClientResult", "EdgeClient"]


@dataclass
class ClientResult:
    text: str
    token_ids: list[int]
    stats: GenerationResult
    resumes: int = 0


class EdgeClient:
    """A client of one verifier (or several, tried in turn): drafts on this device, verifies remotely.

    `tokenizer`: the verifier's tokenizer if this device has it (an EdgeTokenizer or a transformers
    tokenizer); by default it is fetched from the verifier once and cached. `corpus`: a long-term datastore
    for the drafter: a Datastore, or paths of files or of a built datastore. `max_tree`: the most draft
    nodes a round sends; the verifier's own limit (read at connect) lowers it. `hints`: let the drafter draft
    from the verifier's own top tokens at every verified position, when both offer it (a few hundred bytes
    a round). `overlap`: send the next tree ahead of the verdict in flight where that pays
    (edge/controller.py, `ahead`). `fill`: let the verifier add its own draft to what is left of a tree ahead
    once the verdict before it is known (cloud/verifier_drafter.py). Thread-safe: concurrent generate and
    stream calls share the connection."""

    def __init__(self, targets: str | list[str], drafter: str = "retrieval", tokenizer=None,
                 corpus: Datastore | list[str | Path] | None = None, channel: ChannelConfig | None = None,
                 client_id: str | None = None, max_tree: int = MAX_TREE_NODES, hints: bool = True,
                 overlap: bool = True, fill: bool = True) -> None:
        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.channel = channel or ChannelConfig()
        self.client_id = client_id or f"edge-{uuid.uuid4().hex[:8]}"
        self.hints, self.overlap, self.fill = hints, overlap, fill
        self._next_target = itertools.cycle(self.targets)
        self.verifier = self._connect()
        info = self.verifier.info
        self.tokenizer = self._tokenizer(tokenizer, info.tokenizer_fingerprint)
        self.eos_ids = list(info.eos_token_ids)
        if corpus is not None and not isinstance(corpus, Datastore):
            corpus = open_corpus([Path(p) for p in corpus], self.tokenizer)
        self.corpus = corpus
        self.max_tree = min(max_tree, info.limits.max_tree_tokens)
        self._new_drafter = lambda: make_drafter(drafter, corpus, max_nodes=self.max_tree, tokenizer=self.tokenizer,
                                                 eos_ids=self.eos_ids)
        # Drafters and controllers learn across generations but hold one generation's state at a time:
        # concurrent generate calls each take an idle pair, or a new one. (An unknown drafter fails here.)
        self._idle: list[tuple[Drafter | None, TreeSizeController]] = [self._new_pair()]
        self._idle_lock = threading.Lock()

    def _new_pair(self) -> tuple[Drafter | None, TreeSizeController]:
        return self._new_drafter(), TreeSizeController(self.max_tree, overlap=self.overlap, fill=self.fill)

    def _hints_top_k(self, drafter: Drafter | None) -> int:
        """Hint tokens per position to ask for: what the drafter uses, within what the verifier offers."""
        return min(hints_wanted(drafter), self.verifier.info.limits.max_hints_top_k) if self.hints else 0

    def _connect(self) -> RemoteVerifier:
        last = None
        for _ in self.targets:
            try:
                return RemoteVerifier(next(self._next_target), self.channel)
            except grpc.RpcError as e:
                last = e
        raise last

    def _tokenizer(self, given, fingerprint: str) -> EdgeTokenizer:
        if given is None:
            return verifier_tokenizer(self.verifier)
        tokenizer = given if isinstance(given, EdgeTokenizer) else EdgeTokenizer.from_transformers(given)
        if tokenizer.fingerprint != fingerprint:
            raise ValueError(f"this tokenizer ({tokenizer.fingerprint}) is not the verifier's ({fingerprint}, "
                             f"model {self.verifier.info.model}): token ids would not match")
        return tokenizer

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: tuple[str, ...] = (),
                 chat: bool = False, on_tokens: Callable[[list[int]], None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None) -> ClientResult:
        """`on_tokens` sees each round's new tokens; `on_prefill(computed, total)` the verifier's progress
        through a prompt too long to prefill in one engine step (edge/transport.py)."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_new_tokens=max_new_tokens, stop=tuple(stop))
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode_prompt(prompt, chat=chat)
        first = [True]

        def connect() -> RemoteVerifier:
            if first[0]:
                first[0] = False
                return self.verifier
            self.verifier = self._connect()
            return self.verifier

        stop_check = stop_at_strings(self.tokenizer, params.stop) if params.stop else None
        with self._idle_lock:
            drafter, controller = self._idle.pop() if self._idle else self._new_pair()
        try:
            session = ResumableSession(connect, ids, params, self.client_id, self.tokenizer.fingerprint,
                                       hints_top_k=self._hints_top_k(drafter), on_prefill=on_prefill)
            result = generate(session, self.eos_ids, drafter, controller, stop_check, on_tokens)
        finally:
            with self._idle_lock:
                self._idle.append((drafter, controller))
        text = cut_at_stops(self.tokenizer.decode(result.token_ids), params.stop)
        return ClientResult(text, result.token_ids, result, session.resumes)

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Text as it is accepted, in pieces that join into `generate`'s text (an incomplete character or
        the start of a stop string is held back until it is settled). Closing the iterator early ends
        the generation at its next round."""
        for item in stream_events(self, prompt, **kwargs):
            if isinstance(item, str):
                yield item

    def close(self) -> None:
        self.verifier.close()


class AsyncEdgeClient:
    """The asyncio twin of EdgeClient. Generation runs the same loop in a worker thread (drafting is CPU
    work either way), so the event loop stays free while it runs."""

    def __init__(self, *args, **kwargs) -> None:
        self._client = EdgeClient(*args, **kwargs)
        self.tokenizer = self._client.tokenizer

    async def generate(self, prompt: str | list[int], **kwargs) -> ClientResult:
        return await asyncio.to_thread(self._client.generate, prompt, **kwargs)

    async def stream(self, prompt: str | list[int], **kwargs) -> AsyncIterator[str]:
        async for item in astream_events(self._client, prompt, **kwargs):
            if isinstance(item, str):
                yield item

    async def close(self) -> None:
        self._client.close()
