"""Every verified node's hints from the target model, as a verifier computes them, for replays
(bench/replay.py and bench/gpu_projection.py, `--hints model`).

Computing them costs one real forward per pass on this CPU (the committed text's KV is kept between passes).
What a pass's hints are depends only on the committed text and the tree, so they are kept in a file
(`{runs stem}.model-hints-k{k}.json` beside the recorded runs) keyed by both: a replay whose drafter sends the
trees an earlier replay sent reads them instead, in seconds. A change to the drafter that must not change its
trees (a faster edge) is then timed at no model cost, and a change that does change them pays only for the
trees that are new.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from specedge.common.cache import locked
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import DEFAULT_HINTS_TOP_K, Hints
from specedge.common.params import SamplingParams


class ModelHints:
    """The target's hints on every node of a pass, computed once and cached by (committed text, tree)."""

    def __init__(self, model: str, cache: Path | None, top_k: int = DEFAULT_HINTS_TOP_K) -> None:
        """`cache`: the file to read and extend (None: nothing kept)."""
        self.model, self.cache, self.top_k = model, cache, top_k
        self.known: dict[str, list] = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
        self.computed = self.read = 0
        self._engine = None
        self._unsaved: dict[str, list] = {}

    @classmethod
    def beside(cls, runs: Path, model: str, top_k: int = DEFAULT_HINTS_TOP_K) -> ModelHints:
        return cls(model, runs.with_name(f"{runs.stem}.model-hints-k{top_k}.json"), top_k)

    def open(self, prompt_ids: list[int]) -> PromptHints:
        return PromptHints(self, prompt_ids)

    def at_prompt(self, prompt_ids: list[int]) -> Hints:
        """The hints a verifier sends at the prompt's positions (row j after prompt_ids[j]; cloud/prompt_hints.py),
        from the engine's prefill, cached as the passes' are. As on a verifier, positions whose KV the prefix cache
        held (a chat template's opening, from the prompts before) have no row: their rows are empty."""
        key = "prompt:" + hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16]
        if (known := self.known.get(key)) is not None:
            return Hints(*known)
        engine = self.engine()
        seq = engine.add_sequence(prompt_ids, SamplingParams(max_new_tokens=1), self.top_k, prompt_hints=True)
        try:
            (verdict,) = engine.step([(seq, DraftTree.empty())])
        finally:
            engine.release(seq)
        unknown = [[] for _ in range(verdict.prompt_hints_start)]
        hints = Hints(unknown + verdict.prompt_hints.ids, unknown + verdict.prompt_hints.probs)
        self._remember(key, hints)
        self.save()
        return hints

    def engine(self):
        if self._engine is None:
            from specedge.cloud.engine import Engine
            from specedge.cloud.model_registry import load_model

            self._engine = Engine.from_hf_model(load_model(self.model)[0], kv_pool_bytes=256 << 20)
        return self._engine

    def save(self) -> None:
        """Add what was computed since the last save to the file, with what other replays added meanwhile
        (under a lock, written atomically: replays may run side by side, or be interrupted)."""
        if self.cache is None or not self._unsaved:
            return
        with locked(self.cache.with_name(self.cache.name + ".lock")):
            on_file = json.loads(self.cache.read_text()) if self.cache.exists() else {}
            on_file.update(self._unsaved)
            tmp = self.cache.with_name(self.cache.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(on_file))
            os.replace(tmp, self.cache)
        self.known.update(on_file)
        self._unsaved = {}

    def _remember(self, key: str, hints: Hints) -> None:
        self.known[key] = self._unsaved[key] = [hints.ids, hints.probs]
        self.computed += 1


class PromptHints:
    """One prompt's passes, in order: `rows` for a tree hung off the committed text, then `commit`."""

    def __init__(self, owner: ModelHints, prompt_ids: list[int]) -> None:
        self.owner = owner
        self.committed = list(prompt_ids)
        self._prompt_digest = hashlib.sha1(json.dumps(prompt_ids).encode()).hexdigest()[:16]
        self._seq = None  # the engine's sequence, made at the first pass not in the cache

    def rows(self, tree: DraftTree) -> Hints:
        """The target's top k at the tree's root and at every node."""
        key = f"{self._prompt_digest}:{len(self.committed)}:{tree.tokens}:{tree.parents}"
        if (known := self.owner.known.get(key)) is not None:
            self.owner.read += 1
            return Hints(*known)
        from specedge.cloud.hints import top_k_hints

        engine = self.owner.engine()
        if self._seq is None:
            self._seq = engine.add_sequence(self.committed, SamplingParams(max_new_tokens=1 << 20))
        seq = self._seq
        (logits,) = engine.forward([(seq, tree)])
        # The committed tokens now have their KV: keep it (the next pass computes only what this one's verdict
        # commits), and free the tree's slots.
        seq.num_cached = len(seq.token_ids)
        engine.pool.truncate(seq.seq_id, seq.num_cached)
        engine.pool.commit(seq.seq_id, seq.token_ids)
        hints = top_k_hints(logits, self.owner.top_k)
        self.owner._remember(key, hints)
        return hints

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        if self._seq is not None:  # computed at its next forward, if there is one
            self._seq.token_ids.extend(tokens)

    def close(self) -> None:
        if self._seq is not None:
            self.owner.engine().release(self._seq)
            self._seq = None
        self.owner.save()
        if self.owner.computed:
            print(f"model hints: {self.owner.computed} passes computed, {self.owner.read} read from "
                  f"{self.owner.cache}", file=sys.stderr)
