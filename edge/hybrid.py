"""Retrieval and a drafting model in one tree (READER's point: their candidates complement each other).

Each source drafts best first with its own online-calibrated acceptance estimates; the hybrid merges the
two trees as a trie (a path both propose is one node, estimated by the more confident source) and orders
the nodes by estimate, so the controller's expected-value rule picks the nodes worth a pass from either
source under one node budget. Sorting by estimate keeps each source's nodes in the source's own order, so
any prefix of the merged tree holds a prefix of each source's draft, and each source learns from the
verdict on the nodes of its own that were sent (retrieval, in a greedy generation, from all of its nodes:
the committed text judges the unsent ones too, so what it learns in a round does not depend on what the
model's nodes left out).

The model costs tens of ms per round on an edge CPU; retrieval costs well under one. Where retrieval's draft
is confident the model rarely adds a token, so each round the hybrid asks whether the model pays. It measures
G, the tokens the verifier accepted beyond retrieval's own nodes when the model drafted (rounds in which the
controller sent none of the model's nodes included: an unsure model's drafting buys nothing), per bucket of
retrieval's expected accepted tokens E (each twice: rounds after one the model led, its tokens taken to the
end of the tree, keep figures of their own) as a level times a shape: the level follows the text (a mean over
the last few rounds the model drafted in, whatever their bucket, each round's G divided by its bucket's
shape), the shape keeps what differs between buckets (a bucket's G against the level at the time, over many of
its rounds; 1 for a fresh bucket). So when the text changes, as between one kind of prompt and the next, a few
rounds in any bucket move every bucket's G, not a few rounds in each. It measures too the round's time from
sending the tree to the verdict, with the model drafting (R_m: its nodes make the pass longer, its speculation
may outlast the pass) and without (R); D is the model's drafting time and B what it has to read first
(committed tokens it did not read during the pass: a verdict's tokens beyond those it read ahead). The model
pays when (1 + E + G) / (R_m + D + B) beats (1 + E) / R. A fresh hybrid measures first (MEASURE_ROUNDS rounds
with the model, one without), then each bucket drafts with the model once where it can at no more than its
usual cost (G differs most between buckets; a model far behind measures a bucket from the exploring budget
below); until a bucket has times of its own it takes all buckets'. Where the model does not pay, a round with
it loses R_m + D + B - R (1 + E + G) / (1 + E) ms; the bucket still runs one once its rounds without the model
have set that much aside at EXPLORE_SHARE of their time, so G stays measured and follows the text at a bounded
cost: often where the model nearly pays, rarely where it is far from it (as where retrieval commits many
tokens per pass).

During the verifier's pass the model reads what the verdict most likely commits (the merged tree's path as
far as it is more likely accepted than not: retrieval's runs to tens of tokens where it is confident), so
that the next round with the model does not begin by reading it; a drafting model speculates beyond it.
A model that does not draft reads only while it is wanted: where it pays or an exploring round is due
(but it has too much to read first: it reads during this pass and drafts in the next round; a round after
reading still has the verdict's bonus token to read, so "pays" counts that forward), or where it
paid within the last WANTED_LATELY rounds (retrieval's confidence moves between buckets from round to
round). Otherwise it rests, reading nothing, not even a new prompt once the model is measured: reading
beside the verifier's pass costs the edge nothing on its own device, but on a machine shared with the
verifier (the benchmarks' two cores) it slows the pass by ~15% (BENCHMARKS.md section 6). What a rest
leaves unread counts against the round that drafts after it (B), and the budget of an exploring round
pays for it: B if it is read before drafting, or what reading it during the passes before slows them by
(measured: consecutive rounds in which the model read and rested; READING_SLOWS_PRIOR until then), which
is nothing where edge and verifier are separate machines. By the same measure R is the time a round would
take with the model resting, as with retrieval alone: a round in which it read counts as that much shorter.

Over a long round trip trees go out ahead of the verdict in flight (edge/generation.py): the hybrid drafts
one below that tree's likeliest path (`propose_after`: retrieval's draft beyond the path, the model's
drafted as if the path were committed), keeps each tree's round apart until its verdict, and traces the
verdict on what was left of the tree (DraftTree.after) to each source's nodes by the tree's notes. Such a
tree is drafted after the verdict before the one in flight, and must reach the verifier before the pass in
flight ends (a pass less a round trip later): a model drafting then made it late, and the verifier waited
(3-6 s a run at 80 ms across vocabularies, BENCHMARKS.md section 8). So the model's part of a tree ahead is
what it computed while the verifier checked the trees before (`speculate`, beyond the likeliest path of the
tree in flight): it runs no forward for it (ModelDrafter.propose with `known_only`), costs no time, and the
model drafts every tree ahead, its G measured too. Where retrieval has nothing beyond the path, the tree
ahead would go bare without the model, and the verifier would draft for it itself: there G counts what the
model's nodes commit beyond what those drafts commit (measured on trees ahead with nothing left; one such
tree goes bare to measure it). The controller weighs a tree ahead against waiting for the verdict in flight
and drafting after it (TreeSizeController.ahead): the hybrid tells it what that draft would hold
(`waiting`): retrieval's part at once, or the whole tree once the model has drafted, unless the serial rule
would have the model rest.
Until a tree ahead has had its verdict (over a short round trip the controller holds them back), the model
does in one drafted ahead what it does in the round whose verdict is awaited; a tree held back neither puts
aside nor spends exploring time.

Sampled drafts: a node keeps the model's proposal q (its children are the model's draws, checked by
rejection sampling) only where retrieval proposes nothing; where it does, all children there are checked
as deterministic candidates. Which rule a node gets must not depend on what the model drew there (that
would bias rejection sampling), so it is decided from the retrieval draft alone. Both rules are lossless.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.model_drafter import SPECULATION_STEPS, ModelDrafter, moving_average
from specedge.edge.retrieval import RetrievalDrafter


@dataclass
class _Merged:
    token: int
    parent: int  # merged index, -1 = root
    estimate: float
    where: dict[int, int] = field(default_factory=dict)  # source number -> node index in that source's draft
    retrieval_below: bool = False  # the retrieval draft has children under this node


@dataclass
class _Round:
    """One tree, from its drafting to its verdict (over a long round trip a tree goes out ahead of another's)."""

    drafts: tuple[DraftTree, DraftTree]  # retrieval's and the model's, hanging where the tree does
    merged: list[_Merged] | None  # the tree's nodes (its notes); None: retrieval's tree went as it is
    ahead: bool  # drafted while another tree was in flight, to go out ahead of its verdict
    path: list[int]  # target ids it hangs below then: the likeliest path of the tree in flight
    bucket: int
    mode: str  # what the model does in this round: DRAFT, READ or REST
    sent_at: float
    model_read: bool  # the model read (or drafted) during its pass
    retrieval_at_root: bool = False  # retrieval's draft has children at the root
    since: list[int] = field(default_factory=list)  # tokens committed after it was drafted
    explored: np.ndarray | None = None  # what deciding the model's part put aside for exploring, per bucket


EXPECTED_EDGES = np.array([0.25, 0.5, 1.0, 2.0])  # buckets of retrieval's expected accepted tokens
BUCKETS = len(EXPECTED_EDGES) + 1
EXPLORE_SHARE = 0.03  # of the time in a bucket where the model does not pay, spent measuring it there
MEASURE_ROUNDS = 4  # a fresh hybrid's rounds with the model before it decides (one alone once shut it off)
PRIOR_ROUNDS = 1.0  # weight of a fresh bucket's shape (1: G is the level), in rounds of its own
ALL = -1  # the row of the figures for all buckets together
FORGET = 0.8  # per measured round: the level is a mean over roughly the last 1 / (1 - FORGET) of them
FORGET_SHAPE = 0.95  # per round measured in a bucket: its shape, a ratio over roughly the last 20 of them
SHAPE_FLOOR = 0.2  # where a bucket's shape is smaller, one round's G there counts as G / SHAPE_FLOOR of level
LIKELY = 0.5  # a path the verdict more likely commits than not: the model reads it during the pass
SIZE_EDGES = np.array([1, 3, 5, 9, 17])  # tree sizes whose passes are compared for reading's cost
READING_SLOWS_PRIOR = 0.15  # the pass's slowdown while the model reads beside it, until measured
FORGET_PAIRS = 0.95  # per pair of rounds measuring that slowdown (each pair is noisy: a mean over many)
WANTED_LATELY = 4  # rounds after it last paid that a model which does not draft keeps reading
DRAFT, READ, REST = "draft", "read", "rest"  # what the model does in a round


class HybridDrafter:
    def __init__(self, retrieval: RetrievalDrafter, model: ModelDrafter, max_nodes: int) -> None:
        self.sources = (retrieval, model)
        self.max_nodes = max_nodes
        self._pending: deque[_Round] = deque()  # drafted, verdict not yet observed, oldest first
        # One row per bucket, again per bucket after a round the model led (see _led), and the last row for
        # all of them together (ALL)
        rows = 2 * BUCKETS + 1
        self.split_after_led = True  # False: the model's lead does not count (for comparison)
        self._led = False  # the last round's verdict ran out along the model's own nodes (see observe)
        self._level: float | None = None  # the model's G lately, in a bucket of shape 1
        # Per bucket (no ALL row: the level is that): decayed sums of G, of the level at the time, of the rounds
        self._shape = np.zeros((rows - 1, 3))
        self._round_ms = np.full((rows, 2), np.nan)  # R without, R_m with the model (EMAs)
        self._ahead_answered = False  # a tree sent ahead has had its verdict
        # The last round the model did not draft in: (its tree's size bucket, whether the model read, ms)
        self._last_quiet: tuple[int, bool, float] | None = None
        self._reading_pairs = np.zeros(2)  # decayed sums of (read / rested round time - 1) and of the pairs
        self._explore_ms = np.zeros(rows)  # per bucket: time put aside for rounds that explore
        self.model_ms: float | None = None  # D: the model's drafting time per round
        # What the verifier's own draft commits for a tree ahead with nothing left (edge/generation.py's fill)
        self._filled: float | None = None
        self._first_round = True
        self._round, self._paid_round = 0, None  # rounds proposed; the last one in which the model paid
        self._model_rounds = 0  # rounds the model drafted in

    @property
    def hints_top_k(self) -> int:
        """The verifier's hints feed retrieval's recycling table (edge/recycling.py)."""
        return self.sources[0].hints_top_k

    def _model_round(self, expected: float, behind_ms: float, ahead: bool) -> tuple[str, int]:
        """What the model does this round: DRAFT, READ (it does not draft, but reads during the pass what it
        would have to read before a draft) or REST; and the round's bucket. `behind_ms`: what the model would
        read before it could draft now (ModelDrafter.behind_ms). `ahead`: the tree goes ahead of another."""
        b = int(np.searchsorted(EXPECTED_EDGES, expected, side="right"))
        b = b + BUCKETS if self._led and self.split_after_led else b
        if ahead and not self._ahead_answered:
            # No tree ahead has had its verdict yet (over a short round trip the controller holds them back): the
            # model does in this one what it does in the round whose verdict is awaited, and nothing is counted.
            return (self._pending[0].mode if self._pending else REST), b
        self._round += 1
        mode, pays = self._wanted_for(b, expected, behind_ms, ahead)
        if pays:
            self._paid_round = self._round
        elif mode == REST and self._paid_round is not None and self._round - self._paid_round <= WANTED_LATELY:
            mode = READ
        return mode, b

    def _wanted_for(self, b: int, expected: float, behind_ms: float, ahead: bool) -> tuple[str, bool]:
        """DRAFT, READ or REST by this round's figures alone (`b`: its bucket), and whether the model pays here
        (had it read everything committed but the verdict's bonus token)."""
        if self.model_ms is None or self._model_rounds < MEASURE_ROUNDS:
            return DRAFT, False  # measuring: G, D and R_m (the first round, which reads the prompt, is not timed)
        if ahead and not expected and self._filled is None:
            return REST, False  # a tree ahead left bare once: what the verifier drafts for it is G's baseline
        gain = self._gain_in(b)
        if ahead:  # its part of a tree ahead costs no time: what it computed during the passes (see the docstring)
            return DRAFT, gain > 0
        forward = self.sources[1].token_ms or 0.0
        if np.isnan(self._round_ms[ALL, 1]):
            return DRAFT, False
        if np.isnan(self._round_ms[ALL, 0]):
            return READ, False  # a round without the model, which times R
        without, with_model = self._serial_times(b)
        # ms lost (or gained, when negative) by drafting this round with the model, at the current estimates,
        # had it read everything committed; drafting now costs the reading it has to do first on top
        loss = _loss(without, with_model, expected, gain)
        # Reading during this pass leaves the next round at least one forward to read before it drafts: the
        # verdict's bonus token, unknown until then. So the model pays (and reads towards drafting) only where
        # it does with that forward to pay: otherwise its rounds would read beside every pass and never draft.
        pays = loss + forward < 0
        if loss + behind_ms < 0:
            return DRAFT, pays
        if not self._shape[b, 2] and behind_ms <= self.model_ms:
            return DRAFT, pays  # G differs most between buckets: each measures it once where that is cheap
        if pays:  # it reads during this pass, and drafts in the next round
            return READ, pays
        self._explore_ms[b] += EXPLORE_SHARE * without
        # G stays measured, at no more than EXPLORE_SHARE of the time, what the exploring round has to read
        # first included: before drafting (on the round's time), or during the passes before it, which
        # costs what reading slows them by (nothing on separate machines; see _slowed_by_reading).
        if self._explore_ms[b] >= loss + behind_ms:
            self._explore_ms[b] -= loss + behind_ms
            return DRAFT, pays
        # Reading now is worth it once the budget pays for the draft after it too, which still has the verdict's
        # bonus token to read: sooner, the model would read beside pass after pass, each time one forward short.
        slowed = self._slowed_by_reading()
        reading = slowed * behind_ms if slowed else 0.0  # (behind_ms is infinite while it reads a backlog)
        if self._explore_ms[b] >= loss + forward + reading:
            self._explore_ms[b] -= reading
            return READ, pays
        return REST, pays

    def _serial_times(self, b: int) -> tuple[float, float]:
        """A serial round's R and R_m + D in bucket `b` (the figures for all buckets measured)."""
        # A bucket's own times where it has them, all buckets' until then. The model's nodes and speculation
        # can only delay the verdict: a round that took less time with them committed fewer tokens (a pass's
        # time grows with what it commits), which says nothing of them.
        without, with_model = self._round_ms[b]
        if np.isnan(without):
            without = self._round_ms[ALL, 0]
        if np.isnan(with_model):
            with_model = without + self._round_ms[ALL, 1] - self._round_ms[ALL, 0]
        return without, max(with_model, without) + self.model_ms

    def waiting(self) -> list[tuple[DraftTree | None, float]] | None:
        """The ways a tree drafted after the verdict in flight may be drafted, where the model drafted the tree
        just drafted ahead, each with the ms its drafting adds (TreeSizeController.ahead weighs the tree
        ahead against the best): retrieval's part alone at once, and the whole tree (None) after the model
        drafts D and reads the verdict's bonus token, unless the serial rule, once measured, has the model rest.
        (Priced without that time, the model's part made waiting look best below any unlikely path: at 80 ms
        the hybrid ran four times as many serial rounds as retrieval alone, BENCHMARKS.md section 8.)"""
        rnd = self._pending[-1] if self._pending else None
        if rnd is None or not rnd.ahead or not len(rnd.drafts[1]) or self.model_ms is None:
            return None
        ways: list[tuple[DraftTree | None, float]] = [(rnd.drafts[0], 0.0)]
        if not np.isnan(self._round_ms[ALL]).any():
            expected = sum(rnd.drafts[0].accept_probs or ())
            without, with_model = self._serial_times(rnd.bucket)
            if _loss(without, with_model, expected, self._gain_in(rnd.bucket)) >= 0:
                return ways
        return ways + [(None, self.model_ms + (self.sources[1].token_ms or 0.0))]

    def _gain_in(self, b: int) -> float:
        """G expected in bucket `b`: the model's level lately times the bucket's shape."""
        return (self._level or 0.0) * self._shape_of(b)

    def _shape_of(self, b: int) -> float:
        """What the model adds in bucket `b` for each token of its level: the ratio of the bucket's G to the
        level at the time over its rounds, starting from 1 (worth PRIOR_ROUNDS of them)."""
        gains, levels, _ = self._shape[b]
        prior = PRIOR_ROUNDS * (self._level or 0.0)
        return (gains + prior) / (levels + prior) if levels + prior > 0 else 1.0

    def _learn_gain(self, b: int, gain: float) -> None:
        """A round the model drafted in, in bucket `b`, added `gain` tokens: it moves the level by what it
        says of a bucket of shape 1, and the bucket's shape by how it compares with the level."""
        level = float(gain) if self._level is None else self._level
        shape = self._shape_of(b)
        self._shape[b] = FORGET_SHAPE * self._shape[b] + (gain, level, 1.0)
        self._level = FORGET * level + (1 - FORGET) * gain / max(shape, SHAPE_FLOOR)

    def _slowed_by_reading(self) -> float:
        """By what share the verifier's pass is slower while the model reads beside it: ~0.15 on two cores of
        one machine (BENCHMARKS.md section 6), nothing where edge and verifier are apart. Measured from
        pairs of consecutive rounds of one generation that the model did not draft in, in one of which it
        read and in the other rested, trees of like size (a pass's time grows with the tree, and with the
        context: a long prompt's passes take several times a short one's, so rounds of different prompts
        cannot be compared). Until a pair is measured, READING_SLOWS_PRIOR: a model that has not read yet
        must not start reading a long prompt beside the pass on the guess that reading is free (on a shared
        machine it slowed every pass of a generation and never drafted)."""
        slowed, pairs = self._reading_pairs
        return max(0.0, slowed / pairs) if pairs else READING_SLOWS_PRIOR

    def _time_quiet_round(self, size: int, ms: float, model_read: bool) -> float:
        """Pair a round the model did not draft in with the last one (see _slowed_by_reading); -> the round's
        time had the model rested (R is what retrieval alone would take)."""
        size = int(np.searchsorted(SIZE_EDGES, size, side="right"))
        last, self._last_quiet = self._last_quiet, (size, model_read, ms)
        if last is not None and last[0] == size and last[1] != model_read:
            read, rested = (ms, last[2]) if model_read else (last[2], ms)
            self._reading_pairs = FORGET_PAIRS * self._reading_pairs + (read / rested - 1.0, 1.0)
        # (by the measured slowdown only: the prior, taken for granted, would make a model that pays where
        # edge and verifier are apart, and so rarely rests, look worse than it is for ever)
        return ms / (1.0 + self._slowed_by_reading()) if model_read and self._reading_pairs[1] else ms

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self._first_round, self._last_quiet, self._led = True, None, False
        self._pending.clear()
        retrieval, model = self.sources
        retrieval.begin(prompt_ids, params)
        # Once measured, a model reads the prompt only from the first round it drafts or reads in.
        model.begin(prompt_ids, params, read=self.model_ms is None)

    def propose(self) -> DraftTree:
        # Nothing is in flight when the generation loop asks for a tree here: a tree drafted ahead that the
        # controller held back was never sent, and its verdict will not come.
        for unsent in (rnd for rnd in self._pending if rnd.ahead):
            self._explore_ms -= unsent.explored  # a round never sent neither puts aside nor spends
        self._pending.clear()
        return self._draft([], ahead=False)

    def propose_after(self, path: list[int]) -> DraftTree:
        """A tree hanging below `path` (target ids), to send ahead of a verdict that most likely commits it
        (edge/generation.py): retrieval's part is what its draft holds beyond the path, the model drafts
        beyond it (ModelDrafter.propose_after). The round is timed from the verdict before it."""
        return self._draft(list(path), ahead=True)

    def _draft(self, path: list[int], ahead: bool) -> DraftTree:
        retrieval, model = self.sources
        retrieved = retrieval.propose().after(path)
        drafted = DraftTree.empty()
        expected = sum(retrieved.accept_probs or ())
        # What the model would read before drafting (none comes while it reads); a tree ahead has it read nothing
        behind_ms = 0.0 if ahead else math.inf if model.reading else model.behind_ms(path)
        explore_ms = self._explore_ms.copy()
        mode, bucket = self._model_round(expected, behind_ms, ahead)
        if mode == DRAFT and ahead:  # what it computed during the passes, no forward now (see the docstring)
            drafted = model.propose_after(path, alongside=expected, known_only=True)
        elif mode == DRAFT:
            start = time.perf_counter()
            drafted = model.propose(alongside=expected)
            if len(drafted):  # not while it still reads the prompt
                spent = (time.perf_counter() - start) * 1e3
                self.model_ms = moving_average(self.model_ms, max(spent - behind_ms, 0.0))
        # (speculate() may start the model reading)
        rnd = _Round((retrieved, drafted), None, ahead, path, bucket, mode, time.perf_counter(),
                     model_read=mode != REST or model.reading,
                     explored=self._explore_ms - explore_ms)
        self._pending.append(rnd)
        if mode == REST and len(retrieved) <= self.max_nodes:
            return retrieved  # retrieval's tree goes as it is (observe passes its verdict straight on)
        nodes: list[_Merged] = []
        index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged index
        for number, draft in enumerate(rnd.drafts):
            probs = draft.accept_probs or [0.0] * len(draft)
            mine: list[int] = []  # this source's node -> merged index
            for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
                key = (mine[parent] if parent >= 0 else -1, token)
                if key in index:
                    node = nodes[index[key]]
                    node.estimate = max(node.estimate, probs[i])
                else:
                    index[key] = len(nodes)
                    nodes.append(_Merged(token, key[0], probs[i]))
                mine.append(index[key])
                nodes[index[key]].where[number] = i
                if number == 0:
                    if key[0] < 0:
                        rnd.retrieval_at_root = True
                    else:
                        nodes[key[0]].retrieval_below = True
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].estimate, i))
        order = _parents_first(order, nodes)[: self.max_nodes]
        new = {old: k for k, old in enumerate(order)}
        rnd.merged = [nodes[i] for i in order]
        for node in rnd.merged:
            node.parent = new.get(node.parent, -1) if node.parent >= 0 else -1
        # Each node's note is its merged node: a verdict on what is left of a tree sent ahead (DraftTree.after)
        # is traced back to the sources' nodes by it.
        tree = DraftTree([n.token for n in rnd.merged], [n.parent for n in rnd.merged],
                         accept_probs=[n.estimate for n in rnd.merged], notes=list(rnd.merged))
        tree.proposals = self._proposals(tree, rnd) or None
        return tree

    def _proposals(self, tree: DraftTree, rnd: _Round) -> dict[int, tuple[list[int], list[float]]]:
        """The model's proposals for the merged nodes whose children are the model's first draws there."""
        model_draft = rnd.drafts[1]
        if not model_draft.proposals:
            return {}
        model_children = model_draft.children()
        out = {}
        for parent, kids in enumerate(tree.children(), start=-1):
            source_parent = -1 if parent < 0 else rnd.merged[parent].where.get(1)
            if not kids or source_parent is None or source_parent not in model_draft.proposals:
                continue
            if (rnd.retrieval_at_root if parent < 0 else rnd.merged[parent].retrieval_below):
                continue
            drawn = [rnd.merged[k].where.get(1) for k in kids]
            if drawn == model_children[source_parent + 1][: len(drawn)]:
                out[parent] = model_draft.proposals[source_parent]
        return out

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """`tree`: what the verifier verified of the oldest round's tree (for a tree sent ahead, what was left of
        it once the verdict before it was committed)."""
        rnd = self._pending.popleft()
        for later in self._pending:
            later.since += result.tokens
        now = time.perf_counter()
        if rnd.ahead and not len(tree):
            self._filled = moving_average(self._filled, result.verifier_drafted)
        retrieval, model = self.sources
        beyond = rnd.since[len(rnd.path) :]
        if rnd.since[: len(rnd.path)] != rnd.path:  # the verdict before did not commit the path: nothing was left
            for source in self.sources:
                source.observe(DraftTree.empty(), replace(result, accepted=[], hints=None))
            self._led = False
            return
        sent = len(tree)
        # The model's round once it drafted, its nodes sent or not (the drafting time was spent either way)
        drafted = len(rnd.drafts[1]) > 0
        if drafted:  # what did the model's nodes add?
            self._model_rounds += 1
            by_retrieval = next((i for i, k in enumerate(result.accepted) if 0 not in tree.notes[k].where),
                                len(result.accepted))
            gain = len(result.accepted) - by_retrieval
            # Without the model's nodes, nothing of a tree ahead that retrieval left empty would have been left,
            # and the verifier would have drafted for it: the model adds only what it commits beyond that.
            alone = rnd.ahead and not any(0 in node.where for node in tree.notes or ())
            self._learn_gain(rnd.bucket, max(0.0, gain - (self._filled or 0.0)) if alone else gain)
            # The model led: it added tokens and the verdict ended where the tree did, not at a rejection.
            # Retrieval's estimate says little of what the model adds after such a round (a repeated
            # structure: the model drafts a dozen tokens, all accepted, and retrieval's long match that
            # follows commits two), so those rounds keep figures of their own.
            self._led = gain > 0 and result.accepted[-1] not in tree.parents
        else:
            self._led = False
        if rnd.ahead:
            self._ahead_answered = True
        elif not self._first_round:  # (the first round's pass reads the prompt: not typical)
            ms = (now - rnd.sent_at) * 1e3
            if not drafted:
                ms = self._time_quiet_round(sent, ms, rnd.model_read)
            for row in (rnd.bucket, ALL):
                self._round_ms[row, int(drafted)] = moving_average(self._round_ms[row, int(drafted)], ms)
        self._first_round = False
        if rnd.merged is None:  # a resting round: the tree was retrieval's own
            retrieval.observe(tree, result)
            model.observe(DraftTree.empty(), replace(result, accepted=[], hints=None))
            return
        if result.hints is not None:  # rows for the merged tree's nodes, the model's included
            retrieval.learn_hints(tree, result.hints)
        for number, (source, whole) in enumerate(zip(self.sources, rnd.drafts)):
            draft = whole.after(beyond)  # what is left of this source's draft, as of the tree
            origin = _origins(whole, beyond)  # each of its nodes' index in `whole`
            sent_here = {n.where[number] for n in tree.notes or () if number in n.where}
            n = next((i for i, o in enumerate(origin) if o not in sent_here), len(origin))  # sent whole
            mine = {origin[i]: i for i in range(n)}
            accepted = []
            for k in result.accepted:
                if tree.notes[k].where.get(number) not in mine:
                    break
                accepted.append(mine[tree.notes[k].where[number]])
            source.observe(draft.prefix(n), replace(result, accepted=accepted, hints=None))

    def end(self) -> None:
        for source in self.sources:
            source.end()

    def speculate(self, stop: Callable[[], bool], then: list[int] = ()) -> None:
        """`then`: over a long round trip, the likeliest path of the tree ahead in flight (target ids), where
        the next draft starts (edge/generation.py)."""
        # Retrieval has nothing to compute ahead, only the last verdict to learn from. The model reads ahead
        # what the verdict most likely commits (retrieval's verdicts run to tens of tokens), so that a round it
        # drafts does not begin by reading it; when it is not drafting it does only that (and reads what was
        # committed since it last ran), and a resting model nothing.
        self.sources[0].learn()  # what retrieval learns from the last verdict (RetrievalDrafter.learn)
        if not self._pending:
            return
        # The round whose verdict is awaited; with a tree ahead in flight, that tree's round sets what the model
        # does (rounds after the awaited one are either that tree's or were held back by the controller).
        awaited = self._pending[0]
        newest = self._pending[-1] if then else awaited
        # (a tree ahead the model had nothing computed for still has it compute for the next)
        drafting = len(newest.drafts[1]) > 0 or (newest.ahead and newest.mode == DRAFT)
        model = self.sources[1]
        if drafting or newest.mode != REST:
            model.speculate(stop, SPECULATION_STEPS if drafting else 1, list(then) or _likely_verdict(newest))
        awaited.model_read = awaited.mode != REST or model.reading


