// One sequence's attention for a verifier's small passes on an AVX2/FMA CPU, read straight from the paged KV pool
// (cloud/avx2_attention.py builds and loads this file). The pool holds a layer's keys as [slot][kv head][dim], so
// one head's keys are rows 256 B apart for SmolLM2: the libraries' batched products over that strided view run at a
// few GB/s, and a one-token pass over a 900-token context spent a quarter of its time in attention (BENCHMARKS.md
// section 1). Here each key and value is read where it lies, once for all the query vectors of its kv head (a
// block of them per thread), the values in tiles that stay in cache while every row's sums run over them.
//
// Every query vector's result is computed by the same sequence of operations whatever the block it falls in, so a
// row's output does not depend on the rows beside it.
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax after its max is subtracted), within ~2 ulp: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by
// its degree-7 Taylor polynomial, 2^n through the exponent bits; below -87 (where e^x leaves float's normal range) 0.
__m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

float exp_nonpositive(float x) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, exp_nonpositive(_mm256_set1_ps(x)));
  return lanes[0];
}

// Dot products of query vectors q0, q1 with keys k[0..3] (D a multiple of 8), times `scale`, into s0[0..3] and
// s1[0..3]. Each sum runs over d in order in one lane set, then adds its lanes as ((0+1)+(2+3))+((4+5)+(6+7)),
// whichever query and keys it is paired with.
inline void dots2x4(const float* q0, const float* q1, const float* const* k, long D, __m256 scale, float* s0,
                    float* s1) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  for (long d = 0; d < D; d += 8) {
    __m256 x0 = _mm256_loadu_ps(q0 + d), x1 = _mm256_loadu_ps(q1 + d), y;
    y = _mm256_loadu_ps(k[0] + d); a00 = _mm256_fmadd_ps(x0, y, a00); a10 = _mm256_fmadd_ps(x1, y, a10);
    y = _mm256_loadu_ps(k[1] + d); a01 = _mm256_fmadd_ps(x0, y, a01); a11 = _mm256_fmadd_ps(x1, y, a11);
    y = _mm256_loadu_ps(k[2] + d); a02 = _mm256_fmadd_ps(x0, y, a02); a12 = _mm256_fmadd_ps(x1, y, a12);
    y = _mm256_loadu_ps(k[3] + d); a03 = _mm256_fmadd_ps(x0, y, a03); a13 = _mm256_fmadd_ps(x1, y, a13);
  }
  // hadd twice leaves [lanes 0-3 of each accumulator | lanes 4-7 of each]; the halves' sum is the four dots
  __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a00, a01), _mm256_hadd_ps(a02, a03));
  __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a10, a11), _mm256_hadd_ps(a12, a13));
  __m128 lo = _mm256_castps256_ps128(scale);
  _mm_storeu_ps(s0, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t0), _mm256_extractf128_ps(t0, 1)), lo));
  _mm_storeu_ps(s1, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1)), lo));
}

// Scaled scores s [rows][C] of the query vectors q against every key (C padded to a multiple of 4 in `s`'s
// stride `ld`); then masked ones -inf.
void scores(const float* const* q, long rows, const float* const* keys, long C, long D, float scale,
            const unsigned char* const* mask, float* s, long ld) {
  __m256 sc = _mm256_set1_ps(scale);
  float spare[4];
  for (long c = 0; c < C; c += 4) {
    const float* k[4];
    for (int i = 0; i < 4; i++) k[i] = keys[c + i < C ? c + i : C - 1];  // the last block repeats its last key
    long r = 0;
    for (; r + 2 <= rows; r += 2) dots2x4(q[r], q[r + 1], k, D, sc, s + r * ld + c, s + (r + 1) * ld + c);
    if (r < rows) dots2x4(q[r], q[r], k, D, sc, s + r * ld + c, spare);
  }
  for (long r = 0; r < rows; r++) {
    if (!mask[r]) continue;
    float* row = s + r * ld;
    const unsigned char* m = mask[r];
    for (long j = 0; j < C; j++) row[j] = m[j] ? row[j] : -INFINITY;
  }
}

// Each score row in place as its softmax's weights, unnormalised, and 1 / their sum in `inv`.
void softmax_rows(float* s, long rows, long C, long ld, float* inv) {
  for (long r = 0; r < rows; r++) {
    float* row = s + r * ld;
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= C; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = lanes[0];
    for (int i = 1; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (; j < C; j++) top = row[j] > top ? row[j] : top;
    __m256 t = _mm256_set1_ps(top), total = _mm256_setzero_ps();
    for (j = 0; j + 8 <= C; j += 8) {
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), t));
      _mm256_storeu_ps(row + j, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; j < C; j++) sum += row[j] = exp_nonpositive(row[j] - top);
    inv[r] = 1.0f / sum;
  }
}

constexpr long kValueTile = 64;  // keys whose values stay in L1/L2 while every row's sums run over them

