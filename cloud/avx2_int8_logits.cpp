// Approximate logits y = (x @ Q^T) * row_scale * col_scale from an int8 copy Q of the output layer and int16 rows x,
// for the exact argmax of a greedy step (cloud/int8_argmax.py builds, loads and bounds it). Every weight is read once
// for all the rows, as in cloud/avx2_linear.cpp, so a step of 8-12 rows costs little more than one row, where a
// library's int8 kernel reads the weight once per group of a few rows. The integer sums are exact (the caller
// chooses the rows' levels so that no sum can overflow 32 bits); only the two final products round.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

// Packed weight: panels of 16 outputs; in a panel, for each pair of k, 32 int8 [out 0: k, k+1, out 1: k, k+1, ...]
// (packed[((p * K2 + kp) * 16 + j) * 2 + t] = Q[p * 16 + j][2 * kp + t]), which multiply-add-pairs instructions
// take as they are. x: M rows of 2 * K2 int16, read as K2 int32 pairs.

#define PREFETCH(kp) _mm_prefetch((const char*)(next + (kp) * 32), _MM_HINT_T1)

static inline void store(__m256i acc, float rs, const float* cs, float* y) {
  _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(rs)), _mm256_loadu_ps(cs)));
}

// AVX2: R rows (1..6) times one panel, two 8-output accumulators a row.
template <int R>
static inline void rows_avx2(const int32_t* x, long K2, const int8_t* panel, const int8_t* next, const float* rs,
                             const float* cs, float* y, long N) {
  __m256i a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_si256();
  for (long kp = 0; kp < K2; kp++) {
    if ((kp & 1) == 0) PREFETCH(kp);
    __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(panel + kp * 32)));
    __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(panel + kp * 32 + 16)));
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
      __m256i b = _mm256_set1_epi32(x[r * K2 + kp]);
      a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(w0, b));
      a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(w1, b));
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; r++) {
    store(a0[r], rs[r], cs, y + r * N);
    store(a1[r], rs[r], cs + 8, y + r * N + 8);
  }
}

static void panel_avx2(const int32_t* x, long M, long K2, const int8_t* panel, const int8_t* next, const float* rs,
                       const float* cs, float* y, long N) {
  for (long r0 = 0; r0 < M; r0 += 6) {
    const int32_t* xr = x + r0 * K2;
    float* yr = y + r0 * N;
    switch (M - r0 < 6 ? M - r0 : 6) {
      case 1: rows_avx2<1>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
      case 2: rows_avx2<2>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
      case 3: rows_avx2<3>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
      case 4: rows_avx2<4>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
      case 5: rows_avx2<5>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
      default: rows_avx2<6>(xr, K2, panel, next, rs + r0, cs, yr, N); break;
    }
  }
}

// AVX-512 VNNI, where the CPU has it: one 16-output accumulator a row, one instruction per row and pair of k.
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

template <int R>
VNNI static inline void rows_vnni(const int32_t* x, long K2, const int8_t* panel, const int8_t* next, const float* rs,
                                  const float* cs, float* y, long N) {
  __m512i a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; r++) a[r] = _mm512_setzero_si512();
  for (long kp = 0; kp < K2; kp++) {
    if ((kp & 1) == 0) PREFETCH(kp);
    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(panel + kp * 32)));
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) a[r] = _mm512_dpwssd_epi32(a[r], w, _mm512_set1_epi32(x[r * K2 + kp]));
  }
  __m512 c = _mm512_loadu_ps(cs);
#pragma GCC unroll 12
  for (int r = 0; r < R; r++)
    _mm512_storeu_ps(y + r * N, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[r]), _mm512_set1_ps(rs[r])), c));
}

VNNI static void panel_vnni(const int32_t* x, long M, long K2, const int8_t* panel, const int8_t* next,
                            const float* rs, const float* cs, float* y, long N) {
  for (long r0 = 0; r0 < M; r0 += 12) {
    const int32_t* xr = x + r0 * K2;
    float* yr = y + r0 * N;
    const float* s = rs + r0;
    switch (M - r0 < 12 ? M - r0 : 12) {
      case 1: rows_vnni<1>(xr, K2, panel, next, s, cs, yr, N); break;
      case 2: rows_vnni<2>(xr, K2, panel, next, s, cs, yr, N); break;
      case 3: rows_vnni<3>(xr, K2, panel, next, s, cs, yr, N); break;
      case 4: rows_vnni<4>(xr, K2, panel, next, s, cs, yr, N); break;
      case 5: rows_vnni<5>(xr, K2, panel, next, s, cs, yr, N); break;
      case 6: rows_vnni<6>(xr, K2, panel, next, s, cs, yr, N); break;
      case 7: rows_vnni<7>(xr, K2, panel, next, s, cs, yr, N); break;
      case 8: rows_vnni<8>(xr, K2, panel, next, s, cs, yr, N); break;
      case 9: rows_vnni<9>(xr, K2, panel, next, s, cs, yr, N); break;
      case 10: rows_vnni<10>(xr, K2, panel, next, s, cs, yr, N); break;
      case 11: rows_vnni<11>(xr, K2, panel, next, s, cs, yr, N); break;
      default: rows_vnni<12>(xr, K2, panel, next, s, cs, yr, N); break;
    }
  }
}

