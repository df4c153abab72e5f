"""A prompt's prefill on the CPU, its chain's attention by this project's kernel (causal blocks, cloud/avx2_attention.py)
against torch's (SDPA's flash kernel for a fresh prompt, masked products after a cached prefix): the whole step and its
attention alone, prefills of the two interleaved, medians. Spec-Bench summarization prompts, the chat template where the
model has one; `--cached N`: the prompt after N tokens of another prompt already in the pool's prefix cache.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python bench/prefill_bench.py --cached 0,256,512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specedge.bench import specbench
from specedge.cloud import attention, avx2_attention
from specedge.cloud.engine import Engine
from specedge.cloud.model_registry import load_model
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.tokenizer import EdgeTokenizer

PATHS = ("kernel", "torch")


class AttentionClock:
    """Seconds spent in `paged_attention` (wrapped where the model modules call it) since the last `reset`."""

    def __init__(self) -> None:
        import specedge.cloud.models.gemma3 as gemma3
        import specedge.cloud.models.llama as llama

        self.seconds = 0.0
        for module in (llama, gemma3):
            real = module.paged_attention

            def timed(*args, _real=real, **kwargs):
                start = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            module.paged_attention = timed

    def reset(self) -> None:
        self.seconds = 0.0


def prefill(engine: Engine, prefix: list[int], prompt: list[int], path: str, clock: AttentionClock
            ) -> tuple[float, float, int]:
    """(step s, attention s, the first token) of prefilling `prompt` after `prefix`, cached beforehand, by `path`."""
    engine.pool.drop_cached()
    if prefix:
        seq = engine.add_sequence(prefix + [prompt[0]], SamplingParams(max_new_tokens=2))
        engine.step([(seq, DraftTree.empty())])
        engine.release(seq)
    usable = avx2_attention.usable_for
    if path == "torch":
        avx2_attention.usable_for = lambda *a: False
    try:
        seq = engine.add_sequence(prefix + prompt, SamplingParams(max_new_tokens=2))
        clock.reset()
        start = time.perf_counter()
        (verdict,) = engine.step([(seq, DraftTree.empty())])
        seconds = time.perf_counter() - start
    finally:
        avx2_attention.usable_for = usable
    engine.release(seq)
    return seconds, clock.seconds, verdict.tokens[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=3, help="Spec-Bench summarization prompts")
    ap.add_argument("--cached", default="0,256,512", help="prefix tokens in the cache before each prompt")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    if not avx2_attention.available():
        raise SystemExit("the AVX2 attention kernel is not available here")
    hf, hf_tokenizer = load_model(args.model)
    engine = Engine.from_hf_model(hf, kv_pool_bytes=512 << 20)
    tokenizer = EdgeTokenizer.from_transformers(hf_tokenizer)
    chat = hf_tokenizer.chat_template is not None
    prompts = [tokenizer.encode_prompt(p.text, chat=chat)
               for p in specbench.load(categories=["summarization"])[: args.prompts + 1]]
    clock = AttentionClock()
    print(f"torch threads {torch.get_num_threads()}; {args.model}; prompts of {[len(p) for p in prompts[1:]]} tokens; "
          f"median of {args.reps} prefills a prompt and path, interleaved\n")
    print("| cached tokens | kernel: step s | attention s | torch's: step s | attention s | step, kernel / torch's |")
    print("|---|---|---|---|---|---|")
    for cached in [int(c) for c in args.cached.split(",")]:
        times: dict[str, list[tuple[float, float]]] = {path: [] for path in PATHS}
        for i, prompt in enumerate(prompts[1:]):
            prefix = prompts[0][:cached] if cached else []
            firsts = {path: prefill(engine, prefix, prompt, path, clock)[2] for path in PATHS}  # warm, and checked
            if len(set(firsts.values())) != 1:
                print(f"  prompt {i}: the paths' first tokens differ: {firsts}")
            for _ in range(args.reps):
                for path in PATHS:
                    step, attn, _ = prefill(engine, prefix, prompt, path, clock)
                    times[path].append((step, attn))
        step = {path: statistics.median(s for s, _ in times[path]) for path in PATHS}
        attn = {path: statistics.median(a for _, a in times[path]) for path in PATHS}
        print(f"| {cached} | {step['kernel']:.3f} | {attn['kernel']:.3f} | {step['torch']:.3f} | {attn['torch']:.3f} | "
              f"{step['kernel'] / step['torch']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
