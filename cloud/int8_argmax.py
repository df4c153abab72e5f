"""Each row's argmax of h @ W.T, exact, for a quarter of the bytes of W: what greedy verification needs.

The output layer is a small model's largest matrix (Gemma 3 270M: 262k x 640, 671 MB in float32; SmolLM2
135M: 113 MB), and on the CPU its cost is reading it: 83 ms for one row at 262k on one core, 107 ms for 8,
about 40% of a pass. Greedy verification needs only each row's argmax. Here fbgemm's int8 kernel reads a
per-row int8 copy of W (21 ms for 3 rows, 44 ms for 17), every token's logit is bounded around that
approximation, and only the few tokens (tens) whose upper bound reaches the best lower bound are computed
again, exactly, from W in float32. The k largest logits (a greedy session's hints) come the same way, from
the tokens whose upper bound reaches the lowest lower bound of the k likeliest.

The bound, for a row h and a token j:
- h = s1 q1 + s2 q2 + d, with q1, q2 integer vectors in [-63, 63] (fbgemm's activations are 7-bit on CPUs
  without VNNI) and |d_i| <= s2 / 2. Passed as floats beside one row that pins the batch's range to
  [-63, 64], fbgemm's own quantisation (scale (max - min) / 127) maps them onto themselves, so the int8
  product of x = s1 q1 + s2 q2 with the int8 weight is integer arithmetic, exact up to float rounding.
- w_j = scale_j qw_j + e_j, with e_j known from the quantisation.
- |h.w_j - approx_j| <= ||d|| ||w_j|| + ||x|| ||e_j|| + a float rounding margin, by Cauchy-Schwarz.
`build` checks the kernel against exact integer arithmetic first, and gives None if it disagrees (another
torch, another CPU): the caller then keeps the float32 layer. Not lossy in any case the check lets through.
"""

from __future__ import annotations

import warnings

import torch

LEVELS = 63  # |q| <= 63: 7-bit activations, as fbgemm quantises them without VNNI (reduce_range)
MAX_ROWS = 12  # beyond, the int8 kernel (2 rows per row) costs as much as float32: 65 ms for 25 rows against 125
FEW = 8192  # tokens recomputed in float32 at most, per row: a 21 MB gather at D = 640, a quarter of the int8 read
_ROUNDING = 4 * torch.finfo(torch.float32).eps  # per summed term, far above what float32 dot products lose
_CHUNK = 8192  # rows of W quantised at a time: no full-size float temporaries


