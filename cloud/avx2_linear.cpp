// y = x @ W^T in float32 for a verifier's small passes on an AVX2/FMA CPU (cloud/avx2_linear.py builds and loads
// this file). A pass of a few rows reads every weight once and is bound by memory there; the libraries' kernels
// (oneDNN, MKL, OpenBLAS) cost 1.4-1.6x a one-row pass at 4-8 rows on this project's CPU, where streaming the
// weight once with every row's sums in registers costs 1.1-1.2x (BENCHMARKS.md section 1). Each output is one
// sum over k in order, whatever the number of rows: a row's result does not depend on the rows beside it. Where the
// CPU has AVX-512, passes of 7-20 rows keep more sums in registers (panel_avx512), with the same bits.
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

// Five or six rows, spelled out: as an array of ten or twelve accumulators the compiler spills them to the stack every
// step. The sixth row's lines are compiled only for R = 6.
template <int R>
static inline void rows56(const float* x, long K, const float* panel, const float* next, float* y, long N) {
  static_assert(R == 5 || R == 6);
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K, *x4 = x + 4 * K, *x5 = x + (R - 1) * K;
  for (long k = 0; k < K; k++) {
    PREFETCH(k);
    __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8), b;
    b = _mm256_broadcast_ss(x0 + k); a00 = _mm256_fmadd_ps(b, w0, a00); a01 = _mm256_fmadd_ps(b, w1, a01);
    b = _mm256_broadcast_ss(x1 + k); a10 = _mm256_fmadd_ps(b, w0, a10); a11 = _mm256_fmadd_ps(b, w1, a11);
    b = _mm256_broadcast_ss(x2 + k); a20 = _mm256_fmadd_ps(b, w0, a20); a21 = _mm256_fmadd_ps(b, w1, a21);
    b = _mm256_broadcast_ss(x3 + k); a30 = _mm256_fmadd_ps(b, w0, a30); a31 = _mm256_fmadd_ps(b, w1, a31);
    b = _mm256_broadcast_ss(x4 + k); a40 = _mm256_fmadd_ps(b, w0, a40); a41 = _mm256_fmadd_ps(b, w1, a41);
    if constexpr (R == 6) {
      b = _mm256_broadcast_ss(x5 + k); a50 = _mm256_fmadd_ps(b, w0, a50); a51 = _mm256_fmadd_ps(b, w1, a51);
    }
  }
  float* o = y;
  _mm256_storeu_ps(o, a00); _mm256_storeu_ps(o + 8, a01); o += N;
  _mm256_storeu_ps(o, a10); _mm256_storeu_ps(o + 8, a11); o += N;
  _mm256_storeu_ps(o, a20); _mm256_storeu_ps(o + 8, a21); o += N;
  _mm256_storeu_ps(o, a30); _mm256_storeu_ps(o + 8, a31); o += N;
  _mm256_storeu_ps(o, a40); _mm256_storeu_ps(o + 8, a41);
  if constexpr (R == 6) {
    o += N;
    _mm256_storeu_ps(o, a50); _mm256_storeu_ps(o + 8, a51);
  }
}

// One panel for M rows, in groups of six, the last twelve or fewer in two of about equal size: a group of one or two
// after a full one would read the panel again from L2 with too few sums in flight to hide the FMA's latency (+4 ms
// of a 5-row SmolLM2 pass as four rows and one).
static void panel_avx2(const float* x, long M, long K, const float* panel, const float* next, float* y, long N) {
  for (long r0 = 0; r0 < M;) {
    long left = M - r0, n = left <= 6 ? left : left < 12 ? (left + 1) / 2 : 6;
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    switch (n) {
      case 1: rows<1>(xr, K, panel, next, yr, N); break;
      case 2: rows<2>(xr, K, panel, next, yr, N); break;
      case 3: rows<3>(xr, K, panel, next, yr, N); break;
      case 4: rows<4>(xr, K, panel, next, yr, N); break;
      case 5: rows56<5>(xr, K, panel, next, yr, N); break;
      default: rows56<6>(xr, K, panel, next, yr, N); break;
    }
    r0 += n;
  }
}

// AVX-512, where the CPU has it: a panel's 16 outputs are one register, so one read of the weight serves the sums of
// up to 10 rows (on AVX2 a pass of more than six rows reads each panel again; groups of more than 10 measured
// slower). Each output lane runs the same FMAs over k in the same order as on AVX2: the same bits.
#define AVX512 __attribute__((target("avx512f")))

template <int R>
AVX512 static inline void rows512(const float* x, long K, const float* panel, const float* next, float* y, long N) {
  __m512 a[R];
#pragma GCC unroll 10
  for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();
  for (long k = 0; k < K; k++) {
    PREFETCH(k);
    __m512 w = _mm512_loadu_ps(panel + k * 16);
#pragma GCC unroll 10
    for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, a[r]);
  }
#pragma GCC unroll 10
  for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * N, a[r]);
}

AVX512 static void panel_avx512(const float* x, long M, long K, const float* panel, const float* next, float* y,
                                long N) {
  long groups = (M + 9) / 10;
  for (long r0 = 0, g = 0; g < groups; g++) {
    long n = (M - r0) / (groups - g);  // groups of about equal size
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    switch (n) {
      case 1: rows512<1>(xr, K, panel, next, yr, N); break;
      case 2: rows512<2>(xr, K, panel, next, yr, N); break;
      case 3: rows512<3>(xr, K, panel, next, yr, N); break;
      case 4: rows512<4>(xr, K, panel, next, yr, N); break;
      case 5: rows512<5>(xr, K, panel, next, yr, N); break;
      case 6: rows512<6>(xr, K, panel, next, yr, N); break;
      case 7: rows512<7>(xr, K, panel, next, yr, N); break;
      case 8: rows512<8>(xr, K, panel, next, yr, N); break;
      case 9: rows512<9>(xr, K, panel, next, yr, N); break;
      default: rows512<10>(xr, K, panel, next, yr, N); break;
    }
    r0 += n;
  }
}

// Which instructions this CPU runs the kernel with: 2 for AVX-512, 1 for AVX2 (the caller has checked for it).
extern "C" int avx2_matmul_isa(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

// y [M][N] = x [M][K] @ W^T, W [N][K] packed in panels of 16 outputs, k by k (packed[(p * K + k) * 16 + j] =
// W[p * 16 + j][k], N % 16 == 0: cloud/avx2_linear.py); panels shared out among `threads` (OpenMP, the runtime torch
// itself uses); isa as avx2_matmul_isa gives, or 1.
extern "C" void avx2_matmul(const float* x, long M, long K, const float* packed, long N, float* y, int threads,
                            int isa) {
  long panels = N / 16;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long p = 0; p < panels; p++) {
    const float* panel = packed + p * K * 16;
    const float* next = p + 1 < panels ? panel + K * 16 : panel;
    if (isa == 2 && M > 6 && M <= 20)  // (up to six rows AVX2 reads the weight once too; beyond 20 the products
                                       // are bound by the arithmetic, which AVX2's six rows do as fast or faster)
      panel_avx512(x, M, K, panel, next, y + p * 16, N);
    else
      panel_avx2(x, M, K, panel, next, y + p * 16, N);
  }
}
