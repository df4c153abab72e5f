"""The verifier engine: runs the new tokens of many sequences in one forward pass and commits verdicts.

A sequence's committed tokens all have KV in the pool except the trailing uncomputed ones (the whole
prompt before prefill, the last committed token afterwards). A step feeds those plus the draft tree that
hangs off the last committed token, so prefill, plain decoding and tree verification are one operation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from specedge.cloud.acceptance import Verdict, verify_tree
from specedge.cloud.attention import SeqSlice, StepBatch
from specedge.cloud.cuda_graphs import GraphedForward
from specedge.cloud.greedy_readback import GreedyReadback
from specedge.cloud.hints import top_k_hints
from specedge.cloud.kv_pool import KVBlockPool
from specedge.cloud.models import build_runner
from specedge.cloud.prompt_hints import PendingPromptHints, candidates
from specedge.cloud.sampling import Draws
from specedge.cloud.tree_mask import step_mask
from specedge.common.draft_tree import DraftTree
from specedge.common.hints import Hints
from specedge.common.params import SamplingParams


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt + committed output
    prompt_len: int
    params: SamplingParams
    draws: Draws
    num_cached: int  # leading tokens whose KV is in the pool
    hints_top_k: int = 0  # > 0: every verdict carries this many hint tokens per computed position
    prompt_hints: PendingPromptHints | None = None  # asked for and not yet sent with the first verdict

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


class Engine:
    def __init__(self, runner, pool: KVBlockPool, cuda_graphs: bool = True) -> None:
        self.runner = runner
        self.pool = pool
        self.vocab_size = runner.vocab_size
        self.device = runner.embed.device
        # On a GPU, recurring step shapes replay as CUDA graphs (cloud/cuda_graphs.py); `graphs.enabled` turns
        # them off and on.
        self.graphs = GraphedForward(runner.forward) if cuda_graphs and self.device.type == "cuda" else None
        self._forward = self.graphs or runner.forward
        # Off the CPU, greedy sessions' verdict rows and hints are computed from the step's logits where they
        # lie and read back in one transfer (compiled where the layers are); on the CPU they come from the
        # output layer's int8 argmax (`_verdict_rows`). Tests switch it on the CPU to check its arithmetic.
        self.read_back_logits = self.device.type != "cpu"
        self.readback = GreedyReadback(compiled=runner.parts.compiled)
        # Sampling sessions' hints from one top-k over all their rows: off the CPU (one transfer instead of one
        # per session); on the CPU each session's rows are read where they are, without copying them together.
        self.batch_hints = self.device.type != "cpu"
        self._ids = itertools.count()

    @classmethod
    def from_hf_model(cls, hf_model, kv_pool_bytes: int, block_size: int = 16, device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None, compile_layers: bool = False) -> "Engine":
        """The engine of `hf_model` moved to `device` (and cast to `dtype`, None = as it is), KV pool included;
        `compile_layers`: its layers' dense parts through torch.compile (not the CPU's packed float32 ones)."""
        hf_model.to(device=device, dtype=dtype)
        runner = build_runner(hf_model)
        if compile_layers:
            runner.compile()
        pool = KVBlockPool(
            kv_pool_bytes, block_size, runner.num_layers, runner.num_kv_heads, runner.head_dim,
            dtype=runner.embed.dtype, device=runner.embed.device,
        )
        return cls(runner, pool)

    @property
    def compiled(self) -> bool:
        """Whether the runner's layers run through torch.compile (from_hf_model's compile_layers)."""
        return self.runner.parts.compiled

    def add_sequence(self, prompt_ids: list[int], params: SamplingParams, hints_top_k: int = 0,
                     prompt_hints: bool = False) -> Sequence:
        """`hints_top_k` > 0: every verdict carries hints (common/hints.py); with `prompt_hints` the first
        verdict also carries them at every prompt position the prefill computes (cloud/prompt_hints.py)."""
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if max(prompt_ids) >= self.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        seq_id = next(self._ids)
        num_cached = self.pool.open(seq_id, prompt_ids)
        pending = PendingPromptHints(num_cached, candidates(prompt_ids, self.vocab_size)) \
            if prompt_hints and hints_top_k else None
        return Sequence(seq_id, list(prompt_ids), len(prompt_ids), params, Draws.for_seed(params.seed), num_cached,
                        hints_top_k, pending)

    def release(self, seq: Sequence) -> None:
        self.pool.close(seq.seq_id)

    def step(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]] = ()
             ) -> list[Verdict]:
        """One forward pass over every sequence's uncomputed tokens plus its draft tree, and over the next
        `n` prompt tokens of each (sequence, n) in `chunks` (a long prefill split across steps: no verdict,
        at least its last prompt token left for the step that verifies its tree); commit verdicts."""
        verdicts = []
        rows, hints = self._verdict_rows(work, chunks)
        for (seq, tree), (logits, argmax), seq_hints in zip(work, rows, hints):
            verdict = verify_tree(tree, logits, seq.params, seq.draws, len(seq.token_ids), argmax)
            verdict.hints = seq_hints
            if seq.prompt_hints is not None:  # the prefill is done: its rows go with this verdict
                verdict.prompt_hints, verdict.prompt_hints_start = seq.prompt_hints.hints, seq.prompt_hints.start
                seq.prompt_hints = None
            self.commit(seq, tree, verdict)
            verdicts.append(verdict)
        for seq, n in chunks:
            seq.num_cached += n
            self.pool.commit(seq.seq_id, seq.token_ids[: seq.num_cached])
        return verdicts

    def forward(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]] = ()
                ) -> list[torch.Tensor]:
        """Logits [1 + len(tree), V] per sequence of `work`, on the engine's device: at the tree root (last
        committed token) and each node; `chunks` compute KV only.

        Every sequence must be committed (see `commit`) before its next forward.
        """
        logits = self._logits(work, chunks)
        return list(logits.split([len(tree) + 1 for _, tree in work])) if work else []

    def _logits(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]]
                ) -> torch.Tensor | None:
        """`forward`'s logits as one tensor [rows, V], the sequences' rows in order (None without work)."""
        if not work and not chunks:
            return None
        batch, logits_rows = self._device_batch(work, chunks)
        return self._forward(batch, self.pool, logits_rows)

    def _verdict_rows(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]]
                      ) -> tuple[list[tuple[torch.Tensor | None, torch.Tensor | None]], list[Hints | None]]:
        """The pass: per sequence of `work`, (logits, argmax) on the CPU for its verdict, and its hints. On the
        CPU a greedy sequence gets its rows' argmax alone, from the output layer's int8 argmax
        (cloud/int8_argmax.py), and its hints from the same (`OutputLayer.argmax_and_hints`); a sampling one
        gets logits. Off the CPU, see `_read_back`. Prompt rows asked for are kept on their sequences."""
        if not work and not chunks:
            return [], []
        asking = self._prompt_hint_rows(work, chunks)
        batch, rows = self._device_batch(work, chunks, asking)
        if self.read_back_logits and not asking:
            logits = self._forward(batch, self.pool, rows)
            return self._read_back(work, logits) if work else ([], [])
        hidden = self.runner.hidden(batch, self.pool, rows)
        if asking:
            hidden = self._keep_prompt_hints(hidden, asking)
        if not work:
            return [], []
        if self.read_back_logits:
            return self._read_back(work, self.runner.lm_head.logits(hidden))
        hidden = hidden.split([len(tree) + 1 for _, tree in work])
        head = self.runner.lm_head
        pairs: list = [None] * len(work)
        hints: list[Hints | None] = [None] * len(work)
        groups: dict[int | None, list[int]] = {}  # greedy sessions by their hints' k (0: none), None: sampling
        for i, (seq, _) in enumerate(work):
            groups.setdefault(seq.hints_top_k if seq.params.greedy else None, []).append(i)
        for k, members in groups.items():
            rows, sizes = torch.cat([hidden[i] for i in members]), [len(hidden[i]) for i in members]
            if k is None:
                logits = head.logits(rows).split(sizes)
                for i, seq_logits in zip(members, logits):
                    pairs[i] = seq_logits, None
                for i, seq_hints in zip(members, self._hints([work[i] for i in members], list(logits))):
                    hints[i] = seq_hints
                continue
            argmax, together = head.argmax_and_hints(rows, k) if k else (head.argmax(rows), None)
            at = 0
            for i, seq_argmax in zip(members, argmax.split(sizes)):
                pairs[i] = None, seq_argmax
                if together is not None:
                    hints[i] = Hints(together.ids[at : at + len(seq_argmax)], together.probs[at : at + len(seq_argmax)])
                at += len(seq_argmax)
        return pairs, hints

    def _device_batch(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]],
                      prompt_rows: list[tuple[Sequence, np.ndarray]] = ()) -> tuple[StepBatch, torch.Tensor]:
        """The step's batch and its logits rows, on the engine's device, then `prompt_rows`' rows."""
        for seq, n in chunks:
            if not 0 < n < len(seq.token_ids) - seq.num_cached:
                raise ValueError(f"a prefill chunk of {n} tokens must leave the last of the "
                                 f"{len(seq.token_ids) - seq.num_cached} uncomputed ones for the verdict")
        batch, logits_rows = self._host_batch(work, chunks)
        if prompt_rows:
            logits_rows = torch.cat([logits_rows] + [torch.from_numpy(rows) for _, rows in prompt_rows])
        return batch.to(self.device, logits_rows)

    @staticmethod
    def _prompt_hint_rows(work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]]
                          ) -> list[tuple[Sequence, np.ndarray]]:
        """Per sequence whose prompt hints are asked for, the batch rows of the prompt tokens this step
        computes: a chunk's every token, a verdict's every uncomputed one but the root (its row is the
        verdict's). In the order of `_build_batch`'s rows."""
        asking, start = [], 0
        for i, (seq, tree, chain) in enumerate(Engine._step_items(work, chunks)):
            root = int(i < len(work))
            if seq.prompt_hints is not None and chain > root:
                asking.append((seq, np.arange(start, start + chain - root)))
            start += chain + len(tree)
        return asking

    def _keep_prompt_hints(self, hidden: torch.Tensor, asking: list[tuple[Sequence, np.ndarray]]) -> torch.Tensor:
        """Add the prompt rows at the end of `hidden` to their sequences' pending prompt hints; the rest."""
        head = self.runner.lm_head
        at = len(hidden) - sum(len(rows) for _, rows in asking)
        rest = hidden[:at]
        for seq, rows in asking:
            seq.prompt_hints.add(hidden[at : at + len(rows)], head.weight, seq.hints_top_k, head.softcap,
                                 seq.params.temperature)
            at += len(rows)
        return rest

    def _host_batch(self, work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]] = ()
                    ) -> tuple[StepBatch, torch.Tensor]:
        """The step's batch, built on the host once its sequences' KV slots are reserved, and the rows of
        its logits to keep."""
        items = self._step_items(work, chunks)
        for seq, tree, chain in items:
            self.pool.reserve(seq.seq_id, seq.num_cached + chain + len(tree))
        return self._build_batch(items, logits_for=len(work))

    @staticmethod
    def _step_items(work: list[tuple[Sequence, DraftTree]], chunks: list[tuple[Sequence, int]]
                    ) -> list[tuple[Sequence, DraftTree, int]]:
        """(sequence, tree, uncomputed tokens to feed before it) per item of a step, in the batch's order."""
        return [(seq, tree, len(seq.token_ids) - seq.num_cached) for seq, tree in work] + \
            [(seq, DraftTree.empty(), n) for seq, n in chunks]

    def _hints(self, work: list[tuple[Sequence, DraftTree]], logits: list[torch.Tensor]) -> list[Hints | None]:
        """The hints of each sequence that asked for them, from its rows where they lie. Off the CPU the
        sequences that ask with the same k and temperature share one top-k over all their rows, so that a
        step brings hints back in one transfer instead of one per session."""
        hints: list[Hints | None] = [None] * len(work)
        asking: dict[tuple, list[int]] = {}
        for i, (seq, _) in enumerate(work):
            if seq.hints_top_k:
                key = (seq.hints_top_k, seq.params.temperature) + (() if self.batch_hints else (i,))
                asking.setdefault(key, []).append(i)
        for members in asking.values():
            seq = work[members[0]][0]
            rows = logits[members[0]] if len(members) == 1 else torch.cat([logits[i] for i in members])
            together = top_k_hints(rows, seq.hints_top_k, seq.params.temperature)
            at = 0
            for i in members:
                n = len(logits[i])
                hints[i] = Hints(together.ids[at : at + n], together.probs[at : at + n])
                at += n
        return hints

    def _read_back(self, work: list[tuple[Sequence, DraftTree]], logits: torch.Tensor
                   ) -> tuple[list[tuple[torch.Tensor | None, torch.Tensor | None]], list[Hints | None]]:
        """`_verdict_rows` from the step's logits [rows, V] where they lie (off the CPU). Greedy sessions get
        their rows' argmax and hints in one transfer for all of them (at a 128k vocabulary a row of logits is
        0.5 MB); sampling sessions get their logits in float32, in one more."""
        sizes = [len(tree) + 1 for _, tree in work]
        per_session = logits.split(sizes)
        pairs: list = [None] * len(work)
        hints: list[Hints | None] = [None] * len(work)
        greedy = [i for i, (seq, _) in enumerate(work) if seq.params.greedy]
        if greedy:
            rows = logits if len(greedy) == len(work) else torch.cat([per_session[i] for i in greedy])
            back = self.readback(rows, max(work[i][0].hints_top_k for i in greedy))
            at = 0
            for i in greedy:
                seq, end = work[i][0], at + sizes[i]
                pairs[i] = None, back.argmax(at, end)
                hints[i] = back.hints(at, end, seq.hints_top_k) if seq.hints_top_k else None
                at = end
        sampling = [i for i, (seq, _) in enumerate(work) if not seq.params.greedy]
        if sampling:
            full = torch.cat([per_session[i] for i in sampling]).float().cpu().split([sizes[i] for i in sampling])
            for i, seq_logits in zip(sampling, full):
                pairs[i] = seq_logits, None
            asked = self._hints([work[i] for i in sampling], [per_session[i] for i in sampling])
            for i, seq_hints in zip(sampling, asked):
                hints[i] = seq_hints
        return pairs, hints

    def _build_batch(self, items: list[tuple[Sequence, DraftTree, int]], logits_for: int
                     ) -> tuple[StepBatch, torch.Tensor]:
        """The pass over `chain` uncomputed tokens and the tree of each (sequence, tree, chain); logits rows
        for the first `logits_for` items (the root, at the chain's last token, and each tree node)."""
        ids, positions, new_slots, seqs, logits_rows = [], [], [], [], []
        start = 0
        for i, (seq, tree, chain) in enumerate(items):  # numpy, not torch: ~5x less overhead per small array
            cached = seq.num_cached
            n = chain + len(tree)
            pos = np.concatenate([np.arange(cached, cached + chain),
                                  np.asarray(tree.depths(), dtype=np.int64) + (cached + chain - 1)])
            ids += seq.token_ids[cached : cached + chain]
            ids += tree.tokens
            positions.append(pos)
            ctx_slots = self.pool.slots(seq.seq_id, 0, cached + n)
            new_slots.append(ctx_slots[cached:])
            seqs.append(
                SeqSlice(
                    start=start,
                    end=start + n,
                    ctx_slots=ctx_slots,
                    mask=step_mask(cached, chain, tree),
                    query_pos=torch.from_numpy(pos),
                    key_pos=torch.from_numpy(np.concatenate([np.arange(cached), pos])),
                    causal_rows=chain,
                )
            )
            if i < logits_for:
                logits_rows.append(np.arange(start + chain - 1, start + n))
            start += n
        batch = StepBatch(torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.concatenate(positions)),
                          torch.cat(new_slots), seqs)
        rows = torch.from_numpy(np.concatenate(logits_rows)) if logits_rows else torch.empty(0, dtype=torch.long)
        return batch, rows

    def commit(self, seq: Sequence, tree: DraftTree, verdict: Verdict) -> None:
        """Append the verdict's tokens; keep the KV of the root and accepted path in order, free the rest."""
        base = len(seq.token_ids)  # slot of the first tree node
        if verdict.accepted:
            src = torch.tensor(verdict.accepted, dtype=torch.long) + base
            dst = torch.arange(base, base + len(verdict.accepted))
            moved = src != dst
            if bool(moved.any()):
                slots = self.pool.slots(seq.seq_id, 0, base + len(tree))
                self.pool.move(slots[src[moved]], slots[dst[moved]])
        seq.num_cached = base + len(verdict.accepted)
        seq.token_ids.extend(verdict.tokens)
        self.pool.truncate(seq.seq_id, seq.num_cached)
        self.pool.commit(seq.seq_id, seq.token_ids[: seq.num_cached])
