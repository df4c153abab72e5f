"""Drafting with a small language model on this device (edge/draft_model.py), in the target's vocabulary
or across vocabularies (edge/vocab_bridge.py).

Greedy generations get the drafter's greedy chain, with its runner-up tokens as sibling leaves where it
is unsure (same vocabulary), or the chain's text in the target's tokenisations (SLEM, across
vocabularies). Sampled generations get drafts sampled from an exactly known proposal q, sent with the
tree, so the verifier's recursive rejection sampling is exact: q is the drafter's distribution at the
generation's temperature, cut to its most likely tokens (and, across vocabularies, to the tokens both
vocabularies share: TLI), renormalised; a node's children are drawn from it without replacement.

Every node carries an acceptance estimate (its path probability under calibrated conditional
probabilities, edge/calibration.py), so the controller sends only the nodes worth a pass.

The drafter reads a new prompt in a background thread (llama.cpp runs without the GIL) while the verifier
prefills it and the first rounds go out without model drafts: a long prompt's drafter prefill costs
seconds on one core, and waiting for it would put all of them before the first token. And while a tree is
being verified, `speculate` computes the logits the next round most likely needs (after the likeliest
verdicts and bonus tokens): when the verdict is one of them, the next round's first levels cost nothing.
Logits are kept by the exact token sequence they follow, so a reused one is the one a fresh forward would
give, and what is drafted from it, sampled drafts included, is unchanged. A draft may be made of such logits
alone (`known_only`: the hybrid's part of a tree, which must not wait on a forward).
"""

from __future__ import annotations

import atexit
import heapq
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as WaitTimeout
from dataclasses import dataclass

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.calibration import Calibration, reached_and_accepted
from specedge.edge.draft_model import DraftModel
from specedge.edge.vocab_bridge import CrossVocab, SameVocab, TargetDraft

MIN_PATH = 0.02  # never draft deeper than this estimated acceptance, however cheap drafting is
ROUND_MS_PRIOR = 60.0  # a round's time besides drafting, until one is measured
EMA = 0.3  # weight of the newest measurement in a timing's moving average
SIBLING_MIN = 0.1  # a runner-up (or further draw) becomes a sibling when its probability is at least this
PROPOSAL_TOKENS = 32  # q keeps at most this many tokens ...
PROPOSAL_MASS = 0.999  # ... and no more than it needs to reach this much of the drafter's probability
ALTERNATIVE_PENALTY = 0.5  # a second tokenisation of the same drafted text is the less likely one
CATCH_UP_BATCH = 4  # most tokens per forward while catching up in the verifier's time (stoppable between them)
SPECULATION_STEPS = 16  # most forwards while a tree is verified (a verdict stops it sooner)
SPECULATION_BRANCH = 2  # continuations of each speculated sequence worth computing next
POLL_S = 0.0005  # how often a speculated forward's wait looks whether the verdict is in


@dataclass
class _Node:
    token: int  # target id
    parent: int
    raw: float  # the drafter's conditional probability (the calibration's input)
    estimate: float  # calibrated path probability


