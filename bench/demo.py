"""`make demo`: one prompt generated without drafting and with the edge's drafting, side by side with their
speeds (the same text: speculation is lossless), then the same through the OpenAI API that `specedge
edge-serve` offers apps. One verifier on loopback serves all of it.

    python -m specedge.bench.demo "PROMPT" [--model smollm2-135m] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from specedge.cloud.config import DEFAULT_MODEL, ServerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)

    from specedge.cloud.launch import EmbeddedVerifier
    from specedge.cloud.model_registry import load_model
    from specedge.edge.client import EdgeClient
    from specedge.edge.openai_server import HttpServer, create_app

    print(f"loading {args.model} and starting a verifier on loopback ...", file=sys.stderr, flush=True)
    hf, tokenizer = load_model(args.model)
    with EmbeddedVerifier(ServerConfig(model=args.model, port=0), (hf, tokenizer)) as verifier:
        results = {}
        for drafter in ("none", "retrieval"):
            client = EdgeClient(verifier.target, drafter=drafter, tokenizer=tokenizer)
            client.generate(args.prompt[:40], max_new_tokens=4, chat=True)  # warm-up, not timed
            results[drafter] = client.generate(args.prompt, max_new_tokens=args.max_new_tokens, chat=True)
            client.close()
        plain, drafted = results["none"], results["retrieval"]
        same = "identical" if plain.token_ids == drafted.token_ids else "DIFFERENT"
        print(f"\nPrompt: {args.prompt}\n\nOutput ({same} with and without drafting):\n{drafted.text}\n")
        print(f"{'':28}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'tokens/pass':>13}")
        for label, r in (("plain decoding", plain), ("retrieval drafting (edge)", drafted)):
            s = r.stats
            print(f"{label:28}{s.num_tokens:>8}{s.wall_s:>9.2f}{s.tokens_per_s:>10.1f}{s.mean_accepted:>13.2f}")
        print(f"speed-up: {drafted.stats.tokens_per_s / plain.stats.tokens_per_s:.2f}x\n")

        client = EdgeClient(verifier.target, drafter="retrieval", tokenizer=tokenizer)
        http = HttpServer(create_app(client), port=0).start()
        body = {"model": args.model, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_new_tokens, "temperature": 0}
        print(f"The same through the OpenAI API (`specedge edge-serve`):\n  curl {http.url}/chat/completions "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{args.model}\", \"messages\": [...], "
              f"\"temperature\": 0}}'")
        request = urllib.request.Request(f"{http.url}/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as answer:
            reply = json.load(answer)
        same = reply["choices"][0]["message"]["content"] == drafted.text
        print(f"  -> {reply['usage']['completion_tokens']} tokens, {reply['specedge']['tokens_per_s']} tokens/s, "
              f"{'the same text' if same else 'a DIFFERENT text'}")
        http.stop()
        client.close()
    return 0 if plain.token_ids == drafted.token_ids and same else 1


if __name__ == "__main__":
    sys.exit(main())