// Which instructions this CPU runs the kernel with: 2 for AVX-512 VNNI, 1 for AVX2 (the caller has checked for it).
extern "C" int int8_logits_isa(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl")
             ? 2
             : 1;
}

// y [M][N] = (x [M][2 * K2] @ Q^T) * row_scale[m] * col_scale[n], Q [N][2 * K2] packed as above (N % 16 == 0);
// panels shared out among `threads` (OpenMP, the runtime torch itself uses); isa as int8_logits_isa gives, or 1.
extern "C" void int8_logits(const int16_t* x, long M, long K2, const int8_t* packed, long N, const float* row_scale,
                            const float* col_scale, float* y, int threads, int isa) {
  long panels = N / 16;
  const int32_t* pairs = (const int32_t*)x;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long p = 0; p < panels; p++) {
    const int8_t* panel = packed + p * K2 * 32;
    const int8_t* next = p + 1 < panels ? panel + K2 * 32 : panel;
    if (isa == 2)
      panel_vnni(pairs, M, K2, panel, next, row_scale, col_scale + p * 16, y + p * 16, N);
    else
      panel_avx2(pairs, M, K2, panel, next, row_scale, col_scale + p * 16, y + p * 16, N);
  }
}

// The tokens a row's exact top k must come from, for the bound cloud/int8_argmax.py derives: token j's logit lies
// within a * norms[j] + b * err[j] of approx[j]. The k largest lower bounds give a floor that k logits reach; every
// token whose upper bound reaches the floor is a candidate. ids [M][cap] takes each row's first cap candidates in
// id order, counts [M] how many there were (beyond cap too); 0 for a row with a NaN bound or approximation.
static inline __m256 bound8(const float* norms, const float* err, long j, __m256 a, __m256 b) {
  return _mm256_fmadd_ps(a, _mm256_loadu_ps(norms + j), _mm256_mul_ps(b, _mm256_loadu_ps(err + j)));
}

// v into best[0..k), kept largest first, where it beats the k-th.
static inline void keep_if_larger(float* best, int k, float v) {
  if (!(v > best[k - 1])) return;
  int i = k - 1;
  for (; i > 0 && best[i - 1] < v; i--) best[i] = best[i - 1];
  best[i] = v;
}

static long row_candidates(const float* approx, long V, float a, float b, const float* norms, const float* err, int k,
                           long cap, int64_t* ids) {
  float best[64];  // the k largest lower bounds so far, largest first (k <= 64)
  for (int i = 0; i < k; i++) best[i] = -INFINITY;
  __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  long j = 0;
  for (; j + 8 <= V; j += 8) {
    __m256 lower = _mm256_sub_ps(_mm256_loadu_ps(approx + j), bound8(norms, err, j, va, vb));
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(lower, _mm256_set1_ps(best[k - 1]), _CMP_GT_OQ));
    if (!mask) continue;
    float lanes[8];
    _mm256_storeu_ps(lanes, lower);
    for (int t = 0; t < 8; t++)
      if (mask >> t & 1) keep_if_larger(best, k, lanes[t]);
  }
  for (; j < V; j++) keep_if_larger(best, k, approx[j] - (a * norms[j] + b * err[j]));
  float floor_ = best[k - 1];
  if (!(floor_ > -INFINITY)) return 0;  // NaN, or fewer than k finite bounds: for the float32 layer
  __m256 vf = _mm256_set1_ps(floor_);
  long count = 0;
  for (j = 0; j + 8 <= V; j += 8) {
    __m256 upper = _mm256_add_ps(_mm256_loadu_ps(approx + j), bound8(norms, err, j, va, vb));
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(upper, vf, _CMP_GE_OQ));
    for (; mask; mask &= mask - 1, count++)
      if (count < cap) ids[count] = j + __builtin_ctz(mask);
  }
  for (; j < V; j++)
    if (approx[j] + (a * norms[j] + b * err[j]) >= floor_) {
      if (count < cap) ids[count] = j;
      count++;
    }
  return count;
}

extern "C" void int8_candidates(const float* approx, long M, long V, long ld, const float* a, const float* b,
                                const float* norms, const float* err, int k, long cap, int64_t* ids, long* counts,
                                int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (long m = 0; m < M; m++)
    counts[m] = row_candidates(approx + m * ld, V, a[m], b[m], norms, err, k, cap, ids + m * cap);
}
