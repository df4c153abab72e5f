"""READER-style retrieval drafter: candidates from the context itself (prompt + output so far), from the
drafter's own earlier outputs, and from an optional long-term datastore, merged into one
frequency-weighted tree, best nodes first; where the verifier sends hints, the tree grows further from the
target's own recycled predictions (edge/recycling.py), under the same node budget."""

from __future__ import annotations

from collections import deque

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.common.hints import DEFAULT_HINTS_TOP_K, Hints
from specedge.common.params import SamplingParams
from specedge.common.session import StepResult
from specedge.common.tree_sizing import MAX_TREE_NODES
from specedge.edge.acceptance_model import AcceptanceModel
from specedge.edge.calibration import judged_by_text, reached_and_accepted
from specedge.edge.context_index import ContextIndex
from specedge.edge.datastore import Datastore
from specedge.edge.recycling import CONTEXT, Recycler
from specedge.edge.tree_builder import CandidateSet, build_draft

RECENCY = 0.97  # weight factor per more recent occurrence of the same match
SENT_WINDOW = 16  # rounds: a draft has at most GROW_SLACK more nodes than the most sent in any of them
GROW_SLACK = 16
STRONG_MATCH = 8  # a context match this long makes the long-term datastore's candidates unnecessary
HISTORY_TOKENS = 1 << 20  # earlier outputs remembered; the older half is forgotten beyond this


