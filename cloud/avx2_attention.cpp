// One sequence's attention for a verifier's small passes on an AVX2/FMA CPU, read straight from the paged KV pool
// (cloud/avx2_attention.py builds and loads this file). The pool holds a layer's keys as [slot][kv head][dim], so
// one head's keys are rows 256 B apart for SmolLM2: the libraries' batched products over that strided view run at a
// few GB/s, and a one-token pass over a 900-token context spent a quarter of its time in attention (BENCHMARKS.md
// section 1). Here each key and value is read where it lies, once for all the query vectors of its kv head (a
// block of them per thread), in tiles of keys that stay in cache while every row's sums run over them; with one
// thread, every kv head's tile at once, so that the pool's rows are read in order, each whole.
//
// Every query vector's result is computed by the same sequence of operations whatever the block it falls in, so a
// row's output does not depend on the rows beside it (in a causal chain, given the keys its block reads).
#include <immintrin.h>

#include <cmath>
#include <cstring>
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

// Dot products of R query vectors q[0..R) with keys k[0..3] (D a multiple of 8), times `scale`, into s[i][0..3]. Each
// sum runs over d in order in one lane set, then adds its lanes as ((0+1)+(2+3))+((4+5)+(6+7)): the same operations
// for a query vector whichever others it is computed with (R is 3, then 2 or 1 for the last ones).
template <int R>
inline void dots(const float* const* q, const float* const* k, long D, __m256 scale, float* const* s) {
  __m256 a[R][4];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
  for (long d = 0; d < D; d += 8) {
    for (int j = 0; j < 4; j++) {
      __m256 y = _mm256_loadu_ps(k[j] + d);
      for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q[i] + d), y, a[i][j]);
    }
  }
  __m128 lo = _mm256_castps256_ps128(scale);
  for (int i = 0; i < R; i++) {
    // hadd twice leaves [lanes 0-3 of each accumulator | lanes 4-7 of each]; the halves' sum is the four dots
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    _mm_storeu_ps(s[i], _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), lo));
  }
}

// Scaled scores s [rows][C] of the query vectors q against keys [0, C) (written in 4s: C padded to a multiple of 4
// within `s`'s stride `ld`, the last block repeating its last key).
void scores(const float* const* q, long rows, const float* const* keys, long C, long D, float scale, float* s,
            long ld) {
  __m256 sc = _mm256_set1_ps(scale);
  for (long c = 0; c < C; c += 4) {
    const float* k[4];
    for (int i = 0; i < 4; i++) k[i] = keys[c + i < C ? c + i : C - 1];
    long r = 0;
    for (; r + 3 <= rows; r += 3) {
      float* out[3] = {s + r * ld + c, s + (r + 1) * ld + c, s + (r + 2) * ld + c};
      dots<3>(q + r, k, D, sc, out);
    }
    if (r + 2 <= rows) {
      float* out[2] = {s + r * ld + c, s + (r + 1) * ld + c};
      dots<2>(q + r, k, D, sc, out);
      r += 2;
    }
    if (r < rows) {
      float* out[1] = {s + r * ld + c};
      dots<1>(q + r, k, D, sc, out);
    }
  }
}

// Masked scores -inf: mask[r] [C] (1 = visible), or null where row r sees every key; and every key at or past see[r].
void mask_scores(float* s, long rows, long C, long ld, const unsigned char* const* mask, const long* see) {
  for (long r = 0; r < rows; r++) {
    const unsigned char* m = mask[r];
    long end = see[r];
    float* row = s + r * ld;
    const void* hidden = m ? std::memchr(m, 0, end) : nullptr;  // a tree's rows see all but the last few slots
    if (hidden)
      for (long j = static_cast<const unsigned char*>(hidden) - m; j < end; j++) row[j] = m[j] ? row[j] : -INFINITY;
    for (long j = end; j < C; j++) row[j] = -INFINITY;
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

constexpr long kTile = 32;  // keys a sweep takes at a time (32 measured a little faster than 64 or 128)

// acc[i] (+)= sum_{c in [c0, c1)} w[i][c] v_c (set where c0 is 0) for R rows, dimensions [d0, d0 + 32), each sum
// over c in order in registers: the same operations for a row whichever others it is computed with.
template <int R>
inline void weighted_rows(const float* const* w, const float* const* values, long c0, long c1, long d0,
                          float* const* acc) {
  __m256 a[R][4];
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 4; j++) a[i][j] = c0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[i] + d0 + 8 * j);
  for (long c = c0; c < c1; c++) {
    const float* v = values[c] + d0;
    __m256 b[R];
    for (int i = 0; i < R; i++) b[i] = _mm256_broadcast_ss(w[i] + c);
    for (int j = 0; j < 4; j++) {
      __m256 y = _mm256_loadu_ps(v + 8 * j);
      for (int i = 0; i < R; i++) a[i][j] = _mm256_fmadd_ps(b[i], y, a[i][j]);
    }
  }
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc[i] + d0 + 8 * j, a[i][j]);
}

