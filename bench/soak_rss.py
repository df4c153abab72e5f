"""The verifier's memory under a long soak (RELIABILITY.md): `specedge serve` as its own process, a tiny
random-weight Llama (SmolLM2's tokenizer and vocabulary) on a 1 MiB KV pool, and CLIENTS threads of this
process generating against it for SECONDS, drafting well, badly or not at all; the verifier's resident
memory (VmRSS) is sampled every few seconds. Every session must give its solo greedy output.

    .venv/bin/python bench/soak_rss.py --seconds 600 --clients 64 --out bench-out/soak-rss.json
    .venv/bin/python bench/soak_rss.py --seconds 600 --malloc-arena-max 2   # glibc's arenas capped
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from specedge.cloud.launch import VerifierProcess
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from specedge.edge.drafter import FunctionDrafter
from specedge.edge.generation import generate
from specedge.edge.resume import ResumableSession
from specedge.edge.transport import RemoteVerifier

PARAMS = SamplingParams(max_new_tokens=64)


def save_tiny_model(path: Path) -> int:
    """A two-layer random Llama with SmolLM2's tokenizer, as a model dir `specedge serve --model` takes."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specedge.cloud.model_registry import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # peaked distributions, as in the tests' tiny models
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return len(tokenizer)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--malloc-arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for the verifier")
    ap.add_argument("--out", type=Path, default=None, help="write the samples and the summary as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        vocab = save_tiny_model(Path(tmp))
        env_before = os.environ.get("MALLOC_ARENA_MAX")
        if args.malloc_arena_max is not None:
            os.environ["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)  # inherited by the child only
        try:
            server = VerifierProcess("--model", tmp, "--kv-pool-mb", "1", "--threads", "1",
                                     "--max-sessions-per-client", str(args.clients))
        finally:
            if args.malloc_arena_max is not None:
                os.environ.pop("MALLOC_ARENA_MAX") if env_before is None else os.environ.update(
                    MALLOC_ARENA_MAX=env_before)
        with server:
            run(server, vocab, args)


def run(server: VerifierProcess, vocab: int, args: argparse.Namespace) -> None:
    verifier = RemoteVerifier(server.target)
    prompts = [[(13 * i + 7 * j) % (vocab - 1) + 1 for j in range(64 + 5 * i)] for i in range(8)]
    want = [generate(ResumableSession(lambda: verifier, p, PARAMS, "solo", "")).token_ids for p in prompts]
    pid = server._proc.pid
    sessions, wrong, errors, latencies = [0], [], [], []
    deadline = time.monotonic() + args.seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        while time.monotonic() < deadline:
            p = rng.randrange(len(prompts))
            kind, truth = rng.random(), prompts[p] + want[p]
            if kind < 0.6:
                depth = rng.randint(1, 8)
                drafter = FunctionDrafter(lambda c, d=depth: DraftTree.chain(truth[len(c): len(c) + d])
                                          if c == truth[: len(c)] else DraftTree.chain([(c[-1] + 1) % vocab]))
            elif kind < 0.8:
                drafter = FunctionDrafter(lambda c, r=random.Random(rng.random()):
                                          DraftTree.chain([r.randrange(vocab) for _ in range(3)]))
            else:
                drafter = None
            start = time.monotonic()
            try:
                got = generate(ResumableSession(lambda: verifier, prompts[p], PARAMS, f"soak-{i}", ""),
                               drafter=drafter).token_ids
            except Exception as e:
                errors.append(f"client {i}: {e!r}")
                return
            latencies.append(time.monotonic() - start)
            sessions[0] += 1
            if got != want[p]:
                wrong.append((i, p))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        samples.append({"s": round(time.monotonic() - started, 1), "sessions": sessions[0],
                        "rss_mb": round(rss_mb(pid), 1)})
        print(json.dumps(samples[-1]), flush=True)
        time.sleep(args.sample_s)
    samples.append({"s": round(time.monotonic() - started, 1), "sessions": sessions[0],
                    "rss_mb": round(rss_mb(pid), 1)})
    warm = next((s for s in samples if s["s"] >= 60), samples[0])  # after every client's first sessions
    summary = {"clients": args.clients, "seconds": args.seconds, "malloc_arena_max": args.malloc_arena_max,
               "sessions": sessions[0], "failed": len(errors), "wrong_outputs": len(wrong),
               "p50_s": round(statistics.median(latencies), 3) if latencies else None,
               "rss_at_60s_mb": warm["rss_mb"], "rss_end_mb": samples[-1]["rss_mb"],
               "rss_peak_mb": max(s["rss_mb"] for s in samples),
               "rss_growth_after_60s_mb": round(samples[-1]["rss_mb"] - warm["rss_mb"], 1)}
    print("summary:", json.dumps(summary))
    if errors:
        print("errors:", errors[:3])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    assert not errors and not wrong, (errors[:3], wrong[:5])


if __name__ == "__main__":
    main()
