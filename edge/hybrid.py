"""Retrieval and a drafting model in one tree (READER's point: their candidates complement each other).

Each source drafts best first with its own online-calibrated acceptance estimates; the hybrid merges the
two trees as a trie (a path both propose is one node, estimated by the more confident source) and orders
the nodes by estimate, so the controller's expected-value rule picks the nodes worth a pass from either
source under one node budget. Sorting by estimate keeps each source's nodes in the source's own order, so
any prefix of the merged tree holds a prefix of each source's draft, and each source learns from the
verdict on the nodes of its own that were sent (retrieval, in a greedy generation, from all of its nodes:
the committed text judges the unsent ones too, so what it learns in a round does not depend on what the
model's nodes left out).

The model's part of every tree is what it computed while the verifier checked the tree before: during the
pass it reads what the verdict most likely commits (the merged tree's path as far as it is more likely
accepted than not: retrieval's runs to tens of tokens where it is confident; over a long round trip, the
likeliest path of the tree ahead in flight) and computes the logits after the likeliest continuations and
bonus tokens beyond it (ModelDrafter.speculate). After the verdict it drafts from those logits alone
(ModelDrafter.propose with `known_only`) and runs no forward, so the model never delays a tree: a serial
round's tree goes out as soon as the verdict is in, and a tree sent ahead (edge/generation.py) reaches the
verifier before the pass in flight ends. Where the verdict ended somewhere the model did not compute beyond,
the tree is retrieval's own, unmerged, and its verdict goes to retrieval as it came: on a fast verifier that
is nearly every round, and merging and asking the model had cost each such round's critical path 0.45 ms
(BENCHMARKS.md section 6, "Nothing merged where the model drafted nothing"). Drafting after the verdict cost
more than its tokens saved (BENCHMARKS.md section 8): the verifier sat idle while the model drafted (at 0
ms, serial rounds), or the tree ahead came late (at 80 ms); earlier versions therefore weighed, round by
round, what the model's drafting added against its time. With no time after the verdict to weigh, the
controller's rule over the merged nodes is the whole decision. What remains is the model's work beside the
verifier's pass: nothing where edge and verifier are separate machines, and on one machine shared with the
verifier it may slow the pass (memory bandwidth); the benchmarks' figures include it. The hybrid measures
that cost from the verdicts' pass times, and where the model's own accepted tokens are too few to pay for it
(or for the edge's energy), the model speculates in one pass of a few only and sits out most generations
(edge/model_worth.py).

In a generation the model sits out, the hybrid is retrieval alone, passing every call on to it.

A tree sent ahead hangs below the likeliest path of the tree in flight (`propose_after`): retrieval's part
is its draft beyond the path, the model's what it computed beyond it. The hybrid keeps each tree's round
apart until its verdict, and traces the verdict on what was left of the tree (DraftTree.after) to each
source's nodes by the tree's notes.

Sampled drafts: a node keeps the model's proposal q (its children are the model's draws, checked by
rejection sampling) only where retrieval proposes nothing; where it does, all children there are checked
as deterministic candidates. Which rule a node gets must not depend on what the model drew there (that
would bias rejection sampling), so it is decided from the retrieval draft alone. Both rules are lossless.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.edge.model_drafter import ModelDrafter
from specedge.edge.model_worth import ModelWorth, PassWork
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
    merged: list[_Merged]  # the tree's nodes (its notes); none where the tree is retrieval's alone
    tree: DraftTree  # the tree drafted
    ahead: bool  # drafted while another tree was in flight, to go out ahead of its verdict
    path: list[int]  # target ids it hangs below then: the likeliest path of the tree in flight
    retrieval_at_root: bool = False  # retrieval's draft has children at the root
    since: list[int] = field(default_factory=list)  # tokens committed after it was drafted
    speculated: bool = False  # drafted after a pass the model speculated in (ModelWorth measures those)
    beside: PassWork | None = None  # what the model did while this tree's verdict was awaited (None: nothing)


LIKELY = 0.5  # a path the verdict more likely commits than not: the model reads it during the pass


class HybridDrafter:
    def __init__(self, retrieval: RetrievalDrafter, model: ModelDrafter, max_nodes: int) -> None:
        self.sources = (retrieval, model)
        self.max_nodes = max_nodes
        self._pending: deque[_Round] = deque()  # drafted, verdict not yet observed, oldest first
        self.worth = ModelWorth()  # kept across generations, as the sources' calibrations are
        self._speculated = False  # the model speculated in the pass since the last tree was drafted
        self._model_on = True  # the model takes part in this generation (ModelWorth.takes_part)
        self._first_verdict = True  # no verdict yet in this generation

    @property
    def hints_top_k(self) -> int:
        """The verifier's hints feed retrieval's recycling table (edge/recycling.py)."""
        return self.sources[0].hints_top_k

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self._pending.clear()
        self._first_verdict = True
        self._speculated = False
        self.worth.begin()
        self._model_on = self.worth.takes_part()
        for source in self._taking_part():
            source.begin(prompt_ids, params)

    def _taking_part(self) -> tuple[RetrievalDrafter] | tuple[RetrievalDrafter, ModelDrafter]:
        return self.sources if self._model_on else self.sources[:1]

    # In a generation the model sits out, retrieval's calls pass straight through. Merging one source's draft
    # had reordered its nodes and sent trees ahead below the path in flight, where retrieval resends its whole
    # draft: at 80 ms the hybrid was about 3% behind its own pass-through (BENCHMARKS.md section 6, "Where the
    # model sits out, the hybrid is retrieval alone").

    def propose(self) -> DraftTree:
        # Nothing is in flight when the generation loop asks for a tree here: a tree drafted ahead that the
        # controller held back was never sent, and its verdict will not come.
        self._pending.clear()
        if not self._model_on:
            return self.sources[0].propose()
        return self._draft([], ahead=False)

    @property
    def propose_after(self) -> Callable[[list[int]], DraftTree] | None:
        """Drafting below a path, for trees sent ahead (edge/generation.py), where the model takes part in the
        generation; None where it sits out (retrieval alone does not draft below paths)."""
        return self._propose_after if self._model_on else None

    def _propose_after(self, path: list[int]) -> DraftTree:
        """A tree hanging below `path` (target ids), to send ahead of a verdict that most likely commits it:
        each source's part is what it drafts beyond the path."""
        return self._draft(list(path), ahead=True)

    def _draft(self, path: list[int], ahead: bool) -> DraftTree:
        retrieval, model = self.sources
        # (Without a speculation since the last tree the model computed nothing to draft from, and asking costs
        # a round the re-tokenising of the committed text, which the next speculation does beside a pass.)
        model_draft = model.propose_after(path, known_only=True) if self._speculated else DraftTree.empty()
        retrieval_draft = retrieval.propose().after(path)
        rnd = _Round((retrieval_draft, model_draft), [], retrieval_draft.prefix(self.max_nodes), ahead, path,
                     speculated=self._speculated)
        self._speculated = False
        self._pending.append(rnd)
        if not len(model_draft):
            # Retrieval's own tree, its own notes: merging one source's nodes only costs the round's critical
            # path time (0.12 ms of each round's drafting, by timed replay: BENCHMARKS.md section 6).
            return rnd.tree
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
        rnd.tree = tree
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
        if not self._model_on:
            self.sources[0].observe(tree, result)
            return
        rnd = self._pending.popleft()
        if not self._first_verdict:  # the first's pass computes the prompt too
            verified = len(tree) if result.verified_nodes is None else result.verified_nodes  # the verifier's fill too
            self.worth.passed(verified, result.compute_ms, rnd.beside)
        self._first_verdict = False
        for later in self._pending:
            later.since += result.tokens
        beyond = rnd.since[len(rnd.path) :]
        if rnd.since[: len(rnd.path)] != rnd.path:  # the verdict before did not commit the path: nothing was left
            for source in self._taking_part():
                source.observe(DraftTree.empty(), replace(result, accepted=[], hints=None))
            return
        if rnd.speculated:  # (a tree of retrieval's alone has none of the model's nodes)
            model_tokens = sum(0 not in tree.notes[k].where for k in result.accepted) if rnd.merged else 0
            self.worth.record(model_tokens, len(result.tokens))
        if not rnd.merged:  # the tree was retrieval's alone (or empty): its verdict is retrieval's
            retrieval, model = self.sources
            retrieval.observe(tree, result)
            model.observe(DraftTree.empty(), replace(result, accepted=[], hints=None))
            return
        if result.prompt_hints is not None:  # (older than the tree's rows: kept first)
            self.sources[0].learn_prompt_hints(result)
            result = replace(result, prompt_hints=None)
        if result.hints is not None:  # rows for the merged tree's nodes, the model's included
            self.sources[0].learn_hints(tree, result.hints)
        for number, (source, whole) in enumerate(zip(self._taking_part(), rnd.drafts)):
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

    def learn(self) -> None:
        """Retrieval learns from the last verdict while the next is awaited (RetrievalDrafter.learn)."""
        self.sources[0].learn()

    def end(self) -> None:
        for source in self.sources:
            source.end()

    def speculate(self, stop: Callable[[], bool], then: list[int] = ()) -> None:
        """`then`: over a long round trip, the likeliest path of the tree ahead in flight (target ids), where
        the next draft starts (edge/generation.py)."""
        # Retrieval has nothing to compute ahead, only the last verdict to learn from (RetrievalDrafter.learn).
        self.sources[0].learn()
        if not self._pending or not self._model_on:
            return
        model = self.sources[1]
        work = self.worth.this_pass()
        if work is PassWork.SPECULATE:  # the model computes what the next tree's part will be drafted from
            model.speculate(stop, then=list(then) or _likely_verdict(self._pending[0]))
            self._speculated = True
        elif work is PassWork.READ:  # it reads the committed text, ready for the pass it speculates in next
            model.speculate(stop, steps=0)
        # A prompt or a backlog read in the background is a forward beside any pass.
        self._pending[0].beside = PassWork.READ if getattr(model, "reading", False) else work


def _likely_verdict(rnd: _Round) -> list[int]:
    """The tokens of a round's tree's likeliest path, as far as it is more likely accepted than not (none for a
    tree sent ahead: the generation loop gives its likeliest path, `then`)."""
    tree = rnd.tree
    if rnd.ahead or not tree.accept_probs:
        return []
    path = []
    for node in tree.likeliest_path():
        if tree.accept_probs[node] < LIKELY:
            break
        path.append(tree.tokens[node])
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
