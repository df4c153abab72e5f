"""transformers' own decoding as baselines: `hf-ar` (plain `generate`), `hf-pld` (prompt lookup),
`hf-assisted` (the target's own model as assistant, same vocabulary) and `hf-uag` (universal assisted
generation: an assistant with another vocabulary)."""

from __future__ import annotations

import time

HF_BASELINES = ("hf-ar", "hf-pld", "hf-assisted", "hf-uag")


class PeerFailed(RuntimeError):
    """A peer's own generation raised (transformers' universal assisted generation does on most Spec-Bench prompts
    in transformers 5.25, for one): the bench leaves that method out of its results, says why, and goes on."""


class HFBaselines:
    def __init__(self, hf, hf_tokenizer, model_name: str, drafting_model: str) -> None:
        self.hf, self.hf_tokenizer = hf, hf_tokenizer
        self.model_name, self.drafting_model = model_name, drafting_model
        self._assistants: dict[str, tuple] = {}

    def run(self, method: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Greedy generation -> (new tokens, wall seconds)."""
        import torch

        x = torch.tensor([ids])
        extra: dict = {"prompt_lookup_num_tokens": 10} if method == "hf-pld" else {}
        if method == "hf-assisted":  # the target's own weights assist (fp32, not quantised)
            extra = {"assistant_model": self._assistant(self.model_name)[0]}
        elif method == "hf-uag":
            assistant, assistant_tokenizer = self._assistant(self.drafting_model)
            extra = {"assistant_model": assistant, "tokenizer": self.hf_tokenizer,
                     "assistant_tokenizer": assistant_tokenizer}
        elif method != "hf-ar" and method != "hf-pld":
            raise ValueError(f"unknown transformers baseline {method!r}")
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=max_new_tokens, **extra)
        except Exception as e:  # transformers' error, whatever its type: not a reason to lose the other methods
            raise PeerFailed(f"{method} failed in transformers {_transformers_version()}: {type(e).__name__}: {e}") from e
        return out[0, len(ids) :].tolist(), time.perf_counter() - start

    def _assistant(self, name: str) -> tuple:
        from specedge.cloud.model_registry import load_model

        if name not in self._assistants:
            self._assistants[name] = load_model(name)
        return self._assistants[name]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