class RetrievalDrafter:
    def __init__(
        self,
        datastore: Datastore | None = None,
        max_nodes: int = MAX_TREE_NODES,
        max_depth: int = 16,
        occurrences: int = 32,
        model: AcceptanceModel | None = None,
        hints_top_k: int = DEFAULT_HINTS_TOP_K,
        history_tokens: int = HISTORY_TOKENS,
    ) -> None:
        """`hints_top_k`: hint tokens per position to ask the verifier for and draft from (0: none);
        `history_tokens`: earlier outputs remembered (the older half is forgotten beyond)."""
        self.datastore = datastore
        self.hints_top_k = hints_top_k
        self.recycler = Recycler(hints_top_k) if hints_top_k else None  # kept across generations, as `history`
        self.max_nodes, self.max_depth, self.occurrences = max_nodes, max_depth, occurrences
        self.model = model or AcceptanceModel()  # kept across generations: the edge keeps learning
        self.index = ContextIndex()
        self.history = ContextIndex()  # earlier generations' outputs, each followed by a separator (-1)
        self.history_tokens = history_tokens
        self._prompt_len = 0
        # (source, depth) -> [reached, accepted] over the nodes sent: where drafted tokens are won and lost
        # (source: retrieval, table, both); for reports, nothing reads it here.
        self.verdicts_by_source: dict[tuple[str, int], list[int]] = {}
        self._sent: deque[int] = deque(maxlen=SENT_WINDOW)  # nodes sent in the last rounds
        self._greedy = True  # the verdicts judge unsent nodes too (edge/calibration.py, judged_by_text)
        self._unlearned: tuple[DraftTree, StepResult] | None = None  # the last verdict, until `learn`

    def begin(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        self.learn()
        self.index = ContextIndex(prompt_ids)
        self._prompt_len = len(prompt_ids)
        self._greedy = params is None or params.greedy
        self.model.generation.begin()
        if self.recycler is not None:
            self.recycler.begin_generation()

    def candidates(self) -> CandidateSet:
        parts = []
        ends, lengths = self.index.matches(self.occurrences, max_len=32)
        if len(ends):
            weight = np.minimum(lengths, 32).astype(np.float64) ** 2 * RECENCY ** np.arange(len(ends))
            tokens = self.index.continuations(ends, self.max_depth)
            parts.append(CandidateSet(tokens, weight, lengths, np.zeros(len(ends), dtype=bool)))
        tail = self.index.tokens[max(0, self.index.n - 32) : self.index.n]
        past_ends, past_lengths = self.history.find(tail, self.occurrences, max_len=32, min_len=2)
        if len(past_ends):
            weight = np.minimum(past_lengths, 32).astype(np.float64) ** 2 * RECENCY ** np.arange(len(past_ends))
            tokens = self.history.continuations(past_ends, self.max_depth)
            parts.append(CandidateSet(tokens, weight, past_lengths, np.ones(len(past_ends), dtype=bool)))
        if self.datastore is not None and (len(lengths) == 0 or lengths.max() < STRONG_MATCH):
            match = self.datastore.longest_match(tail, max_len=32, max_occurrences=16)
            if match is not None:
                k = len(match.ends)
                weight = np.full(k, min(match.length, 32) ** 2 * min(match.count, 16) / k)
                tokens = self.datastore.continuations(match.ends, self.max_depth)
                parts.append(CandidateSet(tokens, weight, np.full(k, match.length), np.ones(k, dtype=bool)))
        return CandidateSet.concat(parts)

    def propose(self) -> DraftTree:
        # Every node costs drafting time: build no more than the controller has lately had use for (it may
        # take GROW_SLACK more each round when the drafts get better).
        cap = min(self.max_nodes, max(self._sent) + GROW_SLACK) if self._sent else self.max_nodes
        draft, stats = build_draft(self.candidates(), self.model, cap, self.max_depth)
        cells, priors = stats.cells.tolist(), stats.priors.tolist()  # each node's acceptance-model cell, prior
        table_notes = None
        if self.recycler is not None and len(self.recycler.table):
            draft, source = self.recycler.grow(draft, self._tail(CONTEXT), cap)
            cells = [cells[i] if i >= 0 else -1 for i in source]
            priors = [priors[i] if i >= 0 else 0.0 for i in source]
            table_notes = draft.notes
        # Per node: (its model cell, -1 where retrieval did not propose it; its prior; what it took from the table).
        draft.notes = list(zip(cells, priors, table_notes or [None] * len(draft)))
        return draft

    def observe(self, tree: DraftTree, result: StepResult) -> None:
        """Commit the verdict's tokens and keep its hints: the next draft needs both. What the verdict says of
        the drafts is learned by `learn`, which the generation loop calls while the next verdict is awaited
        (the edge's time between a verdict and its next draft is a round's time); here, what is still
        unlearned is learned first. So a draft's estimates are learned from every verdict but the last."""
        self.learn()
        self._sent.append(len(tree))
        self.learn_prompt_hints(result)
        if result.hints is not None:
            self.learn_hints(tree, result.hints)
        self.index.append(result.tokens)
        self._unlearned = tree, result

    def learn(self) -> None:
        """Learn from the last verdict observed, if not yet: the acceptance model from the nodes it judged,
        the recycling table's calibration from the table's nodes that were sent, the reports."""
        if self._unlearned is None:
            return
        tree, result = self._unlearned
        self._unlearned = None
        reached, accepted = reached_and_accepted(tree.parents, result.accepted)  # the verdict on the nodes sent
        if self._greedy:  # the committed text judges every node drafted, sent or not (judged_by_text)
            nodes = tree.drafted if tree.drafted is not None else tree
            was_reached, was_accepted = judged_by_text(nodes, result.tokens)
        else:
            nodes, was_reached, was_accepted = tree, reached, accepted
        if nodes.notes:  # (a tree not drafted here has no notes to learn by)
            cells = np.array([cell for cell, _, _ in nodes.notes], dtype=np.int64)
            priors = np.array([prior for _, prior, _ in nodes.notes])
            mine = was_reached & (cells >= 0)
            self.model.update(cells[mine], priors[mine], was_accepted[mine])
        if len(tree) and tree.notes is not None:  # what was sent: for the recycling table and the reports
            cells = np.array([cell for cell, _, _ in tree.notes], dtype=np.int64)
            table_notes = None if tree.notes[0][2] is None else [note for _, _, note in tree.notes]
            tabled = self.recycler.observe(table_notes, reached, accepted) if self.recycler is not None else None
            for node, depth in enumerate(tree.depths()):
                if reached[node]:
                    source = "retrieval" if tabled is None or not tabled[node] else "table"
                    source = "both" if source == "table" and cells[node] >= 0 else source
                    counts = self.verdicts_by_source.setdefault((source, depth), [0, 0])
                    counts[0] += 1
                    counts[1] += int(accepted[node])

    def learn_hints(self, tree: DraftTree, hints: Hints) -> None:
        """Keep the verifier's hints on `tree`, which hung off the last committed token (call before the
        verdict's tokens are committed)."""
        if self.recycler is not None:
            self.recycler.learn(self._tail(CONTEXT), tree, hints)

    def learn_prompt_hints(self, result: StepResult) -> None:
        """Keep the hints at the prompt's positions that the first verdict may carry (call before its tokens are
        committed: its rows follow the text so far)."""
        if self.recycler is not None and result.prompt_hints is not None:
            self.recycler.learn_text(self.index.tokens[: self.index.n].tolist(), result.prompt_hints_start,
                                     result.prompt_hints)

    def _tail(self, n: int) -> list[int]:
        return self.index.tokens[max(0, self.index.n - n) : self.index.n].tolist()

    def end(self) -> None:
        """Remember the output: later generations often repeat their predecessors' phrasing."""
        self.learn()
        output = self.index.tokens[self._prompt_len : self.index.n]
        if self.history.n + len(output) + 1 > self.history_tokens:
            self.history = ContextIndex(self.history.tokens[self.history.n // 2 : self.history.n])
        self.history.append(np.append(output, -1).tolist())
