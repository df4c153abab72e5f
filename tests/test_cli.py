"""The `specedge` command: documented flags, clear errors, and `generate --json` giving transformers'
greedy output with the promised fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from specedge.cli import build_parser, main
from specedge.cloud.model_registry import resolve_model_dir


def specedge(*args: str) -> subprocess.CompletedProcess:
    """The installed console script, in a process of its own."""
    script = Path(sys.executable).with_name("specedge")
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=600)


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """main(args) in this process (no torch start-up per call) -> (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_flag_of_every_command_has_help_text():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"generate", "serve", "router", "index", "bench"} <= set(commands)
    pending = [(name, sub) for name, sub in commands.items()]
    while pending:
        name, sub = pending.pop()
        for action in sub._actions:
            assert action.help, f"specedge {name} {action.option_strings or action.dest} has no help text"
            if isinstance(action.choices, dict):  # nested subcommands, e.g. `index build`
                pending += [(f"{name} {n}", p) for n, p in action.choices.items()]


def test_help_lists_the_commands_and_generate_help_lists_its_flags():
    top = specedge("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("generate", "serve", "index", "bench"))
    gen = specedge("generate", "--help")
    assert gen.returncode == 0
    for flag in ["--model", "--drafter", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--stop", "--chat", "--json", "--kv-pool-mb", "--server", "--corpus"]:
        assert flag in gen.stdout
    serve = specedge("serve", "--help")
    for flag in ["--model", "--host", "--port", "--kv-pool-mb", "--max-batch-tokens", "--auth-token", "--tls-cert",
                 "--tls-key", "--metrics-port"]:
        assert flag in serve.stdout


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--model", "no-such-model"], "unknown model"),
    (["--drafter", "telepathy"], "--drafter"),
])
def test_bad_arguments_exit_non_zero_with_a_clear_message(capsys, args, message):
    code, _, err = run_in_process(capsys, "generate", "hello", *args)
    assert code != 0
    assert message in err


@pytest.mark.real_model
def test_generate_json_gives_transformers_greedy_output(real_model):
    prompt = "The capital of France is"
    result = specedge("generate", prompt, "--max-new-tokens", "12", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"text", "token_ids", "num_tokens", "generated_tokens", "rounds", "mean_accepted",
                        "tokens_per_s", "wall_s"}
    hf, tokenizer = real_model("smollm2-135m")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    want = want[0, ids.shape[1] :].tolist()
    assert out["token_ids"] == want
    assert out["text"] == tokenizer.decode(want, skip_special_tokens=True)
    assert out["num_tokens"] == out["generated_tokens"] == len(want) == out["rounds"]  # plain decoding: one a pass
    assert out["mean_accepted"] == pytest.approx(1.0)
    assert out["tokens_per_s"] > 0 and out["wall_s"] > 0


@pytest.mark.real_model
def test_generate_stops_at_a_stop_string_and_cuts_the_text_before_it(capsys):
    args = ["generate", "Count: 1, 2, 3,", "--max-new-tokens", "16", "--json"]
    full = json.loads(run_in_process(capsys, *args)[1])
    assert " 6" in full["text"], full["text"]  # the premise: the model keeps counting
    cut = json.loads(run_in_process(capsys, *args, "--stop", " 6")[1])
    assert cut["text"] == full["text"].split(" 6")[0]
    assert cut["num_tokens"] < cut["generated_tokens"] < full["num_tokens"]  # the stop's tokens were generated
    assert cut["token_ids"] == full["token_ids"][: cut["num_tokens"]]
    assert cut["num_tokens"] == len(cut["token_ids"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"))
    assert tokenizer.decode(cut["token_ids"], skip_special_tokens=True) == cut["text"]  # they agree


@pytest.mark.real_model
def test_sampling_with_a_seed_is_reproducible_and_another_seed_differs(capsys):
    args = ["generate", "Once upon a time", "--max-new-tokens", "12", "--json", "--temperature", "1.0"]
    a, b, c = (json.loads(run_in_process(capsys, *args, "--seed", seed)[1]) for seed in ("7", "7", "8"))
    assert a["token_ids"] == b["token_ids"] != c["token_ids"]


@pytest.mark.real_model
def test_generate_shows_the_progress_of_a_long_prefill_on_stderr(capsys, real_model):
    """A verifier that prefills 64 tokens a step: the CLI reports how far it is through a long prompt."""
    from specedge.cloud.config import ServerConfig
    from specedge.cloud.launch import EmbeddedVerifier

    config = ServerConfig(model="smollm2-135m", port=0, max_batch_tokens=64)
    with EmbeddedVerifier(config, real_model("smollm2-135m")) as verifier:
        prompt = " ".join(f"item {i}," for i in range(200))  # ~800 tokens
        code, out, err = run_in_process(capsys, "generate", prompt, "--server", verifier.target,
                                        "--max-new-tokens", "4", "--json")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("prefill: ")]
    assert lines and " of " in lines[0] and "prompt tokens" in lines[0], err
    assert json.loads(out)["generated_tokens"] == 4


def test_prefill_progress_rewrites_one_line_on_a_terminal_and_ends_it():
    import io

    from specedge.cli.prefill_progress import PrefillProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    progress = PrefillProgress(screen)
    progress(512, 2048)
    progress(1024, 2048)
    progress.done()
    shown = screen.getvalue()
    assert shown.startswith("\rprefill: 512 of 2,048 prompt tokens (25%)") and shown.endswith("\n")
    assert shown.count("\n") == 1 and "\rprefill: 1,024 of 2,048 prompt tokens (50%)" in shown
