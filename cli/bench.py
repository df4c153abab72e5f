"""`specedge bench`: methods side by side on the same prompts in one run, interleaved, medians of reps.

Every method generates for every prompt in every repetition, in the same order, so the machine's noise
hits all of them alike. Greedy outputs of every method are checked against `ar` of the same repetition.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

BASELINES = ("ar", "hf-ar", "hf-pld", "suffix", "oracle", "server-ar")


def add_parser(commands) -> None:
    b = commands.add_parser(
        "bench",
        help="measure drafters and baselines side by side",
        description="Measure speculative methods against plain decoding on the same prompts in one run "
        "(interleaved, several repetitions, medians). Writes results.json, results.md and plots to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--model", default="smollm2-135m", help="registry name or local Hugging Face model dir")
    b.add_argument("--workload", default=None, metavar="specbench:CAT,...",
                   help="Spec-Bench categories (e.g. specbench:summarization,rag; specbench:all for every one), or "
                   "shared-doc:N (N prompts with one ~1,400-token document in common and different questions)")
    b.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                   help="prompts file: lines with id, category, prompt (or Spec-Bench lines with turns)")
    b.add_argument("--per-category", type=int, default=6, help="prompts per category (Spec-Bench workloads)")
    b.add_argument("--drafters", default="retrieval", help="comma-separated drafters to measure")
    b.add_argument("--baselines", default="ar,hf-pld,suffix,oracle",
                   help=f"comma-separated baselines from {', '.join(BASELINES)}; ar is always run")
    b.add_argument("--corpus", action="append", type=Path, default=[], metavar="PATH",
                   help="long-term datastore (files, dirs or a built datastore): each drafter then also runs "
                   "as DRAFTER+corpus with it, beside the plain DRAFTER")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    b.add_argument("--max-tree", type=int, default=64, help="most draft nodes per pass")
    b.add_argument("--oracle-depth", type=int, default=16, help="draft length of the oracle baseline")
    b.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    b.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    b.add_argument("--rtt-ms", default="0", help="emulated network round trips, comma-separated (gRPC mode)")
    b.add_argument("--concurrency", default="1",
                   help="concurrent edge clients, comma-separated (e.g. 1,4,16). Anything but 1, a round trip "
                   "or the server-ar baseline runs the gRPC mode: clients against a verifier on loopback")
    b.add_argument("--max-batch-tokens", type=int, default=2048, help="the verifier's per-step token budget (gRPC mode)")
    b.add_argument("--kv-pool-mb", type=int, default=512, help="KV cache budget of the engine in MiB")
    b.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory")
    b.set_defaults(run=run)


@dataclass
class Prompt:
    id: str
    category: str
    text: str


def load_prompts(args: argparse.Namespace) -> list[Prompt]:
    from specedge.common import specbench

    if (args.workload is None) == (args.prompts is None):
        raise ValueError("give exactly one of --workload specbench:CAT,... and --prompts FILE.jsonl")
    if args.prompts is not None:
        prompts = []
        for n, line in enumerate(args.prompts.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            rec = json.loads(line)
            text = rec.get("prompt") or (rec.get("turns") or [None])[0]
            if not isinstance(text, str):
                raise ValueError(f"{args.prompts}:{n}: no 'prompt' (or Spec-Bench 'turns')")
            prompts.append(Prompt(str(rec.get("id", rec.get("question_id", n))), rec.get("category", "all"), text))
        return prompts
    kind, _, cats = args.workload.partition(":")
    if kind == "shared-doc":
        return shared_document_prompts(int(cats or 16))
    if kind != "specbench" or not cats:
        raise ValueError(f"--workload must look like specbench:CAT,...; got {args.workload!r}")
    wanted = None if cats == "all" else cats.split(",")
    chosen = []
    pool = specbench.load(categories=wanted)
    for cat in dict.fromkeys(p.category for p in pool):
        chosen += [p for p in pool if p.category == cat][: args.per_category]
    return [Prompt(p.id, p.category, p.text) for p in chosen]


def shared_document_prompts(n: int) -> list[Prompt]:
    """n prompts that begin with the same ~1,400-token document (two Spec-Bench articles) and then ask
    different things about it: the case where a verifier's prefix cache stores the document once."""
    from specedge.common import specbench

    articles = [p.text.removeprefix("Summarize: ") for p in specbench.load(categories=["summarization"])[:2]]
    document = "Document:\n" + "\n\n".join(articles)
    asks = ["Summarize the document in one sentence.", "Who are the people in the document?",
            "Where do the events take place?", "Give the document a title.", "What happened first?",
            "What happened last?", "List three facts from the document.", "What is the main topic?"]
    return [Prompt(f"shared-{i}", "shared-doc", f"{document}\n\nTask {i + 1}: {asks[i % len(asks)]}") for i in range(n)]


