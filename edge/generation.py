"""The edge's generation loop: draft, let the verifier check, commit, repeat; the same loop for an
in-process verifier and a remote one."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from specedge.common.draft_tree import DraftTree
from specedge.common.session import StepResult, VerifierSession
from specedge.edge.controller import TreeSizeController
from specedge.edge.drafter import Drafter


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only, up to and including an EOS token
    rounds: int  # verification passes, the one that prefills the prompt included
    wall_s: float
    stopped_by: str  # "eos", "max_new_tokens" or "stop"
    ttft_s: float = 0.0  # until the first pass (the prompt's prefill) returned
    draft_ms: list[float] = field(default_factory=list)  # per round
    tree_sizes: list[int] = field(default_factory=list)  # draft tokens sent per round
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per round
    # Where each round's wait went, as the verifier and the edge's clock tell it (per round).
    compute_ms: list[float] = field(default_factory=list)  # the verifier's pass
    queue_ms: list[float] = field(default_factory=list)  # waiting for a place in the verifier's batch
    network_ms: list[float] = field(default_factory=list)  # the rest: network, serialisation
    # When each round's tree went out and its verdict came in, ms from the start (bench/verifier_idle.py)
    sent_ms: list[float] = field(default_factory=list)
    verdict_ms: list[float] = field(default_factory=list)
    ahead: int = 0  # rounds whose tree went out ahead of the verdict before it (pipelined)
    verifier_drafted: int = 0  # committed tokens the verifier drafted itself (for trees ahead)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per verification pass (the bonus token included)."""
        return self.num_tokens / max(1, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


def generate(
    session: VerifierSession,
    eos_ids: Iterable[int] = (),
    drafter: Drafter | None = None,
    controller: TreeSizeController | None = None,
    stop: Callable[[list[int]], int | None] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Generate until an EOS id, the session's `max_new_tokens`, or `stop(output_ids)` returns a cut length.

    The session is closed at the end. `on_tokens` sees each round's newly committed tokens (streaming).
    Over a long round trip (a session that can `send` without waiting) a second tree goes out ahead of the
    verdict in flight, when the controller says it pays (`TreeSizeController.ahead`): the verifier verifies
    what is left of it once that verdict is committed, so its verdict comes a pass later, not a round trip.
    """
    params = session.params
    eos = set(eos_ids)
    start = time.perf_counter()
    out: list[int] = []
    result = GenerationResult([], 0, 0.0, "max_new_tokens")
    if drafter is not None:
        drafter.begin(session.prompt_ids, params)
    if controller is not None:
        controller.begin()
    # A drafter that can use the verifier's time gets it: the step runs in a thread meanwhile.
    speculate = getattr(drafter, "speculate", None)
    waiting = ThreadPoolExecutor(1, thread_name_prefix="verdict") if speculate is not None else None
    # Trees that may go out ahead of a verdict: a session that can send without waiting.
    ahead = hasattr(session, "send") and drafter is not None and controller is not None
    # A drafter that learns from a verdict apart from committing it (RetrievalDrafter.learn) does so while the
    # next verdict is on its way, where the session can send without waiting.
    learn = getattr(drafter, "learn", None)
    propose_after = getattr(drafter, "propose_after", None)  # it drafts beyond a path (see _keep_ahead)
    in_flight: deque[_Sent] = deque()
    try:
        while len(out) < params.max_new_tokens:
            if not in_flight:
                t0 = time.perf_counter()
                draft = drafter.propose() if drafter is not None else DraftTree.empty()
                tree = _sized(draft, controller, session, params.max_new_tokens - len(out))
                if ahead:
                    session.send(tree)
                sent_at = time.perf_counter()
                in_flight.append(_Sent(tree, len(out), (sent_at - t0) * 1e3, sent_at))
                if ahead:
                    _keep_ahead(session, drafter, controller, in_flight, out, params.max_new_tokens, draft)
            elif ahead:
                _keep_ahead(session, drafter, controller, in_flight, out, params.max_new_tokens)
            sent = in_flight.popleft()
            if ahead:
                if learn is not None:
                    learn()
                if speculate is not None and (not in_flight or propose_after is not None):  # the drafter uses the wait
                    use_wait = speculate
                    if in_flight:  # trees ahead: the next draft starts beyond the last one's likeliest path
                        ahead_of = in_flight[-1].tree.after(out[in_flight[-1].root :])
                        use_wait = partial(speculate, then=[ahead_of.tokens[i] for i in ahead_of.likeliest_path()])
                    step, received_at = _speculating(waiting, use_wait, session.receive)
                else:
                    step, received_at = _received(session.receive)
            elif speculate is not None:  # an empty tree's pass too: a model drafter reads the verdict-to-be
                step, received_at = _speculating(waiting, speculate, session.step, sent.tree)
            else:
                step, received_at = _received(session.step, sent.tree)
            if not step.tokens:  # a tree ahead of the verdict that ended the generation: nothing was verified
                continue
            tree = sent.tree.after(out[sent.root :])  # what the verifier verified of it
            result.rounds += 1
            result.draft_ms.append(sent.draft_ms)
            result.sent_ms.append((sent.sent_at - start) * 1e3)
            result.verdict_ms.append((received_at - start) * 1e3)
            result.tree_sizes.append(len(tree))
            result.accepted.append(len(step.accepted))
            result.compute_ms.append(step.compute_ms)
            result.queue_ms.append(step.queue_ms)
            result.network_ms.append(step.rtt_ms)
            result.ahead += sent.ahead
            result.verifier_drafted += step.verifier_drafted
            if result.rounds == 1:
                result.ttft_s = time.perf_counter() - start
            if drafter is not None:
                drafter.observe(tree, step)
            if controller is not None:
                controller.observe(tree, step, ahead=sent.ahead, draft_ms=sent.draft_ms)
            new = step.tokens[: params.max_new_tokens - len(out)]
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            if hit is not None:
                new = new[: hit + 1]
            out.extend(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if hit is not None:
                result.stopped_by = "eos"
                break
            if stop is not None and (cut := stop(out)) is not None:
                del out[cut:]
                result.stopped_by = "stop"
                break
    finally:
        if drafter is not None:
            drafter.end()
        if waiting is not None:
            waiting.shutdown()
        session.close()
    result.token_ids = out
    result.wall_s = time.perf_counter() - start
    return result


@dataclass
class _Sent:
    tree: DraftTree
    root: int  # output tokens committed when it was drafted: its root follows them
    draft_ms: float
    sent_at: float  # time.perf_counter() when it went out (or, to an in-process verifier, was ready)
    ahead: bool = False  # sent while another tree's verdict was in flight
    covered: int = 0  # its first nodes: the likeliest path of the tree before it, which it was drafted below

    def expected(self, controller: TreeSizeController) -> float:
        """Tokens its verdict is expected to commit beyond the trees before it: its pass's own and its nodes' (for
        a tree with none below what it covers, what the verifier's own draft lately committed besides)."""
        own = (self.tree.accept_probs or ())[self.covered :]
        return 1.0 + sum(own) if len(self.tree) > self.covered else controller.bare_tokens()


def _received(call: Callable[..., StepResult], *args) -> tuple[StepResult, float]:
    """A verdict and when it came in (the drafter may still be using the wait then)."""
    return call(*args), time.perf_counter()


def _speculating(waiting: ThreadPoolExecutor, speculate: Callable[[Callable[[], bool]], None],
                 call: Callable[..., StepResult], *args) -> tuple[StepResult, float]:
    """The verdict `call(*args)` returns and when it came in, received in this thread while the drafter uses the
    wait in `waiting`'s (`speculate`, until the verdict is in); returned once the drafter is done with it, as is
    an error receiving it. (The other way round, the verdict received in a thread of its own, every round waited
    for that thread's hand-over even where the drafter had nothing to do: 0.13 ms from the verdict to the drafter's
    `observe`, against 0.09 ms so, in rounds of 42 ms by timed replay: BENCHMARKS.md section 6, "Trees ahead at
    0 ms".)"""
    done = threading.Event()
    using = waiting.submit(speculate, done.is_set)
    try:
        return _received(call, *args)
    finally:
        done.set()
        using.result()  # the drafter is done with the wait (an error of its own is raised here)


def _sized(draft: DraftTree, controller: TreeSizeController | None, session, remaining: int) -> DraftTree:
    size = len(draft) if controller is None else controller.choose(draft, session.cost_model(), remaining)
    return draft.prefix(min(size, session.max_tree_tokens))


def _keep_ahead(session, drafter: Drafter, controller: TreeSizeController, in_flight: deque[_Sent],
                out: list[int], max_new_tokens: int, draft: DraftTree | None = None) -> None:
    """Send a tree ahead of the one verdict in flight where the controller says it pays (`_send_ahead`); with
    trees going ahead, keep `controller.depth` of them in flight (`_send_deeper`): over a round trip many
    passes long, the verifier would otherwise wait for the edge through most of it."""
    if len(in_flight) == 1 and not _send_ahead(session, drafter, controller, in_flight, out, max_new_tokens, draft):
        return
    depth = controller.depth(session.cost_model())
    while len(in_flight) < depth and _send_deeper(session, drafter, controller, in_flight, out, max_new_tokens):
        pass


def _send_ahead(session, drafter: Drafter, controller: TreeSizeController, in_flight: deque[_Sent],
                out: list[int], max_new_tokens: int, draft: DraftTree | None = None) -> bool:
    """Send a tree ahead of the one verdict in flight, if that pays and the verdict cannot end the generation's
    token budget first; True if it went. The tree: `draft` (rooted at the committed end), or else the drafter's
    draft now; a drafter that can draft beyond a path (`propose_after`, the model drafter) drafts beyond the
    likeliest path of the tree in flight instead, so that what it adds lies beyond what that verdict may commit."""
    t0 = time.perf_counter()
    (pending,) = in_flight
    left = pending.tree.after(out[pending.root :])  # what the verifier will verify of the tree in flight
    # Tokens its verdict can commit through the nodes left. (A tree ahead lets the verifier draft where nothing
    # of it is left, and it leaves one token of the budget over then: cloud/service.py.)
    taken = max(left.depths()) + 1 if left else 1
    filled = controller.fill_tokens if pending.ahead and not left else 0
    if len(out) + taken + max(0, min(filled, max_new_tokens - len(out) - 2)) >= max_new_tokens:
        return False
    # The budget this tree is priced with leaves out what the verifier may draft for the one in flight: that
    # draft is sized by what is left (counting the most it could take priced every tree after a bare one as
    # having a token left, and sent it bare too)
    remaining = max_new_tokens - len(out) - taken
    propose_after = getattr(drafter, "propose_after", None)
    covered = 0
    if propose_after is not None:
        draft, covered = _drafted_below(left, propose_after)
        size = controller.ahead(draft, session.cost_model(), remaining, covered, beyond=True)
    else:
        draft = drafter.propose() if draft is None else draft
        size = controller.ahead(draft, session.cost_model(), remaining, len(left))
    if size is None:
        return False
    _send(session, controller, in_flight, out, draft.prefix(min(size, session.max_tree_tokens)), t0, covered)
    return True


def _send_deeper(session, drafter: Drafter, controller: TreeSizeController, in_flight: deque[_Sent],
                 out: list[int], max_new_tokens: int) -> bool:
    """One more tree behind those in flight, unless the tokens they are expected to commit fill the budget (any
    sent too many get empty verdicts once the generation ends); True if it went. The verifier drafts for it
    itself, knowing every verdict before it (`fill`). A drafter that drafts beyond a path drafts below the
    likeliest path through the trees in flight, which the last one's chain holds, its nodes sent where they
    promise more than the verifier's draft would commit by itself (`TreeSizeController.deeper`); for another
    drafter the tree goes bare: nothing it drafts now from the committed end would be left by then."""
    t0 = time.perf_counter()
    expected = len(out) + sum(s.expected(controller) for s in in_flight)
    if expected + controller.bare_tokens() >= max_new_tokens:
        return False
    propose_after = getattr(drafter, "propose_after", None)
    if propose_after is None:
        _send(session, controller, in_flight, out, DraftTree.empty(), t0)
        return True
    last = in_flight[-1]
    draft, covered = _drafted_below(last.tree.after(out[last.root :]), propose_after)
    size = controller.deeper(draft, session.cost_model(), int(max_new_tokens - expected), covered)
    _send(session, controller, in_flight, out, draft.prefix(min(size, session.max_tree_tokens)), t0, covered)
    return True


def _drafted_below(left: DraftTree, propose_after: Callable[[list[int]], DraftTree]) -> tuple[DraftTree, int]:
    """The drafter's draft below `left`'s likeliest path, that path its first nodes; and the path's length."""
    path = left.likeliest_path()
    return _below(left, path, propose_after([left.tokens[i] for i in path])), len(path)


def _send(session, controller: TreeSizeController, in_flight: deque[_Sent], out: list[int], tree: DraftTree,
          drafting_since: float, covered: int = 0) -> None:
    """Send a tree ahead of the verdicts in flight, rooted at the committed end."""
    draft_ms = (time.perf_counter() - drafting_since) * 1e3
    session.send(tree, root_length=len(session.prompt_ids) + len(out), fill_tokens=controller.fill_tokens)
    in_flight.append(_Sent(tree, len(out), draft_ms, time.perf_counter(), ahead=True, covered=min(covered, len(tree))))


def _below(tree: DraftTree, path: list[int], draft: DraftTree) -> DraftTree:
    """`path`'s nodes of `tree` as a chain with `draft` hanging below its end, best first: the chain's
    estimates and notes are tree's, draft's estimates are times the chain's last. (The chain carries no
    proposals: the verdict before commits it whole, or nothing of this tree is left.)"""
    if not path:
        return draft
    n = len(path)
    reach = tree.accept_probs[path[-1]] if tree.accept_probs is not None else 1.0
    accept_probs = None
    if tree.accept_probs is not None and draft.accept_probs is not None:
        accept_probs = [tree.accept_probs[i] for i in path] + [reach * p for p in draft.accept_probs]
    notes = None
    if draft.notes is not None:  # (the chain's own go with it where it has them: its verdict comes before)
        notes = [tree.notes[i] if tree.notes is not None else None for i in path] + list(draft.notes)
    proposals = {parent + n if parent >= 0 else n - 1: q for parent, q in (draft.proposals or {}).items()}
    return DraftTree([tree.tokens[i] for i in path] + draft.tokens,
                     list(range(-1, n - 1)) + [p + n if p >= 0 else n - 1 for p in draft.parents],
                     proposals or None, accept_probs, notes)
