"""A small language model on the edge: a GGUF file run by llama.cpp (`llama-cpp-python`, the `[model]`
extra), through its C API. It keeps one sequence in its KV cache: `logits(tokens)` makes the cache hold
exactly `tokens` (keeping the longest common prefix with what it held, dropping the rest: the rollback
after a verdict) and returns the next-token logits.

Why llama.cpp: quantised weights (a 135M model is ~90 MB in Q4), a few ms per token on one core, no
torch; the README's "Edge drafting models" section has the measurements behind the choice.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

BATCH = 128  # tokens per llama_decode call when feeding a prompt (512 is no faster on one core)


def llama_cpp_module():
    try:
        import llama_cpp
        from llama_cpp import _logger
    except ImportError as e:
        raise ImportError("model drafting needs llama.cpp: pip install 'specedge[model]'") from e
    _logger.set_verbose(False)  # llama.cpp logs every load to stderr otherwise
    return llama_cpp


class DraftModel:
    def __init__(self, path: str | Path, context: int = 8192, threads: int = 1) -> None:
        llama = self._l = llama_cpp_module()
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF model at {path}")
        llama.llama_backend_init()
        self._model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path}")
        params = llama.llama_context_default_params()
        params.n_ctx = context
        params.n_batch = params.n_ubatch = BATCH
        params.n_threads = params.n_threads_batch = threads
        params.swa_full = True  # sliding-window layers keep every position, so rollback stays exact
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            raise ValueError(f"llama.cpp could not make a context for {path}")
        self._memory = llama.llama_get_memory(self._ctx)
        self._vocab = llama.llama_model_get_vocab(self._model)
        self._batch = llama.llama_batch_init(BATCH, 0, 1)
        self.path = path
        self.context = context
        self.vocab_size: int = llama.llama_vocab_n_tokens(self._vocab)
        self.tokens: list[int] = []  # what the KV cache holds
        self._logits: np.ndarray | None = None  # next-token logits after self.tokens

    # --- vocabulary -------------------------------------------------------------------------------------
    def token_bytes(self) -> list[bytes | None]:
        """The bytes each token adds to text; None for control tokens (BOS, end of turn, ...)."""
        buf = ctypes.create_string_buffer(256)
        out: list[bytes | None] = []
        for t in range(self.vocab_size):
            if self._l.llama_vocab_is_control(self._vocab, t) or self._l.llama_vocab_is_eog(self._vocab, t):
                out.append(None)
                continue
            n = self._l.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, False)
            out.append(buf.raw[:n] if n >= 0 else None)
        return out

    def tokenize(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`; with `special`, control tokens' texts in it ("<|im_start|>") are those tokens."""
        raw = text.encode("utf-8")
        size = len(raw) + 8
        buf = (self._l.llama_token * size)()
        n = self._l.llama_tokenize(self._vocab, raw, len(raw), buf, size, add_bos, special)
        return list(buf[:n])

    @property
    def chat_template(self) -> str | None:
        """The GGUF's chat template (jinja), if it has one."""
        template = self._l.llama_model_chat_template(self._model, None)
        return template.decode("utf-8") if template else None

    @property
    def special_tokens(self) -> dict[str, str]:
        """The texts of BOS and EOS, under the names chat templates know them by."""
        out = {}
        for name, token in (("bos_token", self._l.llama_vocab_bos(self._vocab)),
                            ("eos_token", self._l.llama_vocab_eos(self._vocab))):
            if token >= 0:
                out[name] = self.token_text(token)
        return out

    @property
    def bos_id(self) -> int | None:
        bos = self._l.llama_vocab_bos(self._vocab)
        return bos if bos >= 0 and self._l.llama_vocab_get_add_bos(self._vocab) else None

    def is_end(self, token: int) -> bool:
        """End of generation (EOS, end of turn)."""
        return bool(self._l.llama_vocab_is_eog(self._vocab, token))

    def token_text(self, token: int) -> str:
        return self._l.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    # --- running --------------------------------------------------------------------------------------
    def logits(self, tokens: list[int]) -> np.ndarray:
        """Next-token logits (float32, [vocab]) after exactly `tokens`; the cache ends up holding them."""
        self.prefill(tokens)
        return self._logits

    def prefill(self, tokens: list[int], stop: Callable[[], bool] = lambda: False, batch: int = BATCH) -> bool:
        """Make the cache hold exactly `tokens` and compute the logits after them, unless `stop()` turns
        true between two batches of `batch` tokens: then the cache holds a prefix of `tokens` (which
        `logits` goes on from) and this returns False."""
        if not tokens:
            raise ValueError("the draft model needs at least one token of context")
        if len(tokens) > self.context:
            raise ValueError(f"{len(tokens)} tokens exceed the draft model's context of {self.context}")
        keep = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            keep += 1
        if keep == len(tokens) == len(self.tokens) and self._logits is not None:
            return True
        keep = min(keep, len(tokens) - 1)  # the last token is fed again for its logits
        if keep < len(self.tokens):
            self._l.llama_memory_seq_rm(self._memory, 0, keep, -1)
            del self.tokens[keep:]
        self._logits = None
        for start in range(keep, len(tokens), batch):
            if start > keep and stop():
                return False
            self._decode(tokens[start : start + batch], start, last=start + batch >= len(tokens))
        return True

    def _decode(self, chunk: list[int], position: int, last: bool) -> None:
        batch = self._batch
        batch.n_tokens = len(chunk)
        for i, token in enumerate(chunk):
            batch.token[i] = token
            batch.pos[i] = position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = last and i == len(chunk) - 1
        code = self._l.llama_decode(self._ctx, batch)
        if code != 0:
            self._l.llama_memory_seq_rm(self._memory, 0, len(self.tokens), -1)
            raise RuntimeError(f"llama_decode failed (code {code}) at position {position}")
        self.tokens.extend(chunk)
        if last:
            row = self._l.llama_get_logits_ith(self._ctx, -1)
            self._logits = np.ctypeslib.as_array(row, shape=(self.vocab_size,)).copy()

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self._l.llama_batch_free(self._batch)
            self._l.llama_free(self._ctx)
            self._l.llama_model_free(self._model)
            self._ctx = None

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit llama_cpp's bindings may already be gone
            self.close()