@dataclass
class Run:
    method: str
    category: str
    prompt: str
    rep: int
    tokens: list[int]
    wall_s: float
    ttft_s: float | None  # the first pass, which prefills the prompt (None: not measurable, hf-*)
    rounds: int | None
    draft_ms: list[float]
    tree_sizes: list[int]


class Methods:
    """How each method generates one prompt; all share one model and one engine."""

    def __init__(self, args, hf, tokenizer, engine, store) -> None:
        from specedge.cloud.local import LocalVerifier
        from specedge.common.text import eos_token_ids

        self.args, self.hf, self.engine = args, hf, engine
        self.verifier = LocalVerifier(engine)
        self.eos = eos_token_ids(hf)
        self.store = store
        self.new_repetition()

    def new_repetition(self) -> None:
        """Fresh drafters: nothing one repetition learned (SuffixDecoding's cache of earlier responses,
        the retrieval drafter's acceptance statistics) may carry the answers into the next one."""
        from specedge.edge.registry import make_drafter

        from specedge.edge.controller import TreeSizeController

        args = self.args
        self.controller = TreeSizeController(args.max_tree)
        self.drafters = {}
        for name in [d for d in args.drafters.split(",") if d]:
            self.drafters[name] = make_drafter(name, None, max_nodes=args.max_tree)
            if self.store is not None:  # with and without the long-term datastore, side by side
                self.drafters[f"{name}+corpus"] = make_drafter(name, self.store, max_nodes=args.max_tree)
        self.suffix = None
        if "suffix" in args.baselines.split(","):
            from specedge.edge.suffix_drafter import SuffixDecodingDrafter

            self.suffix = SuffixDecodingDrafter(max_spec_tokens=min(args.max_tree, 16))

    def names(self) -> list[str]:
        baselines = [b for b in self.args.baselines.split(",") if b and b != "ar"]
        unknown = set(baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {', '.join(BASELINES)}")
        return ["ar", *self.drafters, *baselines]

    def run(self, method: str, ids: list[int], reference: list[int] | None):
        """-> (tokens, wall_s, ttft_s or None, rounds or None, draft_ms, tree_sizes)."""
        from specedge.common.sampling import SamplingParams
        from specedge.edge.generation import generate
        from specedge.edge.oracle import OracleDrafter

        params = SamplingParams(max_new_tokens=self.args.max_new_tokens)
        self.engine.pool.drop_cached()  # no method may reuse another's prefill
        if method.startswith("hf-"):
            return self._hf(method, ids)
        drafter, controller = None, None
        if method in self.drafters:
            drafter, controller = self.drafters[method], self.controller
        elif method == "suffix":
            drafter = self.suffix
        elif method == "oracle":
            drafter = OracleDrafter(ids + reference, self.args.oracle_depth)
        r = generate(self.verifier.open(ids, params), self.eos, drafter, controller)
        return r.token_ids, r.wall_s, r.ttft_s, r.rounds, r.draft_ms, r.tree_sizes

    def _hf(self, method: str, ids: list[int]):
        import torch

        x = torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                   max_new_tokens=self.args.max_new_tokens, **extra)
        wall = time.perf_counter() - start
        return out[0, len(ids) :].tolist(), wall, None, None, [], []