def _loss(without: float, with_model: float, expected: float, gain: float) -> float:
    """ms a round loses by drafting with the model (gains, where negative): it takes `with_model` ms instead
    of `without` and commits 1 + expected + gain tokens instead of 1 + expected."""
    return with_model - without * (1 + expected + gain) / (1 + expected)


def _likely_verdict(rnd: _Round) -> list[int]:
    """The tokens of a round's merged tree's likeliest path, as far as it is more likely accepted than not
    (none for a tree sent ahead: the generation loop gives its likeliest path, `then`)."""
    merged = rnd.merged if not rnd.ahead else None
    path, parent = [], -1
    while merged:
        best = max((k for k, n in enumerate(merged) if n.parent == parent), default=None,
                   key=lambda k: merged[k].estimate)
        if best is None or merged[best].estimate < LIKELY:
            break
        path.append(merged[best].token)
        parent = best
    return path


def _origins(tree: DraftTree, committed: list[int]) -> list[int]:
    """For each node of `tree.after(committed)`, its index in `tree`."""
    return DraftTree(tree.tokens, tree.parents, notes=list(range(len(tree)))).after(committed).notes or []


def _parents_first(order: list[int], nodes: list[_Merged]) -> list[int]:
    """`order` with any node that came before its parent (a tie of estimates) moved just after it."""
    placed: set[int] = set()
    out: list[int] = []
    waiting: dict[int, list[int]] = {}
    for i in order:
        parent = nodes[i].parent
        if parent >= 0 and parent not in placed:
            waiting.setdefault(parent, []).append(i)
            continue
        stack = [i]
        while stack:
            j = stack.pop()
            out.append(j)
            placed.add(j)
            stack.extend(reversed(waiting.pop(j, [])))
    return out