#define AVX512 __attribute__((target("avx512f")))

// weighted_rows with AVX-512, where the CPU has it: dimensions [d0, d0 + 64) of up to six rows in registers, so that a
// value row read once serves them all (AVX2's 16 registers hold two rows' 32 dimensions, and the loads outnumber the
// FMAs). Each dimension's sum is the same FMAs over c in the same order as on AVX2: the same bits.
template <int R>
AVX512 inline void weighted_rows512(const float* const* w, const float* const* values, long c0, long c1, long d0,
                                    float* const* acc) {
  __m512 a[R][4];
#pragma GCC unroll 6
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 4; j++) a[i][j] = c0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[i] + d0 + 16 * j);
  for (long c = c0; c < c1; c++) {
    const float* v = values[c] + d0;
    __m512 y[4];
    for (int j = 0; j < 4; j++) y[j] = _mm512_loadu_ps(v + 16 * j);
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) {
      __m512 b = _mm512_set1_ps(w[i][c]);
      for (int j = 0; j < 4; j++) a[i][j] = _mm512_fmadd_ps(b, y[j], a[i][j]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; i++)
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc[i] + d0 + 16 * j, a[i][j]);
}

AVX512 void weighted_values512(const float* w, long ld, long rows, const float* const* values, long c0, long c1,
                               long D, float* acc) {
  for (long d0 = 0; d0 < D; d0 += 64) {
    for (long r = 0; r < rows;) {
      long n = rows - r < 6 ? rows - r : 6;
      const float* wr[6];
      float* ar[6];
      for (long i = 0; i < n; i++) wr[i] = w + (r + i) * ld, ar[i] = acc + (r + i) * D;
      switch (n) {
        case 1: weighted_rows512<1>(wr, values, c0, c1, d0, ar); break;
        case 2: weighted_rows512<2>(wr, values, c0, c1, d0, ar); break;
        case 3: weighted_rows512<3>(wr, values, c0, c1, d0, ar); break;
        case 4: weighted_rows512<4>(wr, values, c0, c1, d0, ar); break;
        case 5: weighted_rows512<5>(wr, values, c0, c1, d0, ar); break;
        default: weighted_rows512<6>(wr, values, c0, c1, d0, ar); break;
      }
      r += n;
    }
  }
}

// acc[r] (+)= sum_{c in [c0, c1)} w[r][c] v_c for rows of weights w (stride ld) and of acc [rows][D]: on AVX2 two rows
// at a time, an odd last one alone; with AVX-512 (isa 2) where D is a multiple of 64, up to six.
void weighted_values(const float* w, long ld, long rows, const float* const* values, long c0, long c1, long D,
                     float* acc, int isa) {
  if (isa == 2 && D % 64 == 0) return weighted_values512(w, ld, rows, values, c0, c1, D, acc);
  for (long d0 = 0; d0 < D; d0 += 32) {
    long r = 0;
    for (; r + 2 <= rows; r += 2) {
      const float* wr[2] = {w + r * ld, w + (r + 1) * ld};
      float* ar[2] = {acc + r * D, acc + (r + 1) * D};
      weighted_rows<2>(wr, values, c0, c1, d0, ar);
    }
    if (r < rows) {
      const float* wr[1] = {w + r * ld};
      float* ar[1] = {acc + r * D};
      weighted_rows<1>(wr, values, c0, c1, d0, ar);
    }
  }
}

