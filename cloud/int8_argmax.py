"""Each row's argmax of h @ W.T, exact, for a quarter of the bytes of W: what greedy verification needs.

The output layer is a small model's largest matrix (Gemma 3 270M: 262k x 640, 671 MB in float32; SmolLM2
135M: 113 MB), and on the CPU its cost is reading it. Greedy verification needs only each row's argmax. Here this
project's own kernel (cloud/avx2_int8_logits.cpp) reads a per-row int8 copy of W once for all of a step's rows,
every token's logit is bounded around that approximation, and only the few tokens (tens) whose upper bound reaches
the best lower bound are computed again, exactly, from W in float32. The k largest logits (a greedy session's
hints) come the same way, from the tokens whose upper bound reaches the lowest lower bound of the k likeliest.

The bound, for a row h and a token j:
- h = s q + d, q an integer vector in [-L, L] (int16; L as large as keeps every 32-bit sum from overflowing:
  26k levels at D = 640) and |d_i| <= s / 2; x = s q.
- w_j = scale_j qw_j + e_j, qw_j in [-127, 127], with e_j known from the quantisation.
- The kernel's sum q.qw_j is exact integer arithmetic; approx_j = s scale_j (q.qw_j) rounds only in its products.
- |h.w_j - approx_j| <= ||d|| ||w_j|| + ||x|| ||e_j|| + a float rounding margin, by Cauchy-Schwarz.
`build` checks the kernel against exact integer arithmetic first, and gives None if it disagrees, or where the
kernel cannot be built (no AVX2, no compiler, SPECEDGE_CPU_ARGMAX=float32): the caller then keeps the float32
layer. Not lossy in any case the check lets through.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from specedge.cloud import cpu_kernels

SOURCE = Path(__file__).with_name("avx2_int8_logits.cpp")
PANEL = 16  # outputs per panel of the packed weight (the vocabulary is padded to a multiple of it)
# Rows a step may have for the int8 argmax, by the kernel's instructions: with AVX-512 VNNI it costs about half the
# float32 logits at every count measured (up to 96), with AVX2 alone as much beyond ~12 (BENCHMARKS.md section 1)
MAX_ROWS = {"avx512-vnni": 96, "avx2": 12}
MAX_K = 64  # the candidates' kernel keeps the k largest lower bounds in a fixed array
FEW = 8192  # tokens recomputed in float32 at most, per row: a 21 MB gather at D = 640, a quarter of the int8 read
_ROUNDING = 4 * torch.finfo(torch.float32).eps  # per summed term, far above what float32 dot products lose
_CHUNK = 8192  # rows of W quantised at a time: no full-size float temporaries
_INT32_MAX = 2**31 - 1


def _declare(library: ctypes.CDLL) -> None:
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.int8_logits.argtypes = [p, n, n, p, n, p, p, p, i, i]
    library.int8_logits.restype = None
    library.int8_candidates.argtypes = [p, n, n, n, p, p, p, p, i, n, p, p, i]
    library.int8_candidates.restype = None
    library.int8_logits_isa.argtypes = []
    library.int8_logits_isa.restype = i


_kernel = cpu_kernels.Kernel(SOURCE, "SPECEDGE_CPU_ARGMAX", "greedy steps take float32 logits", _declare)


class Int8Argmax:
    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, err: torch.Tensor,
                 norms: torch.Tensor) -> None:
        self.weight = weight  # [V, D] float32, for the exact rescoring
        self.version = weight._version  # the weight as quantised (in-place writes raise its _version)
        self.packed = packed  # the int8 weight as the kernel reads it: [V' / PANEL, D' / 2, PANEL, 2]
        self.scale = scale  # [V'] per-token scales, 0 for the padding
        self.err = err  # ||e_j||
        self.norms = norms  # ||w_j||
        self.margin = _ROUNDING * weight.shape[1]
        self.dim = weight.shape[1]
        self.pairs = packed.shape[1]
        self.levels = min(32767, _INT32_MAX // (2 * self.pairs * 127))  # |q| <= levels: no sum overflows int32
        self.isa = _kernel.library.int8_logits_isa()  # 2: AVX-512 VNNI, 1: AVX2
        self.max_rows = MAX_ROWS["avx512-vnni" if self.isa == 2 else "avx2"]

    @classmethod
    def build(cls, weight: torch.Tensor) -> "Int8Argmax | None":
        """The int8 argmax of `weight` [V, D] (float32, on the CPU), or None where the kernel is missing or does
        not compute what the bound assumes. Built once per weight, when first needed (OutputLayer)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if not _kernel.available():
            return None
        w_all = weight.detach()
        vocab, dim = w_all.shape
        padded_vocab, padded_dim = -(-vocab // PANEL) * PANEL, dim + dim % 2
        q = torch.zeros(padded_vocab, padded_dim, dtype=torch.int8)
        scale, err = torch.zeros(padded_vocab), torch.empty(vocab)
        for start in range(0, vocab, _CHUNK):
            rows = slice(start, min(start + _CHUNK, vocab))
            w = w_all[rows]
            s = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            levels = (w / s[:, None]).round_()
            q[rows, :dim], scale[rows] = levels.to(torch.int8), s
            err[rows] = torch.linalg.vector_norm(levels.mul_(s[:, None]).sub_(w), dim=1)
        packed = q.reshape(padded_vocab // PANEL, PANEL, padded_dim // 2, 2).transpose(1, 2).contiguous()
        head = cls(weight, packed, scale, err, torch.linalg.vector_norm(w_all, dim=1))
        return head if head._kernel_is_exact(q, scale) else None

    def _kernel_is_exact(self, q: torch.Tensor, scale: torch.Tensor) -> bool:
        """Whether integer rows at the extremes of [-levels, levels] come back as their exact int8 products."""
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-self.levels, self.levels + 1, (13, q.shape[1]), generator=g, dtype=torch.int16)
        x[0] = self.levels  # the largest sums the levels allow
        x[1] = -self.levels
        got = self._logits(x, torch.ones(len(x))).double()
        cols = torch.randint(0, len(self.weight), (512,), generator=g)
        want = (x.double() @ q[cols].double().T) * scale[cols].double()
        size = x.abs().double() @ q[cols].abs().double().T * scale[cols].double()
        return bool(((got[:, cols] - want).abs() <= 1e-6 * size + 1e-30).all())

    def _logits(self, x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        """(x @ q.T) * row_scale * scale for int16 rows x [N, D']: [N, V] float32."""
        x, row_scale = x.contiguous(), row_scale.float().contiguous()
        y = torch.empty(len(x), len(self.scale))
        _kernel.library.int8_logits(x.data_ptr(), len(x), self.pairs, self.packed.data_ptr(), len(self.scale),
                                    row_scale.data_ptr(), self.scale.data_ptr(), y.data_ptr(),
                                    torch.get_num_threads(), self.isa)
        return y[:, : len(self.weight)]

    @torch.inference_mode()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """argmax(h @ weight.T, -1) for h [N, D] float32 with N <= max_rows, the lowest id on an exact tie; -1
        for a row whose distribution is so flat that more than FEW tokens are within the bound of its best
        (rare on real text: after random tokens), which the float32 layer then decides faster."""
        ids, _, _ = self.top_k(h, 1)
        return ids[:, 0]

    @torch.inference_mode()
    def top_k(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's k largest logits of h @ weight.T, exact, largest first (lower ids first on ties): (ids [N, k],
        logits [N, k], every token's logit with the int8 approximation where not computed exactly [N, V]);
        ids -1 for a row left to float32 (see __call__)."""
        if not 1 <= k <= MAX_K:
            raise ValueError(f"the int8 argmax gives 1 to {MAX_K} largest logits, not {k}")
        n = len(h)
        s = (h.abs().amax(1, keepdim=True) / self.levels).clamp_min(torch.finfo(torch.float32).tiny)
        q = (h / s).round_().clamp_(-self.levels, self.levels)
        x = q * s
        if self.pairs * 2 != self.dim:
            q = torch.nn.functional.pad(q, (0, 1))
        approx = self._logits(q.to(torch.int16), s.squeeze(1))
        # token j's bound is a * ||w_j|| + b * ||e_j||, per row
        a = ((h - x).norm(dim=1) + self.margin * h.norm(dim=1)).contiguous()
        b = x.norm(dim=1).contiguous()
        candidates, counts = torch.empty(n, FEW, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        _kernel.library.int8_candidates(approx.data_ptr(), n, approx.shape[1], approx.stride(0), a.data_ptr(),
                                        b.data_ptr(), self.norms.data_ptr(), self.err.data_ptr(), k, FEW,
                                        candidates.data_ptr(), counts.data_ptr(), torch.get_num_threads())
        ids_out = torch.full((n, k), -1, dtype=torch.long)
        logits_out = torch.zeros(n, k)
        for r, count in enumerate(counts.tolist()):
            if not k <= count <= FEW:  # a flat distribution (or a NaN): left to float32
                continue
            ids = candidates[r, :count]
            exact = (self.weight.detach()[ids] * h[r]).sum(1)  # not a gemv: equal rows must give equal sums
            approx[r, ids] = exact
            order = exact.sort(descending=True, stable=True).indices[:k]
            ids_out[r], logits_out[r] = ids[order], exact[order]
        return ids_out, logits_out, approx
