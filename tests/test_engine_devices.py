"""The engine on each device and number format (`specedge serve --device --dtype`).

In float32 greedy decoding, plain or with draft trees, several sequences batched into each step, gives
transformers' `generate` tokens. In bfloat16 two implementations round differently, so agreement with
transformers is reported (bench/gpu_bench.py), not asserted; what must hold is that speculation is
lossless within the number format: the engine's greedy tokens with draft trees equal its plain greedy
tokens. CUDA cases run where a GPU is visible and are skipped elsewhere (CI has none).
"""

from __future__ import annotations

import random

import pytest
import torch

from specedge.cloud.device import compile_layers, engine_device
from specedge.cloud.engine import Engine
from specedge.cloud.models.compiled import compiled_or_eager
from specedge.common.draft_tree import DraftTree
from specedge.common.params import SamplingParams
from tiny_models import DEVICES, tiny_gemma3, tiny_llama

GREEDY = SamplingParams()
EOS = 1  # the tiny models' end-of-sequence token
NEW_TOKENS = 40


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    x = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def guess_tree(truth: list[int], vocab: int, rng: random.Random) -> DraftTree:
    """A draft of the next tokens as an edge might send it: the true continuation up to a random depth, then
    a wrong token, with wrong siblings along the way (`truth` empty: a tree of wrong guesses only)."""
    tokens, parents, parent = [], [], -1
    for depth, token in enumerate(truth[: rng.randint(0, 5)]):
        if rng.random() < 0.5:
            tokens.append((token + 1 + rng.randrange(vocab - 1)) % vocab), parents.append(parent)  # a wrong sibling
        if depth == 3 and rng.random() < 0.5:
            token = (token + 1) % vocab  # the path goes wrong here
        tokens.append(token), parents.append(parent)
        parent = len(tokens) - 1
    return DraftTree(tokens, parents)


def greedy_decode(engine: Engine, prompts: list[list[int]], n: int, guide: list[list[int]] | None = None,
                  seed: int = 0) -> list[list[int]]:
    """Every prompt decoded together, one step for all per round, each until EOS or `n` tokens; with `guide`
    (known continuations), each round verifies a guessed tree of them."""
    rng = random.Random(seed)
    seqs = [engine.add_sequence(p, GREEDY) for p in prompts]
    live = list(range(len(seqs)))
    while live:
        work = []
        for i in live:
            done = len(seqs[i].output_ids)
            truth = guide[i][done:] if guide else []
            work.append((seqs[i], guess_tree(truth, engine.vocab_size, rng) if guide else DraftTree.empty()))
        engine.step(work)
        live = [i for i in live if len(seqs[i].output_ids) < n and EOS not in seqs[i].output_ids]
    outputs = []
    for seq in seqs:
        out = seq.output_ids
        out = out[: out.index(EOS) + 1] if EOS in out else out
        outputs.append(out[:n])
        engine.release(seq)
    assert engine.pool.stats().used == 0
    return outputs


def tiny(arch: str):
    return tiny_llama() if arch == "llama" else tiny_gemma3(sliding_window=8)


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in (3, 17, 90)]  # 90: a prefill group of its own


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float32_greedy_plain_and_speculative_equal_transformers_generate(arch, device):
    hf = tiny(arch).to(device)
    prompts = prompts_for(hf.config.vocab_size)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    engine = Engine.from_hf_model(hf, kv_pool_bytes=8 << 20, block_size=4, device=device, dtype=torch.float32)
    assert greedy_decode(engine, prompts, NEW_TOKENS) == want
    assert greedy_decode(engine, prompts, NEW_TOKENS, guide=want) == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_bfloat16_speculation_changes_no_greedy_token(arch, device):
    engine = Engine.from_hf_model(tiny(arch), kv_pool_bytes=8 << 20, block_size=4, device=device,
                                  dtype=torch.bfloat16)
    assert engine.pool.k.dtype == torch.bfloat16 and engine.pool.k.device.type == device
    prompts = prompts_for(engine.vocab_size, seed=1)
    plain = greedy_decode(engine, prompts, NEW_TOKENS)
    assert min(len(out) for out in plain) >= 10, "the prompts must give outputs worth comparing"
    for seed in range(3):
        assert greedy_decode(engine, prompts, NEW_TOKENS, guide=plain, seed=seed) == plain


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible: runs on a GPU machine")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_layers_keep_greedy_output_equal_to_transformers_generate(arch):
    hf = tiny(arch).to("cuda")
    prompts = prompts_for(hf.config.vocab_size)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    engine = Engine.from_hf_model(hf, kv_pool_bytes=8 << 20, block_size=4, device="cuda", dtype=torch.float32)
    engine.runner.compile()
    assert greedy_decode(engine, prompts, NEW_TOKENS) == want
    assert greedy_decode(engine, prompts, NEW_TOKENS, guide=want) == want
    assert engine.graphs.enabled and engine.graphs.graphs, "compiled layers must be capturable in CUDA graphs"


