"""Whether the hybrid's drafting model earns the forwards it runs while the verifier checks a tree.

The model's tokens are worth a forward only where retrieval would not have proposed them: on a round's
accepted path, the nodes that only the model drafted (edge/hybrid.py). Where these are a small share of
what the rounds commit, the forwards cost more than they add: on a machine shared with the verifier they
may slow its pass (memory bandwidth); on an edge device they cost energy. On 39 Spec-Bench prompts (plain
text, Gemma 3 270M target, SmolLM2 drafting) the model alone drafted 3% of the committed tokens, 0-10% by
category (BENCHMARKS.md section 6, "The model speculates where it earns it").

What the forwards cost the verifier is measured, not assumed: each verdict's pass time (compute_ms) beside
the model's speculation against the latest pass of as many nodes verified (the verifier's own draft
included, where it filled the tree), in the same generation (a pass's time grows with the context), with
no forward beside it. The model must draft at least that share of the committed tokens alone (a pass
slower by 6% pays where 6% more tokens come out of it), and GAIN_FLOOR at least (the edge's energy).
Until the cost is measured it speculates as if it earned its share. While it does, it rests in one pass of
REMEASURE, so that there are passes alone to compare with. On separate machines the cost is nothing; on
the benchmarks' 2-core host it measured 4.5-7.5% (section 6, "What the model's forwards cost, pass by
pass"). The share is a mean over about the last fifty rounds it speculated
for: its tokens come in bursts (on separate machines, by timed replay, it drafted 3.5-6% of the tokens
alone, and the hybrid was 7.1% ahead of retrieval once its cost was measured and its share judged over
fifty rounds, level before: section 6, "The model's cost was never measured").

Below that share the model speculates in one pass of PROBE, which keeps measuring its share so that it comes
back where the text turns to what it drafts well; each probe that leaves it below doubles the wait for the
next, up to PROBE_MOST passes (a probe's pass is 7.5% slower, as any beside its speculation: probes in one
pass of four cost the passes about 2%, where the model drafted about 1% of the tokens alone in the rounds it
speculated for). In the pass before a probe it only reads the text committed since it last ran (one batched
forward), so that the probe's forwards start where the text is; in the others it runs no forward at all
(reading in every pass had cost the hybrid 1.3%, within one run's noise). Taking part in a generation
means reading its prompt first, batched forwards beside the verifier's prefill and first passes (a long
prompt's for seconds: summarization and rag lost 10% and 4% to retrieval with the model speculating in one
pass of four); most of what the model read beside the passes was prompts. So below its share it sits out
every generation but one in PROBE, and, as with passes, twice as many after each generation it took part in
that left it below, up to PROBE_MOST (in one run of 39 prompts sitting out all but one in four left the
hybrid 0.2% behind retrieval, where reading every prompt up to 512 tokens it had been 2.2% behind; on 130
prompts backing off was 0.8% ahead of one in four: BENCHMARKS.md section 6, "The resting model read beside
most passes" and "The run the last subsection asked for"). Where its forwards cost the passes nothing, neither
do probes: there it neither backs off nor sits out generations (`probes_free`).
"""

from __future__ import annotations

from enum import Enum

GAIN_FLOOR = 0.01  # the least share it must draft, where its forwards cost the verifier nothing (separate machines)
COST_WEIGHT = 0.05  # the newest pass's weight in the cost's moving average (a host's property: slow to change)
COSTED = 8  # passes beside its speculation, each against passes of its size without, before the cost counts
FRESH = 8  # passes: a pass alone older than this is not compared with (a pass's time grows with the context)
PROBE = 4  # below it, it speculates in one pass (and takes part in one generation) of this many at first,
PROBE_MOST = 32  # and in one of twice as many after each probe that leaves it below, up to this many
REMEASURE = 16  # while it earns its share, it rests in one pass of this many (its cost: a 16th of its share)
WEIGHT = 0.02  # the newest measured round's weight in the moving averages (about the last fifty rounds: the
# model's own tokens come in bursts, a few rounds in many; over ten rounds its share swung from 0 to 16%, and
# one low swing sat out a model that drafted 3.5-6% of the tokens, BENCHMARKS.md section 6)
WARM_UP = 8  # measured rounds before the share decides anything


class PassWork(Enum):
    """What the model does during one verifier pass."""

    SPECULATE = "speculate"  # read the committed text, then compute the logits the next tree's part is drafted from
    READ = "read"  # only read the committed text
    REST = "rest"  # no forward