class Int8Argmax:
    def __init__(self, weight: torch.Tensor, packed, err: torch.Tensor, norms: torch.Tensor) -> None:
        self.weight = weight  # [V, D] float32, for the exact rescoring
        self.version = weight._version  # the weight as quantised (in-place writes raise its _version)
        self.packed = packed  # fbgemm's int8 weight
        self.err = err  # ||e_j||
        self.norms = norms  # ||w_j||
        self.max_err, self.max_norm = float(err.max()), float(norms.max())
        self.margin = _ROUNDING * weight.shape[1]
        self._pin = torch.zeros(1, weight.shape[1])
        self._pin[0, 0], self._pin[0, -1] = -LEVELS, LEVELS + 1

    @classmethod
    def build(cls, weight: torch.Tensor) -> "Int8Argmax | None":
        """The int8 argmax of `weight` [V, D] (float32, on the CPU), or None where fbgemm's int8 kernel is
        missing or does not compute what the bound assumes. Takes seconds at 262k x 640 (fbgemm's packing:
        ~4 s on one core), so built once per weight and when first needed (OutputLayer)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.shape[1] < 2:
            return None
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return None
        w_all = weight.detach()
        q = torch.empty(weight.shape, dtype=torch.int8)
        scale, err = torch.empty(len(weight)), torch.empty(len(weight))
        for start in range(0, len(weight), _CHUNK):
            rows = slice(start, start + _CHUNK)
            w = w_all[rows]
            s = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            levels = (w / s[:, None]).round_()
            q[rows], scale[rows] = levels.to(torch.int8), s
            err[rows] = torch.linalg.vector_norm(levels.mul_(s[:, None]).sub_(w), dim=1)
        with warnings.catch_warnings():  # quantised tensors are deprecated as a user API; the kernel is not
            warnings.simplefilter("ignore")
            zero = torch.zeros(len(q), dtype=torch.long)
            per_channel = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            packed = torch.ops.quantized.linear_prepack(per_channel, None)
        head = cls(weight, packed, err, torch.linalg.vector_norm(w_all, dim=1))
        return head if head._kernel_is_exact(q, scale) else None

    def _kernel_is_exact(self, q: torch.Tensor, scale: torch.Tensor) -> bool:
        """Whether integer rows in [-63, 63] beside the pinning row come back as their exact int8 products."""
        g = torch.Generator().manual_seed(0)
        x = torch.randint(-LEVELS, LEVELS + 1, (3, q.shape[1]), generator=g).float()
        got = torch.ops.quantized.linear_dynamic(torch.cat([x, self._pin]), self.packed, True)[:3].double()
        cols = torch.randint(0, len(q), (512,), generator=g)
        want = (x.double() @ q[cols].double().T) * scale[cols].double()
        size = x.abs().double() @ q[cols].abs().double().T * scale[cols].double()
        return bool(((got[:, cols] - want).abs() <= 1e-6 * size + 1e-30).all())

    @torch.inference_mode()
    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """argmax(h @ weight.T, -1) for h [N, D] float32 with N <= MAX_ROWS, the lowest id on an exact tie; -1
        for a row whose distribution is so flat that more than FEW tokens are within the bound of its best
        (rare on real text: after random tokens), which the float32 layer then decides faster."""
        ids, _, _ = self.top_k(h, 1)
        return ids[:, 0]

    @torch.inference_mode()
    def top_k(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's k largest logits of h @ weight.T, exact, largest first (lower ids first on ties): (ids [N, k],
        logits [N, k], every token's logit with the int8 approximation where not computed exactly [N, V]);
        ids -1 for a row left to float32 (see __call__)."""
        n = len(h)
        s1 = (h.abs().amax(1, keepdim=True) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        q1 = (h / s1).round()
        rest = h - q1 * s1
        s2 = (rest.abs().amax(1, keepdim=True) / LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        q2 = (rest / s2).round()
        x = q1 * s1 + q2 * s2
        out = torch.ops.quantized.linear_dynamic(torch.cat([q1, q2, self._pin]), self.packed, True)
        approx = torch.addcmul(out[:n] * s1, out[n : 2 * n], s2)
        # bound_j = a * ||w_j|| + b * ||e_j||, per row
        a = (h - x).norm(dim=1, keepdim=True) + self.margin * h.norm(dim=1, keepdim=True)
        b = x.norm(dim=1, keepdim=True)
        likely_top, likely = approx.topk(k, dim=1)
        floor = (likely_top - (a * self.norms[likely] + b * self.err[likely])).amin(1)  # k tokens are above it
        widest = (a * self.max_norm + b * self.max_err).squeeze(1)
        a, b = a.squeeze(1), b.squeeze(1)
        ids_out = torch.full((n, k), -1, dtype=torch.long)
        logits_out = torch.zeros(n, k)
        for r in range(n):
            ids = (approx[r] >= floor[r] - widest[r]).nonzero().squeeze(1)
            if len(ids) > FEW:  # the widest token's bound is too wide here: every token's own, over the row
                ids = (torch.addcmul(approx[r] + a[r] * self.norms, self.err, b[r]) >= floor[r]).nonzero().squeeze(1)
            ids = ids[approx[r, ids] + a[r] * self.norms[ids] + b[r] * self.err[ids] >= floor[r]]
            if len(ids) > FEW:  # a flat distribution: left to float32
                continue
            exact = (self.weight.detach()[ids] * h[r]).sum(1)  # not a gemv: equal rows must give equal sums
            approx[r, ids] = exact
            order = exact.sort(descending=True, stable=True).indices[:k]
            ids_out[r], logits_out[r] = ids[order], exact[order]
        return ids_out, logits_out, approx