// Asks the caches for `bytes` at each of rows[c0, c1), ahead of their use: a sweep's next tile, whose rows the
// hardware's prefetchers do not find in time (a pass's attention took ~3.5x the time of its reads plus its arithmetic).
void prefetch(const float* const* rows, long c0, long c1, long bytes) {
  for (long c = c0; c < c1; c++) {
    const char* row = reinterpret_cast<const char*>(rows[c]);
    for (long b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

// A block of `rows` query vectors of kv head h, and what a task keeps of them.
struct Part {
  long h, rows;
  std::vector<const float*> keys, values, q;
  std::vector<float*> out;
  std::vector<const unsigned char*> mask;
  std::vector<long> see;  // keys [0, see[r]) may be visible to vector r
  std::vector<float> s, acc, inv;
};

constexpr long kCausalBlock = 48;  // a causal chain's query vectors taken together (their keys end at the last one's)

// out [n][H * D] = attention of q [n][H][D] over one sequence's context: the C pool slots `slots`, whose keys and
// values for kv head h start at k_cache / v_cache + slot * slot_stride + h * D. Query head h reads kv head
// h / (H / KVH). mask [n][C] (1 = visible), or null when every row sees every slot; `causal`: besides, row r sees no
// slot after C - n + r, its own where the rows are the context's last n tokens, in order (a prompt's chain). D must
// be a multiple of 32.
// The query vectors of each kv head are split in as many blocks as keep `threads` busy (OpenMP, the runtime torch
// itself uses), a block reading its keys and values once; with one thread, every head is one task, its keys and
// values read in one sweep over the slots: a slot's heads lie side by side in the pool, so the sweep streams the
// pool's rows in order where a head at a time reads a part of each row and skips the rest. A causal chain's blocks
// are smaller, each reading the keys up to its last row's only (half the work of a long chain's square).
void attention(const float* q, long n, long H, long KVH, long D, const float* k_cache, const float* v_cache,
               long slot_stride, const long* slots, long C, const unsigned char* mask, bool causal, float scale,
               float* out, int threads, int isa) {
  long group = H / KVH, vectors = group * n;
  long splits = threads > KVH ? (threads + KVH - 1) / KVH : 1;
  long block = (vectors + splits - 1) / splits;
  if (causal && block > kCausalBlock) block = kCausalBlock;
  block += block % 2;  // query vectors go in pairs (an odd one is left for the last block)
  long blocks = (vectors + block - 1) / block, ld = (C + 3) / 4 * 4;
  long heads_per_task = threads > 1 ? 1 : KVH;
  long tasks = KVH / heads_per_task * blocks;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<Part> parts(heads_per_task);
#pragma omp for schedule(static)
    for (long task = 0; task < tasks; task++) {
      long first = task % blocks * block, rows = vectors - first < block ? vectors - first : block;
      // The keys this block reads: up to its last row's own where the rows are causal, else all.
      long reach = causal ? C - n + (first + rows - 1) / group + 1 : C;
      for (long j = 0; j < heads_per_task; j++) {
        Part& p = parts[j];
        long h = task / blocks * heads_per_task + j;
        if (p.keys.empty() || p.h != h) {
          p.keys.resize(C), p.values.resize(C);
          for (long c = 0; c < C; c++) {
            p.keys[c] = k_cache + slots[c] * slot_stride + h * D;
            p.values[c] = v_cache + slots[c] * slot_stride + h * D;
          }
          p.s.resize(block * ld), p.acc.resize(block * D), p.inv.resize(block);
          p.q.resize(block), p.out.resize(block), p.mask.resize(block), p.see.resize(block);
        }
        p.h = h, p.rows = rows;
        for (long r = 0; r < rows; r++) {  // vector v of kv head h: token v / group, query head h * group + v % group
          long v = first + r, token = v / group, head = h * group + v % group;
          p.q[r] = q + (token * H + head) * D;
          p.out[r] = out + (token * H + head) * D;
          p.mask[r] = mask ? mask + token * C : nullptr;
          p.see[r] = causal ? C - n + token + 1 : C;
        }
      }
      long row_bytes = heads_per_task * D * sizeof(float);  // the task's heads lie side by side in a slot's row
      auto next_tile = [&](const std::vector<const float*>& rows, long c1) {
        prefetch(rows.data(), c1, c1 + kTile < reach ? c1 + kTile : reach, row_bytes);
      };
      for (long c0 = 0; c0 < reach; c0 += kTile) {
        long c1 = c0 + kTile < reach ? c0 + kTile : reach;
        if (c1 < reach) next_tile(parts[0].keys, c1);
        else next_tile(parts[0].values, 0);
        for (Part& p : parts)
          scores(p.q.data(), p.rows, p.keys.data() + c0, c1 - c0, D, scale, p.s.data() + c0, ld);
      }
      for (Part& p : parts) {
        mask_scores(p.s.data(), p.rows, reach, ld, p.mask.data(), p.see.data());
        softmax_rows(p.s.data(), p.rows, reach, ld, p.inv.data());
      }
      for (long c0 = 0; c0 < reach; c0 += kTile) {
        long c1 = c0 + kTile < reach ? c0 + kTile : reach;
        if (c1 < reach) next_tile(parts[0].values, c1);
        for (Part& p : parts)
          weighted_values(p.s.data(), ld, p.rows, p.values.data(), c0, c1, D, p.acc.data(), isa);
      }
      for (Part& p : parts) {
        for (long r = 0; r < p.rows; r++) {
          __m256 inv = _mm256_set1_ps(p.inv[r]);
          const float* acc = p.acc.data() + r * D;
          for (long d = 0; d < D; d += 8) _mm256_storeu_ps(p.out[r] + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), inv));
        }
      }
    }
  }
}

}  // namespace

// Which instructions this CPU runs the kernel with: 2 for AVX-512, 1 for AVX2 (the caller has checked for it).
extern "C" int avx2_attention_isa(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

// `attention` above, causal or not (0 or 1), with the instructions avx2_attention_isa gives, or 1.
extern "C" void avx2_paged_attention(const float* q, long n, long H, long KVH, long D, const float* k_cache,
                                     const float* v_cache, long slot_stride, const long* slots, long C,
                                     const unsigned char* mask, int causal, float scale, float* out, int threads,
                                     int isa) {
  attention(q, n, H, KVH, D, k_cache, v_cache, slot_stride, slots, C, mask, causal, scale, out, threads, isa);
}
