// y = x @ W^T in float32 for a verifier's small passes on an AVX2/FMA CPU (cloud/avx2_linear.py builds and loads
// this file). A pass of a few rows reads every weight once and is bound by memory there; the libraries' kernels
// (oneDNN, MKL, OpenBLAS) cost 1.4-1.6x a one-row pass at 4-8 rows on this project's CPU, where streaming the
// weight once with every row's sums in registers costs 1.1-1.2x (BENCHMARKS.md section 1). Each output is one
// sum over k in order, whatever the number of rows: a row's result does not depend on the rows beside it.
#include <immintrin.h>

// The next panel is fetched into L2 while this one is computed: a row group after the first reads its panel
// from cache, and the stream from memory does not wait on the arithmetic.
#define PREFETCH(k) _mm_prefetch((const char*)(next + (k) * 16), _MM_HINT_T1)

// R rows (1..4) times one panel: 2R accumulators, few enough that the compiler keeps them in registers.
template <int R>
static inline void rows(const float* x, long K, const float* panel, const float* next, float* y, long N) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
  for (long k = 0; k < K; k++) {
    PREFETCH(k);
    __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      __m256 b = _mm256_broadcast_ss(x + r * K + k);
      a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(y + r * N, a0[r]);
    _mm256_storeu_ps(y + r * N + 8, a1[r]);
  }
}

// Six rows, spelled out: as an array of twelve accumulators the compiler spills them to the stack every step.
static inline void rows6(const float* x, long K, const float* panel, const float* next, float* y, long N) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K, *x4 = x + 4 * K, *x5 = x + 5 * K;
  for (long k = 0; k < K; k++) {
    PREFETCH(k);
    __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8), b;
    b = _mm256_broadcast_ss(x0 + k); a00 = _mm256_fmadd_ps(b, w0, a00); a01 = _mm256_fmadd_ps(b, w1, a01);
    b = _mm256_broadcast_ss(x1 + k); a10 = _mm256_fmadd_ps(b, w0, a10); a11 = _mm256_fmadd_ps(b, w1, a11);
    b = _mm256_broadcast_ss(x2 + k); a20 = _mm256_fmadd_ps(b, w0, a20); a21 = _mm256_fmadd_ps(b, w1, a21);
    b = _mm256_broadcast_ss(x3 + k); a30 = _mm256_fmadd_ps(b, w0, a30); a31 = _mm256_fmadd_ps(b, w1, a31);
    b = _mm256_broadcast_ss(x4 + k); a40 = _mm256_fmadd_ps(b, w0, a40); a41 = _mm256_fmadd_ps(b, w1, a41);
    b = _mm256_broadcast_ss(x5 + k); a50 = _mm256_fmadd_ps(b, w0, a50); a51 = _mm256_fmadd_ps(b, w1, a51);
  }
  float* o = y;
  _mm256_storeu_ps(o, a00); _mm256_storeu_ps(o + 8, a01); o += N;
  _mm256_storeu_ps(o, a10); _mm256_storeu_ps(o + 8, a11); o += N;
  _mm256_storeu_ps(o, a20); _mm256_storeu_ps(o + 8, a21); o += N;
  _mm256_storeu_ps(o, a30); _mm256_storeu_ps(o + 8, a31); o += N;
  _mm256_storeu_ps(o, a40); _mm256_storeu_ps(o + 8, a41); o += N;
  _mm256_storeu_ps(o, a50); _mm256_storeu_ps(o + 8, a51);
}

// y [M][N] = x [M][K] @ W^T, W [N][K] packed in panels of 16 outputs, k by k (packed[(p * K + k) * 16 + j] =
// W[p * 16 + j][k], N % 16 == 0: cloud/avx2_linear.py); panels shared out among `threads` (OpenMP, the runtime torch
// itself uses).
extern "C" void avx2_matmul(const float* x, long M, long K, const float* packed, long N, float* y, int threads) {
  long panels = N / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long p = 0; p < panels; p++) {
    const float* panel = packed + p * K * 16;
    const float* next = p + 1 < panels ? panel + K * 16 : panel;
    for (long r0 = 0; r0 < M; r0 += 6) {
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N + p * 16;
      switch (M - r0 < 6 ? M - r0 : 6) {
        case 1: rows<1>(xr, K, panel, next, yr, N); break;
        case 2: rows<2>(xr, K, panel, next, yr, N); break;
        case 3: rows<3>(xr, K, panel, next, yr, N); break;
        case 4: rows<4>(xr, K, panel, next, yr, N); break;
        case 5: rows<4>(xr, K, panel, next, yr, N); rows<1>(xr + 4 * K, K, panel, next, yr + 4 * N, N); break;
        default: rows6(xr, K, panel, next, yr, N); break;
      }
    }
  }
}
