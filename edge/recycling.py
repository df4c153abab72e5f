"""Token Recycling on the edge: the verifier's hints (common/hints.py) kept as a next-token table, and draft
trees grown from it.

Every verified position tells what the target would say next after its token, and the edge gets those
rows for the root and every node it sent, accepted or not (Luo et al., "Turning Trash into Treasure",
keep the same table on the GPU next to the model). `RecyclingTable` keeps the newest row per token, and
per context of the last two tokens (more specific: read first where known).
`Recycler.grow` extends a draft best first with the table's rows: at every node, the row of its text's
ending offers children whose estimate is the node's path estimate times the calibrated probability of
the hint; a child that the draft already has keeps the higher estimate. Calibration (edge/calibration.py)
is per kind of row (by one token or by two): a hint's probability was the target's in another
context, so what it is worth here is learned from the verdicts.
"""

from __future__ import annotations

import heapq

import numpy as np

from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.edge.calibration import Calibration

CONTEXT = 2  # rows are also kept by the last 2 tokens, read first where known (3 measured no better)
MIN_PATH = 0.02  # no node below this estimated acceptance (the controller would not send it anyway)
MAX_CONTEXT_ROWS = 1 << 17  # rows kept by 2 tokens; the least recently updated half goes beyond this
# A fresh calibration's belief, per kind of row (by 1, 2 tokens), in shares of the hint's probability:
# replaying Spec-Bench summarization and rag with the model's hints, rows by one token were accepted at
# about half the rate their probability says, rows by two at about the rate it says.
PRIOR_SCALE = (0.5, 0.9)
JUDGED = 8  # the draft's best nodes whose estimates the table's rows correct (agreeing or not)
AGREEMENT = (0.1, 0.5)  # a row's probability for a judged node's token: under, between, over; or absent
JUDGE_PRIOR = 4.0  # a class's correction starts at 1 with this many nodes' worth of belief
_TOKEN_BITS = 20  # context keys pack tokens into one int, rows a hint's id with its probability byte into an
# int32: vocabularies up to 2**20 tokens (Gemma 3's is 2**18)
BUCKET = Calibration.buckets(np.arange(256) / 255).tolist()  # a hint's probability byte -> its calibration bucket