// out[r] = inv[r] * sum_c w[r][c] v_c, each sum over c in order: tiles of keys, within a tile 32 dimensions of
// two rows at a time in registers, carried between tiles in `acc` [rows][D].
void weighted_values(const float* w, long ld, long rows, const float* const* values, long C, long D,
                     const float* inv, float* acc, float* const* out) {
  for (long c0 = 0; c0 < C; c0 += kValueTile) {
    long c1 = c0 + kValueTile < C ? c0 + kValueTile : C;
    for (long d0 = 0; d0 < D; d0 += 32) {
      for (long r = 0; r < rows; r += 2) {
        long r1 = r + 1 < rows ? r + 1 : r;  // an odd last row pairs with itself
        const float *w0 = w + r * ld, *w1 = w + r1 * ld;
        float *acc0 = acc + r * D + d0, *acc1 = acc + r1 * D + d0;
        __m256 a00, a01, a02, a03, a10, a11, a12, a13;
        if (c0 == 0) {
          a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = _mm256_setzero_ps();
        } else {
          a00 = _mm256_loadu_ps(acc0); a01 = _mm256_loadu_ps(acc0 + 8);
          a02 = _mm256_loadu_ps(acc0 + 16); a03 = _mm256_loadu_ps(acc0 + 24);
          a10 = _mm256_loadu_ps(acc1); a11 = _mm256_loadu_ps(acc1 + 8);
          a12 = _mm256_loadu_ps(acc1 + 16); a13 = _mm256_loadu_ps(acc1 + 24);
        }
        for (long c = c0; c < c1; c++) {
          const float* v = values[c] + d0;
          __m256 b0 = _mm256_broadcast_ss(w0 + c), b1 = _mm256_broadcast_ss(w1 + c), y;
          y = _mm256_loadu_ps(v); a00 = _mm256_fmadd_ps(b0, y, a00); a10 = _mm256_fmadd_ps(b1, y, a10);
          y = _mm256_loadu_ps(v + 8); a01 = _mm256_fmadd_ps(b0, y, a01); a11 = _mm256_fmadd_ps(b1, y, a11);
          y = _mm256_loadu_ps(v + 16); a02 = _mm256_fmadd_ps(b0, y, a02); a12 = _mm256_fmadd_ps(b1, y, a12);
          y = _mm256_loadu_ps(v + 24); a03 = _mm256_fmadd_ps(b0, y, a03); a13 = _mm256_fmadd_ps(b1, y, a13);
        }
        _mm256_storeu_ps(acc1, a10); _mm256_storeu_ps(acc1 + 8, a11);
        _mm256_storeu_ps(acc1 + 16, a12); _mm256_storeu_ps(acc1 + 24, a13);
        _mm256_storeu_ps(acc0, a00); _mm256_storeu_ps(acc0 + 8, a01);  // row r last: r1 may be r
        _mm256_storeu_ps(acc0 + 16, a02); _mm256_storeu_ps(acc0 + 24, a03);
      }
    }
  }
  for (long r = 0; r < rows; r++) {
    __m256 scale = _mm256_set1_ps(inv[r]);
    for (long d = 0; d < D; d += 8) _mm256_storeu_ps(out[r] + d, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + d), scale));
  }
}

}  // namespace

// out [n][H * D] = attention of q [n][H][D] over one sequence's context: the C pool slots `slots`, whose keys and
// values for kv head h start at k_cache / v_cache + slot * slot_stride + h * D. Query head h reads kv head
// h / (H / KVH). mask [n][C] (1 = visible), or null when every row sees every slot. D must be a multiple of 32.
// Each kv head's query vectors are one task, split in as many blocks as keep `threads` busy (OpenMP, the runtime
// torch itself uses): a block reads its keys and values once.
extern "C" void avx2_attention(const float* q, long n, long H, long KVH, long D, const float* k_cache,
                               const float* v_cache, long slot_stride, const long* slots, long C,
                               const unsigned char* mask, float scale, float* out, int threads) {
  long group = H / KVH, vectors = group * n;
  long splits = threads > KVH ? (threads + KVH - 1) / KVH : 1;
  long block = (vectors + splits - 1) / splits;
  block += block % 2;  // query vectors go in pairs
  long blocks = (vectors + block - 1) / block, ld = (C + 3) / 4 * 4;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> s(block * ld), acc(block * D);
    std::vector<const float*> keys(C), values(C), qv(block);
    std::vector<float*> ov(block);
    std::vector<const unsigned char*> mv(block);
    std::vector<float> inv(block);
    long last_head = -1;
#pragma omp for schedule(static)
    for (long task = 0; task < KVH * blocks; task++) {
      long h = task / blocks, first = task % blocks * block;
      long rows = vectors - first < block ? vectors - first : block;
      if (h != last_head) {
        for (long c = 0; c < C; c++) {
          keys[c] = k_cache + slots[c] * slot_stride + h * D;
          values[c] = v_cache + slots[c] * slot_stride + h * D;
        }
        last_head = h;
      }
      for (long r = 0; r < rows; r++) {  // vector j of kv head h: token j / group, query head h * group + j % group
        long j = first + r, token = j / group, head = h * group + j % group;
        qv[r] = q + (token * H + head) * D;
        ov[r] = out + (token * H + head) * D;
        mv[r] = mask ? mask + token * C : nullptr;
      }
      scores(qv.data(), rows, keys.data(), C, D, scale, mv.data(), s.data(), ld);
      softmax_rows(s.data(), rows, C, ld, inv.data());
      weighted_values(s.data(), ld, rows, values.data(), C, D, inv.data(), acc.data(), ov.data());
    }
  }
}
