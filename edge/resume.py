"""A session that survives broken streams and "come back later" refusals, so that the caller of a
generation sees one uninterrupted result (and ResumableGenerate: the same for plain decoding on the
verifier, the `Generate` RPC).

When a stream breaks (verifier restart, network reset) the session reopens, on the next verifier if
several were given, with the prompt plus everything committed so far, and sends the drafts still in
flight again (less what has been committed since each was drafted). Greedy output is identical to a run
without the break; sampled output keeps following the model's distribution. A verifier that refuses it
for now (its KV pool is full of other sessions: RESOURCE_EXHAUSTED with `specedge-retry-after-ms`) is asked
again when it says, for up to `busy_wait_s`. A draining verifier (UNAVAILABLE with `specedge-migrate`) ends
the stream at a round boundary on purpose: the session moves at once, without back-off.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc

from specedge.common import wire
from specedge.common.cost_model import CostModel
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.transport import RemoteSession, RemoteVerifier

MAX_BACKOFF_S = 2.0  # with 10 retries from 0.2 s: ~15 s to ride out a restarting router or verifier
MAX_MOVES_WITHOUT_BACKOFF = 3  # in a row; then (every verifier draining?) moves back off like other retries
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class ResumableSession:
    def __init__(self, connect: Callable[[], RemoteVerifier], prompt_ids: list[int], params: SamplingParams,
                 client_id: str, fingerprint: str, retries: int = 10, backoff_s: float = 0.2,
                 busy_wait_s: float = 300.0, hints_top_k: int = 0,
                 on_prefill: Callable[[int, int], None] | None = None) -> None:
        """`connect()` returns a verifier to (re)open the session on: the same or the next one. `on_prefill`:
        see RemoteSession."""
        self.connect, self.client_id, self.fingerprint = connect, client_id, fingerprint
        self.hints_top_k, self.on_prefill = hints_top_k, on_prefill
        self.prompt_ids, self.params = list(prompt_ids), params
        self.retries, self.backoff_s, self.busy_wait_s = retries, backoff_s, busy_wait_s
        self.committed: list[int] = []
        self.resumes = 0  # streams that broke (or were moved) and were reopened
        self.session: RemoteSession | None = None
        self._cost: CostModel | None = None
        # Trees sent and not yet answered, with the sequence length at each one's root: after a break they
        # go to the new stream again, less what the verdicts that did arrive committed.
        self._in_flight: deque[tuple[DraftTree, int, int]] = deque()  # (tree, root length, fill_tokens)
        self._with_retries(lambda: None)  # connects: the prefill goes with the first draft
        self.vocab_size = self.session.vocab_size
        self.max_tree_tokens = self.session.max_tree_tokens

    def step(self, tree: DraftTree) -> StepResult:
        """The verdict on `tree`, across breaks and refusals."""
        self.send(tree)
        return self.receive()

    def send(self, tree: DraftTree, root_length: int | None = None, fill_tokens: int = 0) -> None:
        """Send without waiting (see RemoteSession.send); a broken stream shows at `receive`."""
        self._in_flight.append((tree, root_length or len(self.prompt_ids) + len(self.committed), fill_tokens))
        self.session.send(tree, root_length, fill_tokens)

    def receive(self) -> StepResult:
        """The verdict on the oldest tree in flight, across breaks and refusals."""
        return self._with_retries(self._receive)

    def _receive(self) -> StepResult:
        result = self.session.receive()
        self._in_flight.popleft()
        self.committed += result.tokens
        return result

    def _with_retries(self, action):
        retry = Retry(self.retries, self.backoff_s, self.busy_wait_s)
        while True:
            try:
                if self.session is None:
                    self.session = self._open()
                    self._send_again()
                return action()
            except grpc.RpcError as e:
                if self.session is not None:  # its stream broke: reopen (and count it) below
                    self._cost = self.session.cost_model()
                    self.session.close()
                    self.session = None
                    self.resumes += 1
                retry.wait_or_raise(e)

    def _send_again(self) -> None:
        """The trees in flight on a new stream, each less what has been committed since it was drafted: the
        oldest now hangs off the end, the others go ahead of its verdict as they did before."""
        end = len(self.prompt_ids) + len(self.committed)
        for i, (tree, root, fill_tokens) in enumerate(self._in_flight):
            rest = tree.after(self.committed[root - len(self.prompt_ids) :])
            self.session.send(rest, root_length=None if i == 0 else end, fill_tokens=fill_tokens)

    def _open(self) -> RemoteSession:
        """A new stream for the rest of the generation: the prompt plus everything committed so far."""
        params = replace(self.params, max_new_tokens=max(1, self.params.max_new_tokens - len(self.committed)))
        session = self.connect().open(self.prompt_ids + self.committed, params, self.client_id, self.fingerprint,
                                      self.hints_top_k, self.on_prefill)
        self.max_tree_tokens = session.max_tree_tokens
        return session

    def cost_model(self) -> CostModel:
        return self.session.cost_model() if self.session is not None else self._cost

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


class ResumableGenerate:
    """Plain decoding on the verifier (the `Generate` RPC) across breaks, refusals and drains, as
    ResumableSession is for sessions: iterate it for the token lists as they come. A stream that ends early
    is asked for again, from `connect()`, with the prompt plus every token it gave, for the tokens left;
    sampling draws by (seed, position) (cloud/sampling.py), so a seeded or greedy output is the same as
    without the break."""

    def __init__(self, connect: Callable[[], RemoteVerifier], prompt_ids: list[int], params: SamplingParams,
                 client_id: str = "", retries: int = 10, backoff_s: float = 0.2, busy_wait_s: float = 300.0) -> None:
        self.connect, self.prompt_ids, self.params, self.client_id = connect, list(prompt_ids), params, client_id
        self.retries, self.backoff_s, self.busy_wait_s = retries, backoff_s, busy_wait_s
        self.produced: list[int] = []
        self.resumes = 0  # calls that failed (broke, were moved or refused) and were made again

    def __iter__(self) -> Iterator[list[int]]:
        retry = Retry(self.retries, self.backoff_s, self.busy_wait_s)
        while True:
            rest = replace(self.params, max_new_tokens=self.params.max_new_tokens - len(self.produced))
            try:
                for tokens, done in self.connect().generate_pieces(self.prompt_ids + self.produced, rest,
                                                                   self.client_id):
                    self.produced += tokens
                    retry = Retry(self.retries, self.backoff_s, self.busy_wait_s)  # it got somewhere
                    yield tokens
                    if done:
                        return
                return
            except grpc.RpcError as e:
                retry.wait_or_raise(e)
                self.resumes += 1


class Retry:
    """One action's retries after failures: at once where a draining verifier said to move (a few times in a
    row), when it says where a busy one refused for now (for up to `busy_wait_s` in all), else after an
    exponential back-off while the failure may pass (`retries` times)."""

    def __init__(self, retries: int, backoff_s: float, busy_wait_s: float) -> None:
        self.retries, self.backoff_s, self.busy_wait_s = retries, backoff_s, busy_wait_s
        self.attempt, self.moves, self.busy_since = 0, 0, None

    def wait_or_raise(self, error: grpc.RpcError) -> None:
        """Return when the action may be tried again; raise `error` when it may not."""
        retry_after = _retry_after_s(error)
        if _told_to_move(error) and self.moves < MAX_MOVES_WITHOUT_BACKOFF:
            self.moves += 1
        elif retry_after is not None:
            self.busy_since = self.busy_since or time.monotonic()
            if time.monotonic() - self.busy_since + retry_after > self.busy_wait_s:
                raise error
            time.sleep(retry_after)
        elif error.code() not in RETRYABLE or self.attempt >= self.retries:
            raise error
        else:
            time.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2**self.attempt))
            self.attempt += 1


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """Seconds after which a RESOURCE_EXHAUSTED refusal may be retried; None if it may not."""
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in error.trailing_metadata() or ():
        if key == wire.RETRY_AFTER_MS:
            return float(value) / 1e3
    return None


def _told_to_move(error: grpc.RpcError) -> bool:
    """Whether a draining verifier asked for the session to be reopened elsewhere."""
    return error.code() == grpc.StatusCode.UNAVAILABLE and any(
        key == wire.MIGRATE for key, _ in error.trailing_metadata() or ())