class RecyclingTable:
    """The newest hint row per token (a vocab x k array, allocated on first use) and per context of the
    last 2 tokens (bounded, least recently updated first out)."""

    def __init__(self, k: int) -> None:
        self.k = k
        # Rows packed one entry per hint, token id << 8 | probability byte (p * 255), -1 = none: a row is read
        # with one numpy call (a draft reads ~40 a round).
        self._rows: np.ndarray | None = None  # [V, k] by token
        self._slot: dict[int, int] = {}  # context key (_key) -> row of the array below
        self._context_rows = np.full((MAX_CONTEXT_ROWS, k), -1, dtype=np.int32)
        self._next_slot = 0
        self._free: list[int] = []
        self.tokens = 0  # tokens with a row

    def __len__(self) -> int:
        return self.tokens

    def update(self, contexts: list[tuple[int, ...]], hints: Hints) -> None:
        """Row r of `hints` was computed after a text ending in contexts[r] (its last tokens, at most
        CONTEXT, the row's own token last). Where a row is given twice, the later one stays."""
        k = self.k
        given = min(len(contexts), len(hints.ids))  # (a verdict may carry rows for fewer nodes than were sent)
        tokens = [context[-1] for context in contexts[:given]]
        if not tokens:
            return
        if set(map(len, hints.ids[:given])) == {k} and min(tokens) >= 0:  # every row full, as a verifier's
            known: range | list[int] = range(given)
            ids = np.array(hints.ids[:given], dtype=np.int64)
            probs = np.array(hints.probs[:given], dtype=np.float64)
        else:
            known = [r for r, (token, ids) in enumerate(zip(tokens, hints.ids)) if ids and token >= 0]
            if not known:
                return  # rows nobody computed (the replay's off-path nodes)
            ids = np.full((len(known), k), -1, dtype=np.int64)
            probs = np.zeros((len(known), k))
            for j, r in enumerate(known):  # one slice assignment per row: rows may be shorter than k
                row = hints.ids[r][:k]
                ids[j, : len(row)], probs[j, : len(row)] = row, hints.probs[r][: len(row)]
            tokens = [tokens[r] for r in known]
        fits = (ids >= 0) & (ids < 1 << _TOKEN_BITS)  # (no vocabulary is larger: an id beyond is dropped)
        probs = np.rint(np.minimum(np.maximum(probs, 0.0), 1.0) * 255).astype(np.int64)
        packed = np.where(fits, ids << 8 | probs, -1)
        if not fits.all():  # the ones that fit first, in their order
            packed = np.take_along_axis(packed, np.argsort(~fits, axis=1, kind="stable"), axis=1)
        packed = packed.astype(np.int32)
        self._grow_to(max(tokens) + 1)
        at = np.asarray(tokens)
        new = self._rows[at, 0] < 0
        if new.any():
            self.tokens += len({t for t, is_new in zip(tokens, new.tolist()) if is_new})
        self._rows[at] = packed
        for n in range(2, CONTEXT + 1):
            rows, slots = [], []
            for j, r in enumerate(known):
                key = _key(contexts[r][-n:]) if len(contexts[r]) >= n else None
                if key is None:
                    continue
                slot = self._slot.pop(key, None)  # re-inserted last: dicts keep insertion order
                self._slot[key] = slot = self._take_slot() if slot is None else slot
                rows.append(j), slots.append(slot)
            self._context_rows[slots] = packed[rows]

    def row(self, context: tuple[int, ...]) -> tuple[list[int], int] | None:
        """(hints, kind) of the row after a text ending in `context`: each hint packed as token id << 8 |
        probability byte, best first (-1: none); kind: how many of its last tokens the row was kept by, less
        one. None if there is none."""
        n = min(len(context), CONTEXT)
        while n > 1:
            slot = self._slot.get(_key(context[-n:]))
            if slot is not None:
                return self._context_rows[slot].tolist(), n - 1
            n -= 1
        token = context[-1]
        if self._rows is not None and 0 <= token < len(self._rows):
            row = self._rows[token].tolist()
            if row[0] >= 0:
                return row, 0
        return None

    def _grow_to(self, size: int) -> None:
        if self._rows is None or len(self._rows) < size:
            old = 0 if self._rows is None else len(self._rows)
            rows = np.full((max(size, 2 * old, 1024), self.k), -1, dtype=np.int32)
            if old:
                rows[:old] = self._rows
            self._rows = rows

    def _take_slot(self) -> int:
        if self._next_slot < MAX_CONTEXT_ROWS:
            self._next_slot += 1
            return self._next_slot - 1
        if not self._free:  # forget the older half (the least recently updated)
            for key in list(self._slot)[: MAX_CONTEXT_ROWS // 2]:
                self._free.append(self._slot.pop(key))
        return self._free.pop()


def _key(tokens: tuple[int, ...]) -> int | None:
    """One int for a context of tokens (its length in the top bits); None if a token does not fit."""
    if len(tokens) == 2:  # every context key, while CONTEXT is 2: unrolled (a draft makes ~60 a round)
        a, b = tokens
        return (2 << _TOKEN_BITS | a) << _TOKEN_BITS | b if 0 <= a < 1 << _TOKEN_BITS and 0 <= b < 1 << _TOKEN_BITS \
            else None
    key = len(tokens)
    for t in tokens:
        if not 0 <= t < 1 << _TOKEN_BITS:
            return None
        key = key << _TOKEN_BITS | t
    return key


class Recycler:
    """A RecyclingTable and its calibration. A grown draft's notes (DraftTree.notes) say, per node, what
    it took from the table: (cell: kind * 256 + probability byte, or -1; (class, estimate) for a judged
    draft node, or None)."""

    def __init__(self, k: int) -> None:
        self.table = RecyclingTable(k)
        self.calibration = [Calibration(scale) for scale in PRIOR_SCALE]  # by kind: rows by 1, 2 tokens
        # By kind: calibration bucket -> calibrated probability, non-decreasing (a bucket no higher than any
        # above it, so that a row's order is kept); None until read after the calibration moved.
        self._luts: list[list[float] | None] = [None] * len(PRIOR_SCALE)
        # Correcting the draft's own estimates: per class (row kind x agreement), the verdicts on judged nodes
        # against what their estimates expected.
        classes = len(PRIOR_SCALE) * (len(AGREEMENT) + 2)
        self._judged_accepted, self._judged_expected = np.zeros(classes), np.zeros(classes)

    def begin_generation(self) -> None:
        for calibration in self.calibration:
            calibration.generation.begin()
        self._luts = [None] * len(self.calibration)

    def grow(self, draft: DraftTree, context: list[int], max_nodes: int) -> tuple[DraftTree, list[int]]:
        """`draft` (best first, with estimates) extended by table rows; also, per node of the result, its
        index in `draft` (-1 for a node only the table proposed). `context` ends with the root token."""
        tokens, parents = list(draft.tokens), list(draft.parents)
        root_tail = tuple(context[-CONTEXT:])
        tails = _tails(root_tail, tokens, parents)  # each node's last CONTEXT tokens, its own last
        rows: dict[int, tuple | None] = {}  # node (-1: root) -> its table row, read once

        def row_of(node: int):
            if node not in rows:
                rows[node] = self.table.row(root_tail if node < 0 else tails[node])
            return rows[node]

        estimate, judged = self._judge(draft, row_of)
        cells = [-1] * len(tokens)
        depth = draft.depths()
        child_at = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
        luts = self._luts
        for kind, lut in enumerate(luts):
            if lut is None:
                luts[kind] = _monotone(self.calibration[kind].bucket_probs())
        best = max(lut[-1] for lut in luts)
        drafted = sorted(estimate, reverse=True)
        # Nothing at or below the max_nodes-th draft node's estimate can make the cut.
        floor = max(MIN_PATH, drafted[max_nodes - 1] if len(drafted) >= max_nodes else 0.0)

        # One heap, best first, of (-key, node, j): j = -1, a node whose row is not read yet, keyed by the
        # most its children could be worth; j >= 0, the j-th child in its row, keyed by its estimate. A
        # row's next child goes on the heap when the one before it comes off (if it can make the cut).
        heap = [(-best, -1, -1)] + [(-e * best, i, -1) for i, e in enumerate(estimate) if e * best > floor]
        heapq.heapify(heap)
        push, pop = heapq.heappush, heapq.heappop
        above, added = 0, 0  # draft nodes at least as good as the current entry; nodes the table added
        while heap:
            neg, node, j = pop(heap)
            while above < len(drafted) and drafted[above] >= -neg:
                above += 1
            if above + added >= max_nodes:
                break  # every further node would fall outside the best max_nodes
            row = row_of(node)
            if row is None:
                continue
            hints, kind = row
            if j + 1 < len(hints) and (hint := hints[j + 1]) >= 0:
                e = (1.0 if node < 0 else estimate[node]) * luts[kind][BUCKET[hint & 255]]
                if e > floor:
                    push(heap, (-e, node, j + 1))
            if j < 0:
                continue
            token, cell = hints[j] >> 8, kind * 256 + (hints[j] & 255)
            i = child_at.get((node, token))
            if i is not None:  # the draft has it: the table backs it too
                if cells[i] < 0:
                    cells[i] = cell
                estimate[i] = max(estimate[i], -neg)
                continue
            i = len(tokens)
            tokens.append(token)
            parents.append(node)
            estimate.append(-neg)
            cells.append(cell)
            depth.append(1 if node < 0 else depth[node] + 1)
            tails.append(((root_tail if node < 0 else tails[node]) + (token,))[-CONTEXT:])
            child_at[(node, token)] = i
            added += 1
            if -neg * best > floor:
                push(heap, (neg * best, i, -1))
        # Path estimates never grow downwards and ties go shallower first, so parents come first.
        order = sorted(range(len(tokens)), key=lambda i: (-estimate[i], depth[i], i))[:max_nodes]
        new = {old: k for k, old in enumerate(order)}
        drafted_nodes = len(draft)
        notes = [(cells[i], judged[i] if i < drafted_nodes else None) for i in order]
        tree = DraftTree([tokens[i] for i in order], [new[parents[i]] if parents[i] >= 0 else -1 for i in order],
                         accept_probs=[min(1.0, estimate[i]) for i in order], notes=notes)
        return tree, [i if i < drafted_nodes else -1 for i in order]

    def _judge(self, draft: DraftTree, row_of) -> tuple[list[float], list[tuple[int, float] | None]]:
        """The draft's estimates corrected by what the table says at their parents: a retrieval candidate
        the target gave a high probability there is likelier, one outside its top k less likely, by a
        factor learned per class. Returns the new path estimates and, per judged node, (class, its
        conditional estimate before the correction)."""
        old = list(draft.accept_probs or [0.0] * len(draft))
        ratio = ((self._judged_accepted + JUDGE_PRIOR) / (self._judged_expected + JUDGE_PRIOR)).tolist()
        estimate: list[float] = []
        judged: list[tuple[int, float] | None] = [None] * len(draft)
        for i, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
            above = 1.0 if parent < 0 else old[parent]
            cond = min(1.0, old[i] / above) if above > 0 else 0.0
            if i < JUDGED and (row := row_of(parent)) is not None:
                hints, kind = row
                p = next(((hint & 255) / 255 for hint in hints if hint >= 0 and hint >> 8 == token), None)
                agreement = 0 if p is None else 1 + sum(p >= edge for edge in AGREEMENT)
                judged[i] = (kind * (len(AGREEMENT) + 2) + agreement, cond)
                cond = min(1.0, cond * ratio[judged[i][0]])
            # A product of factors <= 1 down the path: never above the parent, so parents stay first.
            estimate.append(cond if parent < 0 else estimate[parent] * cond)
        return estimate, judged

    def observe(self, notes: list | None, reached: np.ndarray, accepted: np.ndarray) -> np.ndarray | None:
        """Learn from the verdict on a grown draft's nodes that were sent (their `notes`; `reached`/`accepted`
        per node: edge/calibration.py's reached_and_accepted). Returns which of them the table proposed
        (None: the draft was not grown)."""
        if notes is None:
            return None  # nothing of the table's was sent
        for (_, judged), was_reached, was_accepted in zip(notes, reached, accepted):
            if judged is not None and was_reached:
                self._judged_accepted[judged[0]] += was_accepted
                self._judged_expected[judged[0]] += judged[1]
        cells = np.asarray([cell for cell, _ in notes], dtype=np.int64)
        mine = reached & (cells >= 0)
        for kind, calibration in enumerate(self.calibration):
            of_kind = mine & (cells // 256 == kind)
            if of_kind.any():
                calibration.update(Calibration.buckets(cells[of_kind] % 256 / 255), accepted[of_kind])
                self._luts[kind] = None
        return cells >= 0

    def learn(self, context: list[int], tree: DraftTree, hints: Hints) -> None:
        """Record a verdict's hints: `context` is the committed text the tree hung off (its last token the
        root), row r of `hints` the target's top tokens at the root (r = 0) or at node r - 1."""
        root_tail = tuple(context[-CONTEXT:])
        self.table.update([root_tail] + _tails(root_tail, tree.tokens, tree.parents), hints)


    def learn_text(self, text: list[int], start: int, hints: Hints) -> None:
        """Record hints at positions of committed `text`: row j the target's top tokens after text[start + j]
        (rows beyond the text are dropped)."""
        end = min(start + len(hints), len(text))
        if start < 0 or end <= start:
            return
        contexts = [tuple(text[max(0, i - CONTEXT + 1) : i + 1]) for i in range(start, end)]
        self.table.update(contexts, Hints(hints.ids[: end - start], hints.probs[: end - start]))


def _monotone(probs: list[float]) -> list[float]:
    """`probs` with each lowered to the lowest at or above it."""
    for b in range(len(probs) - 2, -1, -1):
        probs[b] = min(probs[b], probs[b + 1])
    return probs


def _tails(root_tail: tuple[int, ...], tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's last CONTEXT tokens (the text up to the root, then its path), its own token last."""
    tails: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        tails.append(((root_tail if parent < 0 else tails[parent]) + (token,))[-CONTEXT:])
    return tails