def run(args: argparse.Namespace) -> int:
    from specedge.cloud.engine import Engine
    from specedge.common.model_registry import load_model
    from specedge.common.text import encode_prompt
    from specedge.edge.corpus import open_corpus

    def fail(msg: str) -> SystemExit:
        return SystemExit(f"specedge bench: {msg}")

    serving = args.rtt_ms not in ("0", "0.0") or args.concurrency != "1" or "server-ar" in args.baselines.split(",")
    try:
        prompts = load_prompts(args)
        hf, tokenizer = load_model(args.model)
        store = open_corpus(args.corpus, tokenizer) if args.corpus else None
        engine = Engine.from_hf_model(hf, kv_pool_bytes=args.kv_pool_mb << 20)
        if serving:
            _check_serving_args(args, store)
        else:
            methods = Methods(args, hf, tokenizer, engine, store)
            names = methods.names()
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise fail(str(e))
    chat = args.chat
    encoded = [encode_prompt(tokenizer, p.text, chat=chat) for p in prompts]
    args.out.mkdir(parents=True, exist_ok=True)
    if serving:
        from specedge.cli.bench_serving import serving_rows

        def check(method, prompt, ids, want, got):
            _check_mismatch(engine, method, prompt, ids, want, got)

        rows = serving_rows(args, prompts, encoded, hf, tokenizer, check)
        _write(args, rows, store)
        _plot_serving(rows, args.out)
        return 0

    runs: list[Run] = []
    total = args.reps * len(prompts) * len(names)
    progress = _progress(total)
    # One untimed warm-up generation so the first timed method does not pay for allocations.
    methods.run("ar", encoded[0][:64], None)
    for rep in range(args.reps):
        methods.new_repetition()
        for p, ids in zip(prompts, encoded):
            reference = None
            for name in names:
                tokens, wall, ttft, rounds, draft_ms, sizes = methods.run(name, ids, reference)
                if name == "ar":
                    reference = tokens
                elif tokens != reference:
                    _check_mismatch(engine, name, p, ids, reference, tokens)
                runs.append(Run(name, p.category, p.id, rep, tokens, wall, ttft, rounds, draft_ms, sizes))
                progress(f"rep {rep + 1}/{args.reps} {p.category}/{p.id} {name}: "
                         f"{len(tokens) / wall:.1f} tokens/s")
    progress(None)
    with open(args.out / "runs.jsonl", "w") as f:  # every generation, for analyses the table does not do
        f.writelines(json.dumps(dataclasses.asdict(r)) + "\n" for r in runs)
    rows = summarize(runs, names, args)
    _write(args, rows, store)
    _plot(rows, args.out)
    return 0


def _check_serving_args(args, store) -> None:
    unknown = set(b for b in args.baselines.split(",") if b) - {"ar", "server-ar"}
    if unknown:
        raise ValueError(f"in gRPC mode (--concurrency/--rtt-ms/server-ar) the baseline is server-ar; "
                         f"{sorted(unknown)} run in-process only")
    if store is not None:
        raise ValueError("--corpus is not supported in gRPC mode yet")


