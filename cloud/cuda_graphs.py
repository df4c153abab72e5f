"""CUDA graphs for the engine's forward pass: a step replayed as one graph instead of launched kernel by kernel.

Measured on an H200 (BENCHMARKS.md, section 9): eagerly, a one-token step of SmolLM2-135M takes ~19 ms, of
Llama-8B ~20 ms: ~50 small kernels per layer, each launched from Python, cost more than the GPU's work. A
graph launches them all at once.

A graph is tied to a step's shapes (its tokens, logits rows, and padded groups' sizes, cloud/padded_attention.py)
and to the addresses of its inputs: each captured shape keeps static input tensors, and a replay copies the
step's inputs into them first. A shape is captured the second time it is seen (a one-off shape is not worth
a capture), at most MAX_GRAPHS are kept (the least recently used dropped), and they share one memory pool,
which is safe because steps run one at a time and each output is copied out before the next replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from specedge.cloud.attention import StepBatch
from specedge.cloud.kv_pool import KVBlockPool

MAX_GRAPHS = 32
MAX_GRAPH_TOKENS = 1024  # larger steps (prefills) are compute-bound: launching costs nothing next to them

log = logging.getLogger(__name__)


def _inputs(batch: StepBatch, logits_rows: torch.Tensor) -> list[torch.Tensor]:
    tensors = [batch.input_ids, batch.positions, batch.new_slots, logits_rows]
    for g in batch.padded:
        tensors += g.tensors()
    return tensors


def shape_key(batch: StepBatch, logits_rows: torch.Tensor) -> tuple:
    return len(batch.input_ids), len(logits_rows), tuple(g.shape for g in batch.padded)


class _Graph:
    def __init__(self, forward, pool: KVBlockPool, batch: StepBatch, logits_rows: torch.Tensor, memory) -> None:
        static_groups = [g.clone() for g in batch.padded]
        self.batch = StepBatch(batch.input_ids.clone(), batch.positions.clone(), batch.new_slots.clone(), [],
                               static_groups)
        self.logits_rows = logits_rows.clone()
        side = torch.cuda.Stream()  # a warm-up pass off the capture (lazy library set-up must not be captured)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(self.batch, pool, self.logits_rows)
        torch.cuda.current_stream().wait_stream(side)
        for g in static_groups:
            g._bias.clear()  # masks must be computed inside the graph, from the static inputs, on each replay
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=memory):
            self.output = forward(self.batch, pool, self.logits_rows)

    def run(self, batch: StepBatch, logits_rows: torch.Tensor) -> torch.Tensor:
        for static, new in zip(_inputs(self.batch, self.logits_rows), _inputs(batch, logits_rows)):
            static.copy_(new, non_blocking=True)
        self.graph.replay()
        return self.output.clone()


class GraphedForward:
    """`runner.forward(batch, pool, logits_rows)`, replayed from CUDA graphs for the shapes that recur."""

    def __init__(self, forward, max_graphs: int = MAX_GRAPHS, max_tokens: int = MAX_GRAPH_TOKENS) -> None:
        self.forward = forward
        self.max_graphs = max_graphs
        self.max_tokens = max_tokens
        self.enabled = True
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: set[tuple] = set()
        self._memory = torch.cuda.graph_pool_handle()

    def __call__(self, batch: StepBatch, pool: KVBlockPool, logits_rows: torch.Tensor) -> torch.Tensor:
        if not self.enabled or batch.padded is None or len(batch.input_ids) > self.max_tokens:
            return self.forward(batch, pool, logits_rows)
        key = shape_key(batch, logits_rows)
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._seen:
                if len(self._seen) > 64 * self.max_graphs:
                    self._seen.clear()
                self._seen.add(key)
                return self.forward(batch, pool, logits_rows)
            try:
                graph = _Graph(self.forward, pool, batch, logits_rows, self._memory)
            except RuntimeError as e:  # a kernel that cannot be captured: run eagerly from now on, and say so
                log.warning("CUDA graphs off: capturing a step failed (%s); steps run eagerly", e)
                self.enabled = False
                torch.cuda.synchronize()
                return self.forward(batch, pool, logits_rows)
            self.graphs[key] = graph
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        return graph.run(batch, logits_rows)
