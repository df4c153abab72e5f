"""The edge's side of the wire (protos/specedge/v1/verifier.proto): a channel to one verifier, its
information and tokenizer, and a Session stream behind the VerifierSession interface."""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from specedge.common import tls, wire
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tokenizer_bundle import TokenizerBundle
from specedge.protos import verifier_pb2 as pb

SERVICE = "/specedge.v1.Verifier/"


@dataclass
class ChannelConfig:
    auth_token: str | None = None
    tls_ca: str | None = None  # PEM: the verifier's CA; set = use TLS
    tls_cert: str | None = None  # PEM: this client's certificate, for mutual TLS
    tls_key: str | None = None
    server_name: str | None = None  # TLS name to verify when it differs from the target's host
    rpc_timeout_s: float = 600.0

    def channel(self, target: str) -> grpc.Channel:
        return tls.channel(target, self.tls_ca, self.tls_cert, self.tls_key, self.server_name)

    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.auth_token}")] if self.auth_token else []


class RemoteVerifier:
    """One connection to a verifier; `info` (model, tokenizer fingerprint, limits, cost) is read at connect."""

    def __init__(self, target: str, config: ChannelConfig | None = None) -> None:
        self.target, self.config = target, config or ChannelConfig()
        self.channel = self.config.channel(target)
        self._session = self._rpc("stream_stream", "Session", pb.SessionRequest, pb.SessionResponse)
        self._generate = self._rpc("unary_stream", "Generate", pb.GenerateRequest, pb.GenerateResponse)
        self._tokenizer = self._rpc("unary_stream", "GetTokenizer", pb.GetTokenizerRequest, pb.TokenizerPart)
        get_info = self._rpc("unary_unary", "GetInfo", pb.GetInfoRequest, pb.VerifierInfo)
        self.info: pb.VerifierInfo = get_info(pb.GetInfoRequest(), metadata=self.config.metadata(), timeout=30)

    def _rpc(self, kind: str, name: str, request, response):
        return getattr(self.channel, kind)(SERVICE + name, request_serializer=request.SerializeToString,
                                           response_deserializer=response.FromString)

    def open(self, prompt_ids: list[int], params: SamplingParams, client_id: str = "",
             fingerprint: str = "", hints_top_k: int = 0,
             on_prefill: Callable[[int, int], None] | None = None) -> RemoteSession:
        """`hints_top_k` > 0: ask for hints with every verdict (served at most at the verifier's cap)."""
        return RemoteSession(self, prompt_ids, params, client_id, fingerprint, hints_top_k, on_prefill)

    def tokenizer(self, fingerprint: str) -> TokenizerBundle:
        """The verifier's tokenizer, which must be the one of `fingerprint` (else NOT_FOUND)."""
        parts = self._tokenizer(pb.GetTokenizerRequest(fingerprint=fingerprint), metadata=self.config.metadata(),
                                timeout=self.config.rpc_timeout_s)
        return wire.tokenizer_from_parts(parts)

    def server_generate(self, prompt_ids: list[int], params: SamplingParams, client_id: str = ""
                        ) -> Iterator[list[int]]:
        """Plain decoding on the verifier (the `Generate` RPC): token lists as they come. (A stream that
        breaks or is moved by a drain raises grpc.RpcError; edge/resume.py's ResumableGenerate goes on.)"""
        for tokens, _ in self.generate_pieces(prompt_ids, params, client_id):
            yield tokens

    def generate_pieces(self, prompt_ids: list[int], params: SamplingParams, client_id: str = ""
                        ) -> Iterator[tuple[list[int], bool]]:
        """`server_generate`'s token lists, each with whether it is the last (`done`)."""
        req = pb.GenerateRequest(client_id=client_id, prompt_ids=prompt_ids, params=wire.params_to_pb(params))
        for resp in self._generate(req, metadata=self.config.metadata(), timeout=self.config.rpc_timeout_s):
            yield list(resp.tokens), resp.done

    def flush_cache(self) -> int:
        """Make the verifier forget the cached prompt prefixes no live session uses -> KV blocks forgotten."""
        flush = self._rpc("unary_unary", "FlushCache", pb.FlushCacheRequest, pb.FlushCacheReply)
        return flush(pb.FlushCacheRequest(), metadata=self.config.metadata(), timeout=self.config.rpc_timeout_s).blocks

    def close(self) -> None:
        self.channel.close()


