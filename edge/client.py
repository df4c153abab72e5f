"""Client SDK: generate against a remote verifier over gRPC, drafting on the edge.

    client = EdgeClient("127.0.0.1:50051", drafter="retrieval")
    result = client.generate("Summarize: ...", max_new_tokens=128, chat=True)
    for piece in client.stream("Tell me a story", max_new_tokens=64): print(piece, end="")

If a session's stream breaks (verifier restart, network reset), the client reconnects, to the next target
if several were given, and replays the committed tokens as the new prompt: the caller sees one
uninterrupted result. Greedy output is identical to a run without the break; sampled output keeps
following the model's distribution.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from specedge.common import wire
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.sampling import SamplingParams
from specedge.common.session import StepResult
from specedge.common.text import encode_prompt, stop_at_strings, tokenizer_fingerprint
from specedge.edge.controller import TreeSizeController
from specedge.edge.corpus import open_corpus
from specedge.edge.datastore import Datastore
from specedge.edge.generation import GenerationResult, generate
from specedge.protos import verifier_pb2 as pb

SERVICE = "/specedge.v1.Verifier/"
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


@dataclass
class ChannelConfig:
    auth_token: str | None = None
    tls_ca: str | None = None  # PEM: the verifier's CA; set = use TLS
    tls_cert: str | None = None  # PEM: this client's certificate, for mutual TLS
    tls_key: str | None = None
    server_name: str | None = None  # TLS name to verify when it differs from the target's host
    rpc_timeout_s: float = 600.0

    def channel(self, target: str) -> grpc.Channel:
        options = [("grpc.max_receive_message_length", 16 << 20)]
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        if self.tls_ca is None:
            return grpc.insecure_channel(target, options=options)
        read = lambda path: open(path, "rb").read() if path else None  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(self.tls_ca), read(self.tls_key), read(self.tls_cert))
        return grpc.secure_channel(target, creds, options=options)

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.auth_token}")] if self.auth_token else []


class RemoteVerifier:
    """One connection to a verifier."""

    def __init__(self, target: str, config: ChannelConfig | None = None) -> None:
        self.target, self.config = target, config or ChannelConfig()
        self.channel = self.config.channel(target)
        self._get_info = self.channel.unary_unary(SERVICE + "GetInfo", request_serializer=pb.GetInfoRequest.SerializeToString,
                                                  response_deserializer=pb.VerifierInfo.FromString)
        self._session = self.channel.stream_stream(SERVICE + "Session",
                                                   request_serializer=pb.SessionRequest.SerializeToString,
                                                   response_deserializer=pb.SessionResponse.FromString)
        self._generate = self.channel.unary_stream(SERVICE + "Generate",
                                                   request_serializer=pb.GenerateRequest.SerializeToString,
                                                   response_deserializer=pb.GenerateResponse.FromString)
        self.info = self._get_info(pb.GetInfoRequest(), metadata=self.config.metadata(), timeout=30)

    def open(self, prompt_ids: list[int], params: SamplingParams, client_id: str = "",
             fingerprint: str = "") -> RemoteSession:
        return RemoteSession(self, prompt_ids, params, client_id, fingerprint)

    def server_generate(self, prompt_ids: list[int], params: SamplingParams, client_id: str = "") -> Iterator[list[int]]:
        """Plain decoding on the verifier (the `Generate` RPC): token lists as they come."""
        req = pb.GenerateRequest(client_id=client_id, prompt_ids=prompt_ids, params=wire.params_to_pb(params))
        for resp in self._generate(req, metadata=self.config.metadata(), timeout=self.config.rpc_timeout_s):
            yield list(resp.tokens)

    def close(self) -> None:
        self.channel.close()


class RemoteSession:
    """A Session stream; implements the VerifierSession interface. The prefill goes with the first draft."""

    def __init__(self, verifier: RemoteVerifier, prompt_ids: list[int], params: SamplingParams, client_id: str,
                 fingerprint: str) -> None:
        self.verifier = verifier
        self.vocab_size = verifier.info.vocab_size
        self.prompt_ids, self.params = list(prompt_ids), params
        self.client_id, self.fingerprint = client_id, fingerprint
        self.cached_prompt_tokens = 0
        self._requests: queue.Queue = queue.Queue()
        self._responses = None
        self._cost = wire.cost_from_pb(verifier.info.cost)

    def step(self, tree: DraftTree) -> StepResult:
        start = time.perf_counter()
        if self._responses is None:
            self._requests.put(pb.SessionRequest(open=pb.OpenSession(
                client_id=self.client_id, prompt_ids=self.prompt_ids, params=wire.params_to_pb(self.params),
                tokenizer_fingerprint=self.fingerprint, draft=wire.tree_to_pb(tree))))
            self._responses = self.verifier._session(iter(self._requests.get, None),
                                                     metadata=self.verifier.config.metadata(),
                                                     timeout=self.verifier.config.rpc_timeout_s)
            opened = next(self._responses).opened
            self.cached_prompt_tokens = opened.cached_prompt_tokens
            verdict = opened.verdict
        else:
            self._requests.put(pb.SessionRequest(draft=wire.tree_to_pb(tree)))
            verdict = next(self._responses).verdict
        wall_ms = (time.perf_counter() - start) * 1e3
        self._cost = wire.cost_from_pb(verdict.cost)
        return StepResult(tokens=list(verdict.tokens), accepted=list(verdict.accepted), compute_ms=verdict.compute_ms,
                          queue_ms=verdict.queue_ms, rtt_ms=max(0.0, wall_ms - verdict.compute_ms - verdict.queue_ms),
                          extra={"next_max_tree_tokens": verdict.next_max_tree_tokens})

    def cost_model(self) -> CostModel:
        return self._cost

    def close(self) -> None:
        if self._responses is not None:
            self._requests.put(pb.SessionRequest(close=pb.CloseSession()))
            self._requests.put(None)
            try:
                for _ in self._responses:  # let the server finish the stream
                    pass
            except grpc.RpcError:
                pass
            self._responses = None


class ResumableSession:
    """A session that survives broken streams: it reopens, on the next verifier if need be, with the
    prompt plus everything committed so far, and retries the same draft (it hangs off the same token).
    A verifier that refuses it for now (its KV pool is full of other sessions) is asked again when it
    says, for up to `busy_wait_s`."""

    def __init__(self, connect, prompt_ids: list[int], params: SamplingParams, client_id: str, fingerprint: str,
                 retries: int = 5, backoff_s: float = 0.2, busy_wait_s: float = 300.0) -> None:
        self.connect, self.client_id, self.fingerprint = connect, client_id, fingerprint
        self.prompt_ids, self.params = list(prompt_ids), params
        self.retries, self.backoff_s, self.busy_wait_s = retries, backoff_s, busy_wait_s
        self.committed: list[int] = []
        self.resumes = 0
        self.session = connect().open(self.prompt_ids, params, client_id, fingerprint)
        self.vocab_size = self.session.vocab_size

    def step(self, tree: DraftTree) -> StepResult:
        attempt, busy_since = 0, None
        while True:
            try:
                result = self.session.step(tree)
                self.committed += result.tokens
                return result
            except grpc.RpcError as e:
                retry_after = _retry_after_s(e)
                if retry_after is not None:
                    busy_since = busy_since or time.monotonic()
                    if time.monotonic() - busy_since + retry_after > self.busy_wait_s:
                        raise
                    time.sleep(retry_after)
                elif e.code() not in RETRYABLE or attempt >= self.retries:
                    raise
                else:
                    time.sleep(self.backoff_s * 2**attempt)
                    attempt += 1
                self.resumes += 1
                remaining = max(1, self.params.max_new_tokens - len(self.committed))
                params = SamplingParams(**{**self.params.__dict__, "max_new_tokens": remaining})
                try:
                    self.session = self.connect().open(self.prompt_ids + self.committed, params, self.client_id,
                                                       self.fingerprint)
                except grpc.RpcError:
                    continue  # that verifier is down too: the next attempt tries the next one

    def cost_model(self) -> CostModel:
        return self.session.cost_model()

    def close(self) -> None:
        self.session.close()


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """Seconds after which a RESOURCE_EXHAUSTED refusal may be retried; None if it may not."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == wire.RETRY_AFTER_MS:
            return float(value) / 1e3
    return None