def _write(args, rows: list[dict], store) -> None:
    results = {
        "rows": rows,
        "config": {k: str(v) for k, v in vars(args).items() if k != "run"},
        "machine": {"python": platform.python_version(), "cpu_count": _cpu_count(),
                    "torch_threads": _torch_threads(), "platform": platform.platform()},
        "datastore": store.meta if store is not None else None,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = markdown(rows)
    (args.out / "results.md").write_text(table)
    print(table)


def summarize(runs: list[Run], names: list[str], args) -> list[dict]:
    """One row per (method, category) plus an `all` category: medians over repetitions."""
    by = defaultdict(list)
    for r in runs:
        by[(r.method, r.category, r.rep)].append(r)
        by[(r.method, "all", r.rep)].append(r)
    categories = list(dict.fromkeys(r.category for r in runs)) + ["all"]
    rows = []
    for cat in categories:
        ar_tps = {rep: _tps(by[("ar", cat, rep)]) for rep in range(args.reps)}
        ar_decode = {rep: _decode_tps(by[("ar", cat, rep)]) for rep in range(args.reps)}
        for name in names:
            reps = [by[(name, cat, rep)] for rep in range(args.reps)]
            tps = [_tps(rs) for rs in reps]
            decode = [_decode_tps(rs) for rs in reps]
            every = [r for rs in reps for r in rs]
            rounds = [r.rounds for r in every if r.rounds is not None]
            drafts = [ms for r in every for ms in r.draft_ms]
            sizes = [s for r in every for s in r.tree_sizes]
            rows.append({
                "method": name, "category": cat, "n_prompts": len(reps[0]),
                "tokens_per_s": round(statistics.median(tps), 3),
                "speedup": round(statistics.median(t / ar_tps[rep] for rep, t in enumerate(tps)), 3),
                "mean_accepted": round(sum(len(r.tokens) for r in every if r.rounds) / sum(rounds), 3)
                if rounds else None,
                "draft_ms": round(statistics.median(drafts), 3) if drafts else None,
                "decode_tokens_per_s": round(statistics.median(decode), 3) if decode[0] else None,
                "decode_speedup": round(statistics.median(d / ar_decode[rep] for rep, d in enumerate(decode)), 3)
                if decode[0] else None,
                "ttft_ms": round(statistics.median(1e3 * r.ttft_s for r in every), 1) if decode[0] else None,
                "rtt_ms": 0.0, "concurrency": 1,
                "tree_size": round(statistics.mean(sizes), 2) if sizes else None,
                "tokens": sum(len(r.tokens) for r in every), "reps": args.reps,
            })
    return rows


def _tps(runs: list[Run]) -> float:
    return sum(len(r.tokens) for r in runs) / sum(r.wall_s for r in runs)


def _decode_tps(runs: list[Run]) -> float:
    """Tokens after the first over the time after the first pass (0 when the first pass is not known)."""
    if any(r.ttft_s is None for r in runs):
        return 0.0
    return sum(len(r.tokens) - 1 for r in runs) / sum(r.wall_s - r.ttft_s for r in runs)


def _check_mismatch(engine, method: str, prompt: Prompt, ids: list[int], want: list[int], got: list[int]) -> None:
    """A greedy mismatch is an error unless the target's top-2 logits at the first difference are a near-tie
    (gap below 1e-3, the engine's measured parity tolerance), in which case both outputs are valid greedy."""
    from specedge.common.draft_tree import DraftTree
    from specedge.common.sampling import SamplingParams

    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    if at < min(len(want), len(got)):
        seq = engine.add_sequence(ids + want[:at], SamplingParams())
        try:
            (logits,) = engine.forward([(seq, DraftTree.empty())])
        finally:
            engine.release(seq)
        top = logits[0].topk(2).values
        gap = float(top[0] - top[1])
        if gap < 1e-3:
            print(f"note: {method} differs from ar on {prompt.category}/{prompt.id} at token {at}, a near-tie "
                  f"(top-2 gap {gap:.1e})", file=sys.stderr)
            return
        detail = f"top-2 logit gap {gap:.3f}"
    else:
        detail = f"lengths {len(want)} vs {len(got)}"
    raise SystemExit(f"specedge bench: {method} output differs from ar on {prompt.category}/{prompt.id} at token "
                     f"{at} ({detail}): speculative decoding must be lossless")


def markdown(rows: list[dict]) -> str:
    cols = ["method", "category", "n_prompts", "tokens_per_s", "speedup", "decode_speedup", "mean_accepted",
            "draft_ms", "tree_size", "ttft_ms"]
    if rows and "kv_peak_bytes" in rows[0]:
        cols = ["method", "concurrency", "rtt_ms", "n_prompts", "tokens_per_s", "speedup", "mean_accepted",
                "draft_ms", "tree_size", "kv_peak_bytes"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("–" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(r["category"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * len(methods) / 3), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [next(r["speedup"] for r in rows if r["method"] == m and r["category"] == c) for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over own plain decoding (ar)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def _plot_serving(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (method, rtt) in dict.fromkeys((r["method"], r["rtt_ms"]) for r in rows):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["method"] == method and r["rtt_ms"] == rtt)
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=f"{method} (rtt {rtt:g} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent edge clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)


def _progress(total: int):
    """A progress bar on a terminal, plain lines otherwise; call with None to finish."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total, file=sys.stderr, unit="run")

        def update(msg):
            if msg is None:
                bar.close()
            else:
                bar.set_postfix_str(msg[-60:])
                bar.update()
        return update
    done = [0]

    def log(msg):
        if msg is not None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {msg}", file=sys.stderr, flush=True)
    return log


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