REQUEST_POLL_S = 1.0  # how soon the sending thread of a call that ended without close notices it


class RemoteSession:
    """A Session stream; implements the VerifierSession interface. The prefill goes with the first draft.
    `on_prefill(computed, total)`: told, while the first verdict is awaited, how many prompt tokens the
    verifier holds so far, after each chunk of a prompt too long to prefill in one engine step."""

    def __init__(self, verifier: RemoteVerifier, prompt_ids: list[int], params: SamplingParams, client_id: str,
                 fingerprint: str, hints_top_k: int = 0, on_prefill: Callable[[int, int], None] | None = None
                 ) -> None:
        self.verifier = verifier
        self.vocab_size = verifier.info.vocab_size
        self.max_tree_tokens = verifier.info.limits.max_tree_tokens
        self.prompt_ids, self.params = list(prompt_ids), params
        self.client_id, self.fingerprint, self.hints_top_k = client_id, fingerprint, hints_top_k
        self.on_prefill = on_prefill
        self._requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self._responses = None
        self._cost = wire.cost_from_pb(verifier.info.cost)
        self._sent: deque[float] = deque()  # when each tree still awaiting its verdict went out

    def step(self, tree: DraftTree) -> StepResult:
        self.send(tree)
        return self.receive()

    def send(self, tree: DraftTree, root_length: int | None = None, fill_tokens: int = 0) -> None:
        """Send a tree without waiting for its verdict (the first one also opens the session). `root_length`:
        for a tree sent ahead of verdicts still to come, the sequence length (prompt + committed tokens) at
        its root; the verifier verifies what is left of it once those verdicts are committed, and where
        nothing is left, drafts up to `fill_tokens` itself (cloud/verifier_drafter.py)."""
        self._sent.append(time.perf_counter())
        if self._responses is None:
            self._requests.put(pb.SessionRequest(open=pb.OpenSession(
                client_id=self.client_id, prompt_ids=self.prompt_ids, params=wire.params_to_pb(self.params),
                tokenizer_fingerprint=self.fingerprint, draft=wire.tree_to_pb(tree), hints_top_k=self.hints_top_k,
                report_prefill_progress=self.on_prefill is not None, prompt_hints=self.hints_top_k > 0)))
            self._responses = self.verifier._session(self._outgoing(),
                                                     metadata=self.verifier.config.metadata(),
                                                     timeout=self.verifier.config.rpc_timeout_s)
        else:
            self._requests.put(pb.SessionRequest(draft=wire.tree_to_pb(tree, root_length, fill_tokens)))

    def _outgoing(self):
        """The requests, for gRPC's sending thread: until close, or until the call has ended some other way
        (a broken stream, a closed channel), so that the thread does not wait on the queue for ever."""
        while True:
            try:
                request = self._requests.get(timeout=REQUEST_POLL_S)
            except queue.Empty:
                if self._responses is not None and self._responses.done():
                    return
                continue
            if request is None:
                return
            yield request

    def receive(self) -> StepResult:
        """The verdict on the oldest tree sent and not yet answered."""
        response = next(self._responses)
        while response.WhichOneof("kind") == "prefill_progress":
            self.on_prefill(response.prefill_progress.computed, response.prefill_progress.total)
            response = next(self._responses)
        opened = response.opened if response.WhichOneof("kind") == "opened" else None
        verdict = opened.verdict if opened is not None else response.verdict
        # (For a tree sent ahead this includes waiting on the verifier for the verdicts before it.)
        wall_ms = (time.perf_counter() - self._sent.popleft()) * 1e3
        if verdict.HasField("cost"):  # (an empty verdict, for a tree ahead of the generation's end, has none)
            self._cost = wire.cost_from_pb(verdict.cost)
        return StepResult(tokens=list(verdict.tokens), accepted=list(verdict.accepted), compute_ms=verdict.compute_ms,
                          queue_ms=verdict.queue_ms, rtt_ms=max(0.0, wall_ms - verdict.compute_ms - verdict.queue_ms),
                          next_max_tree_tokens=verdict.next_max_tree_tokens, hints=wire.hints_from_pb(verdict.hints),
                          verifier_drafted=verdict.verifier_drafted,
                          verified_nodes=verdict.verified_nodes if verdict.HasField("verified_nodes") else None,
                          prompt_hints=wire.hints_from_pb(opened.prompt_hints) if opened is not None else None,
                          prompt_hints_start=opened.prompt_hints_start if opened is not None else 0)

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
