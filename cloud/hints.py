"""The verifier's hints (common/hints.py) from the logits a pass computed anyway.

Both steps are a pass over every row's V logits, which at 49k-262k entries costs about as much as a small
pass of the model would if done naively (torch.topk and logsumexp: ~0.2 ms per row at V = 49k on one core).
The top k here come from the k best blocks of BLOCK logits (a block's maximum is one cheap vectorised pass;
the k largest logits lie in the k blocks with the largest maxima), ~5x faster than torch.topk; the
normaliser is one exp-and-sum pass, which no shortcut avoids (real rows keep ~70% of their logits within 20
of the maximum, so skipping blocks far below it saves nothing).
"""

from __future__ import annotations

import torch

from specedge.common.hints import Hints

BLOCK = 64
ROWS_AT_ONCE = 4  # the normaliser's scratch rows: reused, so a 65-row Gemma step does not allocate 68 MB


def top_k_hints(logits: torch.Tensor, k: int, temperature: float = 0.0) -> Hints:
    """Each row's k most likely tokens and their probabilities at `temperature` (0, greedy, reads as 1).

    `logits` is [rows, V]; off the CPU they are computed where they lie, and only the hints come back."""
    scale = 1.0 / temperature if temperature > 0 else 1.0
    if logits.device.type != "cpu":
        return top_k_hints_plain(logits.detach(), k, scale)
    logits = logits.detach().float().contiguous()
    values, ids = _top_k(logits, min(k, logits.shape[-1]))
    top = values[:, :1]
    norm = torch.empty(len(logits), 1)  # sum of exp((logit - max) * scale)
    scratch = torch.empty(min(ROWS_AT_ONCE, len(logits)), logits.shape[-1])
    for start in range(0, len(logits), ROWS_AT_ONCE):
        rows = slice(start, start + ROWS_AT_ONCE)
        shifted = torch.sub(logits[rows], top[rows], out=scratch[: len(top[rows])])
        if scale != 1.0:
            shifted.mul_(scale)
        norm[rows] = shifted.exp_().sum(-1, keepdim=True)
    probs = ((values - top) * scale).exp_().div_(norm)
    return Hints(ids.tolist(), probs.tolist())


def top_k_hints_plain(logits: torch.Tensor, k: int, scale: float = 1.0) -> Hints:
    """The same hints from torch.topk and logsumexp: what a GPU runs fast (the blocked search above is for
    the CPU's few cores). The top k are searched in the logits' own number format (bfloat16 on a GPU: half
    the bytes of a float32 copy, the same values), the normaliser is summed in float32."""
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    scaled = logits.float() if scale == 1.0 else logits.float() * scale  # never in place: float() may be a no-op
    log_norm = torch.logsumexp(scaled, dim=-1, keepdim=True)  # subtracts each row's maximum itself
    probs = (values.float() * scale - log_norm).exp()
    return Hints(ids.cpu().tolist(), probs.cpu().tolist())


def _top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(logits, k) (values and ids, largest first) for [rows, V] logits, by blocks."""
    rows, vocab = logits.shape
    blocks = vocab // BLOCK
    if blocks <= k:
        return logits.topk(k, dim=-1)
    blocked = logits.as_strided((rows, blocks, BLOCK), (vocab, BLOCK, 1))  # the tail (vocab % BLOCK) aside
    best_blocks = blocked.amax(-1).topk(k, dim=-1).indices  # [rows, k]
    columns = (best_blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(rows, -1)
    tail = torch.arange(blocks * BLOCK, vocab).expand(rows, -1)
    columns = torch.cat([columns, tail], dim=1)
    values, where = logits.gather(1, columns).topk(k, dim=-1)
    return values, columns.gather(1, where)