class ModelWorth:
    def __init__(self) -> None:
        self.model_tokens = 0.0  # moving average per measured round: accepted tokens only the model drafted
        self.committed = 0.0  # moving average per measured round: tokens committed
        self.measured = 0
        self._in_a_row = 0  # passes it speculated in since the last it rested in
        self._probes = _Chances()  # passes it speculates in, while below its share
        self._generations = _Chances()  # generations it takes part in, while below its share
        self._alone_ms: dict[int, tuple[float, int]] = {}  # tree nodes -> (the latest pass of this generation with
        # no forward beside it, its index)
        self._passes = 0
        self.cost = 0.0  # moving average: how much slower a pass is beside the model's speculation (0.06: 6%)
        self.costed = 0  # passes that measured it

    @property
    def share(self) -> float:
        return self.model_tokens / self.committed if self.committed else 0.0

    def record(self, model_tokens: int, committed: int) -> None:
        """A verdict on a tree drafted after a pass the model speculated in."""
        self.measured += 1
        weight = max(WEIGHT, 1.0 / self.measured)  # the plain mean until it has WEIGHT's worth of rounds
        self.model_tokens += weight * (model_tokens - self.model_tokens)
        self.committed += weight * (committed - self.committed)

    def passed(self, nodes: int, compute_ms: float, work: PassWork | None) -> None:
        """A verdict's pass: the nodes it verified (with the verifier's own draft, where it filled the tree), the
        verifier's time, what the model did beside it (None: nothing, it did not take part)."""
        self._passes += 1
        if work is PassWork.READ or compute_ms <= 0:
            return
        alone, at = self._alone_ms.get(nodes, (None, 0))
        if work is not PassWork.SPECULATE:
            self._alone_ms[nodes] = compute_ms, self._passes
        elif alone is not None and self._passes - at <= FRESH:
            self.costed += 1
            weight = max(COST_WEIGHT, 1.0 / self.costed)
            self.cost += weight * (compute_ms / alone - 1.0 - self.cost)

    def begin(self) -> None:
        """A new generation: its passes run over another context than the last one's (a pass's time grows with
        the context), so none of those passes alone is compared with (mixing generations, the measurement
        had found the forwards free where logged passes showed them 5-7.5% dearer)."""
        self._alone_ms.clear()

    @property
    def gain_min(self) -> float:
        """The share of the committed tokens the model must draft alone to speculate in every pass."""
        return max(self.cost, GAIN_FLOOR)

    @property
    def earning(self) -> bool:
        """Whether it speculates in every pass (but one in REMEASURE). It does until what its forwards cost is
        measured: judged against a fixed 5% before that, a model worth its forwards on separate machines (3.5-6%
        of the tokens its own by timed replay, where they cost nothing) had sat out for good, its cost never
        measured (BENCHMARKS.md section 6, "The model's cost was never measured")."""
        return self.measured < WARM_UP or self.costed < COSTED or self.share >= self.gain_min

    @property
    def probes_free(self) -> bool:
        """Whether its forwards were measured to cost the verifier's passes nothing (below GAIN_FLOOR: separate
        machines). Then a probe costs nothing either: below its share it probes one pass of PROBE without backing
        off, and takes part in every generation. Backing off there, after summarization (where it drafts next
        to nothing) it had stayed out of qa and math_reasoning, where it gains 9-10% (by timed replay,
        BENCHMARKS.md section 6, "Where watching is free")."""
        return self.costed >= COSTED and self.cost < GAIN_FLOOR

    def this_pass(self) -> PassWork:
        """What the model does during the pass about to start (called once per pass)."""
        now = self._probes.take(self.earning, self.probes_free)
        if now and self._in_a_row + 1 < REMEASURE:
            self._in_a_row += 1
            return PassWork.SPECULATE
        if not now and self._probes.next_taken:  # the next pass probes
            return PassWork.READ
        self._in_a_row = 0
        return PassWork.REST

    def takes_part(self) -> bool:
        """Whether the model reads this generation's prompt and drafts in it (called once per generation):
        below its share in one generation of PROBE, then, as with passes, twice as few after each that
        leaves it below, up to PROBE_MOST (in every one where probes are free)."""
        return self._generations.take(self.earning or self.probes_free, self.probes_free)


class _Chances:
    """Chances (passes, generations) the model takes: every one while it earns its share; below it one in
    PROBE, and twice as few after each taken that leaves it below, up to PROBE_MOST (one in PROBE again
    where probes are free)."""

    def __init__(self) -> None:
        self.skipped = 0  # since the last taken
        self.every = PROBE

    def take(self, earning: bool, free: bool) -> bool:
        """Whether to take this chance."""
        now = earning or self.next_taken
        self.skipped = 0 if now else self.skipped + 1
        if earning or free:
            self.every = PROBE
        elif now:
            self.every = min(2 * self.every, PROBE_MOST)
        return now

    @property
    def next_taken(self) -> bool:
        """Whether the next chance is taken, below its share."""
        return self.skipped + 1 >= self.every