class ModelDrafter:
    def __init__(self, model: DraftModel, bridge: SameVocab | CrossVocab, max_nodes: int = MAX_TREE_NODES,
                 max_depth: int = 12, branch: int = 3, seed: int | None = None,
                 prefill_in_background: bool = True) -> None:
        self.model, self.bridge = model, bridge
        self.prefill_in_background = prefill_in_background
        self.max_nodes, self.max_depth, self.branch = max_nodes, max_depth, branch
        self.calibration = Calibration()  # kept across generations: the edge keeps learning
        self.rng = np.random.default_rng(seed)
        self.params = SamplingParams()
        self._context: list[int] = []
        self._uncommitted: list[int] = []  # target ids observed but not yet given to the bridge (see context)
        self._logits: dict[tuple[int, ...], np.ndarray] = {}  # drafter ids -> the next-token logits after them
        self.round_ms: float | None = None  # a round besides drafting: pass, queue, network
        self.token_ms: float | None = None  # one drafter forward
        self.read_ms: float | None = None  # per committed token, read in CATCH_UP_BATCH forwards
        self._prefilled = False  # this generation's first round (the prompt's prefill) has been answered
        self._known_only = False  # propose()'s `known_only`
        self._reader: threading.Thread | None = None  # reads the prompt into the model's cache
        self._stop_reading = threading.Event()  # the current reader's own (a stopped one may still be ending)
        self._read_error: BaseException | None = None
        # Speculated forwards run in a thread of their own, so that the verdict need not wait for one under way
        # (median 11 ms, in 4 rounds of 10, measured in the hybrid): it ends alone, as the tail, and the next
        # use of the model waits for it first (the verifier's next pass is under way by then). It runs at the
        # lowest priority, as the prompt's reader does: on a one-core edge a tail would otherwise take half the
        # core from the next tree's drafting and sending, which the verifier waits for.
        self._worker: ThreadPoolExecutor | None = None
        self._tail: tuple[Future, tuple[int, ...] | None] | None = None  # (the forward, the sequence it reads)

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        # What was read of the last prompt stays cached. A reader still on it ends its batch while this
        # generation begins (waiting here cost ~150 ms a generation); the model is not used until it has.
        self._stop_reader(wait=False)
        self.params = params or SamplingParams()
        self._context, self._uncommitted = self.bridge.begin(prompt_ids), []
        self.calibration.generation.begin()
        self._logits.clear()
        self._prefilled = False
        if self.prefill_in_background and self.context:
            self._start_reader()

    def _start_reader(self) -> None:
        self.settle()
        previous = self._reader  # told to stop, it may still be ending its batch: the new one waits for it
        self._stop_reading = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(list(self.context), self._stop_reading, previous),
                                        name="drafter-prefill", daemon=True)  # exit mid-read: _stop_readers_at_exit
        self._reader.start()
        _READING.add(self)

    def _reading_backlog(self) -> bool:
        """Whether the model is reading committed text in the background: it starts to when more is unread
        than one verifier pass could read in catch-up forwards (a long verdict it did not speculate through),
        and reads it in the prompt's large batches, its rounds going out without model drafts meanwhile."""
        if not self.ready(timeout=0):
            return True
        if not self.prefill_in_background or not self.context:
            return False
        per_token = self.read_ms or self.token_ms  # unknown before the first draft: read at draft time
        if not per_token or self._unread() * per_token <= (self.round_ms or ROUND_MS_PRIOR):
            return False
        self._start_reader()
        return True

    @property
    def reading(self) -> bool:
        """Whether it reads committed text in the background (a prompt, a backlog): no draft comes meanwhile."""
        return self._reader is not None and self._reader.is_alive()

    def ready(self, timeout: float | None = None) -> bool:
        """Wait (up to `timeout` seconds) until the prompt (or a backlog) is read; True when it is."""
        if self._reader is not None:
            self._reader.join(timeout)
            if self._reader.is_alive():
                return False
            self._reader = None
        if self._read_error is not None:
            error, self._read_error = self._read_error, None
            raise error
        return True

    def _read(self, tokens: list[int], stop: threading.Event, previous: threading.Thread | None) -> None:
        _lowest_priority()  # on a one-core edge it must not slow down the rounds that go on meanwhile
        if previous is not None:
            previous.join()
        try:
            self.model.prefill(tokens, stop.is_set)
        except BaseException as e:  # raised in the generation's thread, by ready()
            if not stop.is_set():
                self._read_error = e

    def _stop_reader(self, wait: bool = True) -> None:
        """Stop reading (within one batch). `wait=False`: do not wait for the batch; `reading` stays true
        until it ends."""
        self._stop_reading.set()
        if wait and self._reader is not None:
            self._reader.join()
            self._reader = None
        self._read_error = None

    def propose(self, known_only: bool = False) -> DraftTree:
        """`known_only`: draft only from logits computed already (by `speculate`), running no forward now (the
        hybrid's part of a tree, edge/hybrid.py)."""
        self._known_only = known_only
        if known_only:  # nothing is read now either: a backlog read here would run beside the passes to come
            if not self.ready(timeout=0) or not self._may_be_known() or not self.context or not self._known([]):
                return DraftTree.empty()
        elif self._reading_backlog():
            return DraftTree.empty()  # still reading the prompt: this round goes without a model draft
        if not self.context or (self.bridge.cross and self.bridge.pending):
            return DraftTree.empty()
        if self.params.greedy:
            nodes, proposals = (self._slem() if self.bridge.cross else self._greedy()), None
        else:
            nodes, proposals = self._sampled()
        return self._best_first(nodes, proposals)

    def propose_after(self, path: list[int], known_only: bool = False) -> DraftTree:
        """A draft hanging off `path` (target ids) as if it were committed next: over a long round trip, the
        tree to send ahead of a verdict that most likely commits `path` (edge/generation.py). The model
        drafts as deep beyond it as from the committed end; what it read of `path` stays cached."""
        if not path:
            return self.propose(known_only)
        if known_only and not self._may_be_known(path):
            return DraftTree.empty()
        context = self.context
        if not context:
            return self.propose(known_only)
        self._context = self.bridge.preview(path)
        try:
            return self.propose(known_only)
        finally:
            self._context = context

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        if len(tree):
            reached, accepted = reached_and_accepted(tree.parents, result.accepted)
            raw = np.asarray(tree.notes, dtype=np.float64)  # each node's raw probability (_best_first)
            self.calibration.update(Calibration.buckets(raw[reached]), accepted[reached])
        self._uncommitted += result.tokens
        if self._prefilled:  # the first round's pass includes the prompt: not a typical round
            ms = result.compute_ms + result.queue_ms + result.rtt_ms
            self.round_ms = moving_average(self.round_ms, ms)
        self._prefilled = True

    @property
    def context(self) -> list[int]:
        """The drafter's ids for the committed text. observe() only notes the verdict's tokens: the bridge
        re-tokenises them (a cross-vocabulary one costs ~0.3 ms a round) when the context is next wanted, and
        then the tokens of every round since at once."""
        if self._uncommitted:
            self._context = self.bridge.commit(self._uncommitted)
            self._uncommitted = []
            known = tuple(self._context)
            self._logits = {k: v for k, v in self._logits.items() if k[: len(known)] == known}
        return self._context

    def end(self) -> None:
        self._stop_reader(wait=False)  # the rest of this prompt is of no use to the next
        self._logits.clear()

    def _unread(self, sequence: list[int] | None = None) -> int:
        """Tokens (drafter ids) of `sequence` (the committed ones by default) the model's cache lacks."""
        sequence = self.context if sequence is None else sequence
        if tuple(sequence) in self._logits:
            return 0
        held = 0
        for a, b in zip(self.model.tokens, sequence):
            if a != b:
                break
            held += 1
        return len(sequence) - held

    def speculate(self, stop: Callable[[], bool], steps: int = SPECULATION_STEPS, then: list[int] = ()) -> None:
        """While the verifier checks the last draft: compute the logits after the token sequences the
        committed text most likely begins with next, best first, until `stop()` (the verdict is in) or
        `steps` forwards (first it reads what was committed since the model last ran, in forwards of up to
        CATCH_UP_BATCH tokens, each sized to end by the verdict's expected time; more than a pass could read
        goes to the background reader). A sequence's likelihood is the product of its tokens' calibrated
        probabilities; each computed one offers its SPECULATION_BRANCH most likely continuations. The last
        draft's own nodes are among them, their logits known already: the verdict most often ends inside
        them, with a bonus token the drafter had as a runner-up there.
        `then`: target ids the verdict will most likely commit, which another drafter proposed (the hybrid's
        retrieval): they are read too, and the sequences begin after them (a verdict that takes only part
        of them still finds that part read: the model's cache keeps the longest common prefix)."""
        self.settle()
        if not self.context or self._reading_backlog():
            return
        base = self.bridge.preview(then) if then else self.context
        # A forward started just before the verdict delays the next round: start none that would end after
        # the verdict's expected time.
        deadline = time.perf_counter() + ((self.round_ms or ROUND_MS_PRIOR) - (self.token_ms or 0.0)) / 1e3
        # First, read what was committed since the model last ran (many rounds' tokens after a long prompt
        # read) and what the verdict will likely commit, in batches that end by the verdict's expected time:
        # a batch cannot be stopped, and one that outlasts the pass delays the next round.
        first = True
        while unread := self._unread(base):
            per_token = self.read_ms or self.token_ms
            room = (deadline - time.perf_counter()) * 1e3
            size = min(CATCH_UP_BATCH, unread, int(room / per_token) if per_token else CATCH_UP_BATCH)
            if size < 1 or (not first and stop()):
                return
            first = False
            start = time.perf_counter()
            if self._until(stop, None, self.model.prefill, base[: len(base) - unread + size]) is None:
                return
            if size > 1:  # a single token is a forward, not a batch's share
                self.read_ms = moving_average(self.read_ms, (time.perf_counter() - start) * 1e3 / size)
        frontier = [(-1.0, tuple(base))]
        forwards = 0
        while frontier and forwards < steps and not stop() and time.perf_counter() < deadline:
            neg_likelihood, sequence = heapq.heappop(frontier)
            forwards += sequence not in self._logits
            logits = self._next_logits(list(sequence), stop)
            if logits is None:
                return
            p = np.exp(logits - logits.max())
            p /= p.sum()
            for token in _most_likely(p, SPECULATION_BRANCH):
                likelihood = -neg_likelihood * self.calibration.prob(p[token])
                if likelihood >= MIN_PATH and not self.model.is_end(token):
                    heapq.heappush(frontier, (-likelihood, sequence + (token,)))

    # --- drafting -----------------------------------------------------------------------------------
    def _worth_deeper(self, path: float, expected: float, drafted: int, free: bool = False) -> bool:
        """Is one more drafted token worth its time? It adds about `path` expected tokens to a round that
        commits `expected` (the bonus included) in round_ms + drafted
        * token_ms; drafting it pays when path / token_ms beats the round's rate. `free`: its logits are
        known already (speculated)."""
        if path < MIN_PATH or (self._known_only and not free):
            return False
        token_ms = 0.0 if free else (self.token_ms or 0.0)
        round_ms = ROUND_MS_PRIOR if self.round_ms is None else self.round_ms
        return path * (round_ms + drafted * token_ms) > expected * token_ms

    def _next_logits(self, sequence: list[int], stop: Callable[[], bool] | None = None) -> np.ndarray | None:
        """The drafter's logits after `sequence` (drafter ids), computed once per sequence; None where `stop()`
        turned true during the forward (see `_until`)."""
        key = tuple(sequence)
        if (logits := self._logits.get(key)) is None:
            start = time.perf_counter()
            if stop is None:
                self.settle()
                logits = self.model.logits(sequence)
            elif (logits := self._until(stop, key, self.model.logits, sequence)) is None:
                return None
            logits = self._logits[key] = logits.astype(np.float64)
            if len(sequence) > len(self.context):  # a one-token forward (the first may feed the verdict's tokens)
                ms = (time.perf_counter() - start) * 1e3
                self.token_ms = moving_average(self.token_ms, ms)
        return logits

    def _until(self, stop: Callable[[], bool], key: tuple[int, ...] | None, call: Callable, *args):
        """`call(*args)`, a model call, in the worker thread, waited for until it returns (its result) or until
        `stop()` (None): then it goes on alone, as the tail, and what it returns, the logits after `key`, is
        kept when the next use of the model waits for it (`settle`)."""
        self.settle()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="drafter-forward", initializer=_lowest_priority)
        future = self._worker.submit(call, *args)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except WaitTimeout:
                if stop():
                    self._tail = future, key
                    return None

    def settle(self) -> None:
        """Wait for the forward left running at the last verdict, if any, and keep the logits it computed."""
        if self._tail is None:
            return
        (future, key), self._tail = self._tail, None
        result = future.result()
        if key is not None:
            self._logits.setdefault(key, result.astype(np.float64))

    def _may_be_known(self, path: list[int] = ()) -> bool:
        """Whether the logits after the committed text (and `path`, target ids) may be known, asked before the
        bridge re-tokenises what was committed: where the pass before was too short for the model to compute
        past the verdict (most rounds on a fast verifier), the answer is no, and re-tokenising to find that
        out had cost the round's critical path a quarter of a millisecond (BENCHMARKS.md section 6)."""
        if not self._uncommitted and not path:
            return True  # the context is up to date: `_known` asks
        return self.bridge.may_become([*self._uncommitted, *path], self._logits)

    def _known(self, chain: list[int]) -> bool:
        return tuple(self.context + chain) in self._logits

    def _probs(self, chain: list[int], restrict: np.ndarray | None = None) -> np.ndarray:
        logits = self._next_logits(self.context + chain)
        if restrict is not None:
            logits = np.where(restrict, logits, -np.inf)
        if not self.params.greedy:
            logits = logits / self.params.temperature
        p = np.exp(logits - logits.max())
        return p / p.sum()

    def _target(self, token: int) -> int:
        return token if not self.bridge.cross else int(self.bridge.targets[token])

    def _greedy(self) -> list[_Node]:
        """The drafter's greedy chain in the target's vocabulary, runner-ups as sibling leaves."""
        nodes: list[_Node] = []
        chain: list[int] = []
        parent, path = -1, 1.0
        while len(chain) < self.max_depth and len(nodes) < self.max_nodes:
            p = self._probs(chain)
            best = _most_likely(p, self.branch)
            first = len(nodes)
            for rank, token in enumerate(best):
                if rank and p[token] < SIBLING_MIN:
                    break
                cond = self.calibration.prob(p[token])
                nodes.append(_Node(token, parent, float(p[token]), path * cond))
            path = nodes[first].estimate
            if self.model.is_end(best[0]) or not self._worth_deeper(
                    path, 1 + sum(n.estimate for n in nodes), len(chain) + 1, self._known(chain + [best[0]])):
                break
            parent = first
            chain.append(best[0])
        return nodes

    def _slem(self) -> list[_Node]:
        """The drafter's greedy text in the target's tokenisations, verified by exact match."""
        chain: list[int] = []
        conds: list[float] = []
        end_id, path, expected = None, 1.0, 1.0
        while len(chain) < self.max_depth:
            p = self._probs(chain)
            token = int(np.argmax(p))
            if self.model.is_end(token):
                end_id = self.bridge.end_ids.get(token)
                break
            chain.append(token)
            conds.append(float(p[token]))
            path *= self.calibration.prob(p[token])
            expected += path
            if not self._worth_deeper(path, expected, len(chain), self._known(chain)):
                break
        drafter_ends = np.cumsum([len(self.bridge.drafter_bytes[t] or b"") for t in chain])
        drafted = b"".join(self.bridge.drafter_bytes[t] or b"" for t in chain)
        nodes: list[_Node] = []
        for variant, draft in enumerate(self.bridge.target_drafts(drafted)):
            self._add_target_draft(nodes, draft, drafter_ends, np.cumprod(conds), ALTERNATIVE_PENALTY ** variant,
                                   end_id)
        return nodes[: self.max_nodes]

    def _add_target_draft(self, nodes: list[_Node], draft: TargetDraft, drafter_ends: np.ndarray,
                          drafter_path: np.ndarray, penalty: float, end_id: int | None) -> None:
        """Insert one tokenisation into the node list, sharing the prefix it has with what is there."""
        parent, prev_raw, estimate = -1, 1.0, 1.0
        ids = list(draft.ids) + ([end_id] if end_id is not None else [])
        text_ends = list(draft.text_ends) + ([int(drafter_ends[-1]) if len(drafter_ends) else 0]
                                             if end_id is not None else [])
        for token, end in zip(ids, text_ends):
            # The drafter's path probability up to the drafter token that completes this target token.
            k = int(np.searchsorted(drafter_ends, end, side="left"))
            raw_path = float(drafter_path[min(k, len(drafter_path) - 1)]) if len(drafter_path) else 1.0
            existing = next((i for i, n in enumerate(nodes) if n.parent == parent and n.token == token), None)
            if existing is not None:
                parent, estimate = existing, nodes[existing].estimate
                prev_raw = raw_path
                continue
            raw = min(1.0, raw_path / prev_raw if prev_raw > 0 else 0.0) * penalty
            estimate *= self.calibration.prob(raw)
            nodes.append(_Node(token, parent, raw, estimate))
            parent, prev_raw, penalty = len(nodes) - 1, raw_path, 1.0

    def _sampled(self) -> tuple[list[_Node], dict[int, tuple[list[int], list[float]]]]:
        """A chain sampled from q, with further draws (without replacement) as sibling leaves.

        Rejection sampling stays exact only if whether a draw is sent never depends on the drawn token
        itself: a node's number of draws and their estimates come from q alone (the r-th draw is estimated
        by q's r-th largest probability), never from what was drawn. What lies below a draw may depend on
        it (the verifier only looks there once the draw is accepted)."""
        restrict = self.bridge.allowed if self.bridge.cross else None
        nodes: list[_Node] = []
        proposals: dict[int, tuple[list[int], list[float]]] = {}
        chain: list[int] = []
        parent, path = -1, 1.0
        while len(chain) < self.max_depth and len(nodes) < self.max_nodes:
            ids, q = _proposal(self._probs(chain, restrict))  # q sorted, largest first
            count = int(np.clip((q >= SIBLING_MIN).sum(), 1, self.branch))
            # Gumbel-top-k: the order of log q + Gumbel noise is a sequence of draws without replacement.
            draws = np.argsort(-(np.log(q) + self.rng.gumbel(size=len(q))))[:count]
            proposals[parent] = ([self._target(int(t)) for t in ids], q.tolist())
            first = len(nodes)
            estimate = path
            for rank, j in enumerate(draws.tolist()):
                estimate = min(estimate, path * self.calibration.prob(q[rank]))
                nodes.append(_Node(self._target(int(ids[j])), parent, float(q[rank]), estimate))
            main = int(ids[draws[0]])
            path = nodes[first].estimate
            if self.model.is_end(main) or not self._worth_deeper(
                    path, 1 + sum(n.estimate for n in nodes), len(chain) + 1, self._known(chain + [main])):
                break
            parent = first
            chain.append(main)
        return nodes, proposals

    # --- the tree -----------------------------------------------------------------------------------
    def _best_first(self, nodes: list[_Node], proposals: dict | None) -> DraftTree:
        """Nodes by decreasing estimate (path estimates never grow downwards, so parents stay first)."""
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].estimate, i))[: self.max_nodes]
        where = {old: new for new, old in enumerate(order)}
        if any(nodes[i].parent >= 0 and where.get(nodes[i].parent, len(order)) >= where[i] for i in order):
            order = list(range(min(len(nodes), self.max_nodes)))  # a tie put a child first: keep draft order
            where = {i: i for i in order}
        tree = DraftTree(
            tokens=[nodes[i].token for i in order],
            parents=[where[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in order],
            accept_probs=[nodes[i].estimate for i in order],
            notes=[nodes[i].raw for i in order],  # the calibration's input, learned from with the node's verdict
        )
        if proposals is not None:
            tree.proposals = {(where[p] if p >= 0 else -1): q for p, q in proposals.items() if p < 0 or p in where}
        return tree


def _lowest_priority() -> None:
    """This thread at nice 19 (Linux schedules threads one by one): it runs when nothing else wants the core."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: the read competes with the rounds as an equal
        pass


_READING: weakref.WeakSet[ModelDrafter] = weakref.WeakSet()


@atexit.register
def _stop_readers_at_exit() -> None:
    """Stop reading prompts (within one batch) before the interpreter goes: a daemon thread inside
    llama.cpp would otherwise come back to a finalised interpreter."""
    for drafter in list(_READING):
        drafter._stop_reader()


def _most_likely(p: np.ndarray, k: int) -> list[int]:
    top = np.argpartition(-p, k)[:k] if len(p) > k else np.arange(len(p))
    return top[np.argsort(-p[top])].tolist()


def _proposal(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's distribution cut to its most likely tokens: (ids, q), q renormalised, best first."""
    top = np.asarray(_most_likely(p, PROPOSAL_TOKENS))
    keep = int(np.searchsorted(np.cumsum(p[top]), PROPOSAL_MASS * p.sum())) + 1
    ids = top[: max(1, keep)]
    q = p[ids] / p[ids].sum()
    return ids, q


def moving_average(old: float | None, new: float) -> float:
    """A timing's exponential moving average: `new` itself when nothing was measured yet (None or nan)."""
    return new if old is None or np.isnan(old) else old + EMA * (new - old)