@pytest.mark.parametrize("device", DEVICES)
def test_verdicts_and_hints_read_back_from_the_logits_are_the_cpus(device):
    """Off the CPU a step's verdict rows and hints are computed where the logits lie and read back in one
    transfer (cloud/greedy_readback.py; switched on here on the CPU too, to check its arithmetic there); they
    give the same tokens and name the same hints as the CPU's int8 argmax, session by session: greedy sessions
    asking for different numbers of hints or none, and a sampling one asking too."""
    prompts = prompts_for(512, seed=2) + prompts_for(512, seed=3)[:1]
    trees = [DraftTree([5, 6, 7], [-1, 0, -1]), DraftTree.empty(), DraftTree([9], [-1]), DraftTree([3, 4], [-1, 0])]
    params = [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=0.8, seed=7)]
    top_k = [4, 0, 2, 3]
    results = []
    for where, read_back in (("cpu", False), (device, True)):
        engine = Engine.from_hf_model(tiny("llama"), kv_pool_bytes=8 << 20, block_size=4, device=where,
                                      dtype=torch.float32)
        assert engine.read_back_logits == (where != "cpu") and engine.batch_hints == (where != "cpu")
        engine.read_back_logits = engine.batch_hints = read_back
        seqs = [engine.add_sequence(p, sp, hints_top_k=k) for p, sp, k in zip(prompts, params, top_k)]
        results.append(engine.step(list(zip(seqs, trees))))
    for on_cpu, on_device, tree, k in zip(*results, trees, top_k):
        assert on_device.tokens == on_cpu.tokens and on_device.accepted == on_cpu.accepted
        if not k:
            assert on_cpu.hints is None and on_device.hints is None
            continue
        assert len(on_device.hints.ids) == len(tree) + 1
        assert on_device.hints.ids == on_cpu.hints.ids and {len(row) for row in on_device.hints.ids} == {k}
        assert max(abs(a - b) for x, y in zip(on_cpu.hints.probs, on_device.hints.probs)
                   for a, b in zip(x, y)) <= 1e-4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible: runs on a GPU machine")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_recurring_step_is_replayed_from_a_cuda_graph_with_the_eager_logits(arch):
    engine = Engine.from_hf_model(tiny(arch), kv_pool_bytes=8 << 20, block_size=4, device="cuda",
                                  dtype=torch.float32)
    seqs = [engine.add_sequence(p, GREEDY) for p in prompts_for(engine.vocab_size)]
    engine.step([(s, DraftTree.empty()) for s in seqs])  # the prefills
    work = [(s, DraftTree([5, 6, 7], [-1, 0, -1])) for s in seqs]
    engine.graphs.enabled = False
    eager = engine.forward(work)
    engine.graphs.enabled = True
    passes = [engine.forward(work) for _ in range(3)]  # seen, captured, replayed
    assert len(engine.graphs.graphs) == 1
    for logits in passes:
        assert max((a - b).abs().max().item() for a, b in zip(eager, logits)) <= 1e-4


def test_auto_picks_the_cpu_in_float32_without_a_gpu_and_a_named_format_is_kept():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto picks it")
    assert engine_device("auto", "auto") == (torch.device("cpu"), torch.float32)
    assert engine_device("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)


def test_cuda_without_a_gpu_and_unknown_names_are_refused_with_what_to_use():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible.*--device cpu"):
            engine_device("cuda")
    with pytest.raises(ValueError, match="--device 'tpu': expected one of auto, cpu, cuda"):
        engine_device("tpu")
    with pytest.raises(ValueError, match="--dtype 'fp8': expected one of auto, float32, bfloat16, float16"):
        engine_device("cpu", "fp8")


def test_compiling_is_on_by_default_only_on_a_gpu_and_unknown_settings_are_refused():
    assert compile_layers("auto", torch.device("cuda")) and not compile_layers("auto", torch.device("cpu"))
    assert compile_layers("on", torch.device("cpu")) and not compile_layers("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="--compile 'yes': expected one of auto, on, off"):
        compile_layers("yes", torch.device("cpu"))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_cpus_packed_float32_layers_are_not_compiled(arch):
    engine = Engine.from_hf_model(tiny(arch), kv_pool_bytes=8 << 20, block_size=4, compile_layers=True)
    assert not engine.compiled


def test_a_function_that_cannot_be_compiled_runs_eagerly_with_a_warning(caplog):
    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if x.sum().item() > 0 else x - 1  # a graph break, which fullgraph compiling refuses

    call = compiled_or_eager(data_dependent)
    x = torch.ones(3)
    with caplog.at_level("WARNING"):
        assert torch.equal(call(x), x + 1) and torch.equal(call(-x), -x - 1)
    assert [r.message.count("runs eagerly from now on") for r in caplog.records] == [1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_layers_compute_what_the_plain_ones_do_on_the_cpu(arch, caplog):
    """CI has no GPU: the compiled path's arithmetic is checked here, in float64 (whose weights the CPU does not
    pack, so they are compiled), against transformers' greedy output; on CUDA the test above does the same."""
    hf = tiny(arch).to(torch.float64)
    prompts = prompts_for(hf.config.vocab_size)[:2]
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    engine = Engine.from_hf_model(hf, kv_pool_bytes=8 << 20, block_size=4, compile_layers=True)
    assert engine.compiled
    with caplog.at_level("WARNING"):
        assert greedy_decode(engine, prompts, NEW_TOKENS, guide=want) == want
    assert not [r for r in caplog.records if "runs eagerly" in r.message], "it must have run compiled"