@dataclass
class ClientResult:
    text: str
    token_ids: list[int]
    stats: GenerationResult
    resumes: int = 0
    extra: dict = field(default_factory=dict)


class EdgeClient:
    """A client of one verifier (or several, tried in turn): drafts on this device, verifies remotely.
    `corpus` is a long-term datastore for the drafter: a Datastore, or paths of files or a built datastore.
    Thread-safe: concurrent generate and stream calls share the connection."""

    def __init__(self, targets: str | list[str], drafter: str = "retrieval", tokenizer=None,
                 corpus: Datastore | list[str | Path] | None = None, channel: ChannelConfig | None = None,
                 client_id: str | None = None, max_tree: int = 64) -> None:
        from specedge.edge.registry import make_drafter

        self.targets = [targets] if isinstance(targets, str) else list(targets)
        self.channel = channel or ChannelConfig()
        self.client_id = client_id or f"edge-{uuid.uuid4().hex[:8]}"
        self._next_target = itertools.cycle(self.targets)
        self.verifier = self._connect()
        info = self.verifier.info
        if tokenizer is None:
            from transformers import AutoTokenizer

            from specedge.common.model_registry import resolve_model_dir

            tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(info.model))
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        if self.fingerprint != info.tokenizer_fingerprint:
            raise ValueError(f"this tokenizer ({self.fingerprint}) is not the verifier's "
                             f"({info.tokenizer_fingerprint}, model {info.model}): token ids would not match")
        self.eos_ids = list(info.eos_token_ids)
        if corpus is not None and not isinstance(corpus, Datastore):
            corpus = open_corpus([Path(p) for p in corpus], tokenizer)
        self.corpus, self.max_tree = corpus, max_tree
        self._new_drafter = lambda: make_drafter(drafter, corpus, max_nodes=max_tree)
        # Drafters and controllers learn across generations but hold one generation's state at a time:
        # concurrent generate calls each take an idle pair, or a new one. (An unknown drafter fails here.)
        self._idle: list[tuple] = [(self._new_drafter(), TreeSizeController(max_tree))]
        self._idle_lock = threading.Lock()

    def _connect(self) -> RemoteVerifier:
        last = None
        for _ in self.targets:
            try:
                return RemoteVerifier(next(self._next_target), self.channel)
            except grpc.RpcError as e:
                last = e
        raise last

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: tuple[str, ...] = (),
                 chat: bool = False, on_tokens=None) -> ClientResult:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                max_new_tokens=max_new_tokens, stop=tuple(stop))
        ids = prompt if isinstance(prompt, list) else encode_prompt(self.tokenizer, prompt, chat=chat)
        first = [True]

        def connect() -> RemoteVerifier:
            if first[0]:
                first[0] = False
                return self.verifier
            self.verifier = self._connect()
            return self.verifier

        session = ResumableSession(connect, ids, params, self.client_id, self.fingerprint)
        stop_check = stop_at_strings(self.tokenizer, params.stop) if params.stop else None
        with self._idle_lock:
            drafter, controller = self._idle.pop() if self._idle else (self._new_drafter(),
                                                                       TreeSizeController(self.max_tree))
        try:
            result = generate(session, self.eos_ids, drafter, controller, stop_check, on_tokens)
        finally:
            with self._idle_lock:
                self._idle.append((drafter, controller))
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        for s in params.stop:
            text = text.split(s)[0]
        return ClientResult(text, result.token_ids, result, session.resumes)

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Text as it is accepted (pieces), from a generation running in a worker thread."""
        pieces: queue.Queue = queue.Queue()
        done = object()
        tokens: list[int] = []
        sent = [0]

        def on_tokens(new: list[int]) -> None:
            tokens.extend(t for t in new if t not in self.eos_ids)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete character: wait for its next bytes
                return
            pieces.put(text[sent[0] :])
            sent[0] = len(text)

        def run() -> None:
            try:
                self.generate(prompt, on_tokens=on_tokens, **kwargs)
                pieces.put(done)
            except BaseException as e:  # re-raised in the caller's thread
                pieces.put(e)

        threading.Thread(target=run, daemon=True).start()
        while (item := pieces.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            if item:
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
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        done = object()

        def run() -> None:
            try:
                for piece in self._client.stream(prompt, **kwargs):
                    loop.call_soon_threadsafe(pieces.put_nowait, piece)
                loop.call_soon_threadsafe(pieces.put_nowait, done)
            except BaseException as e:
                loop.call_soon_threadsafe(pieces.put_nowait, e)

        threading.Thread(target=run, daemon=True).start()
        while (item := await pieces.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        self._client.close()
