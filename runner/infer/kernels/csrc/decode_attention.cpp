// One-query attention over a KV cache read in its stored format (attention_ops.cpp makes it two torch ops;
// runner/infer/cpu_attention.py hands them a layer's tensors).
//
// Two passes over the columns of each (row, KV head): `runner_scores` decodes a key column once into a float row
// and takes its dot product with the G query heads of that KV head; `runner_weighted` decodes a value column once
// and adds it, times each query head's probability, to that head's output. The softmax between them is the
// caller's. Decoding gives the floats the Python dequantizers give (code x scale is exact in float32; the one
// add rounds once, fused or not); the sums run in another order than torch's.
// A call reads one or more `Segment`s: stores that each hold a range of the attention's columns (KIVI: the sinks,
// the quantized region, the full-precision ring), so one softmax covers them with no copy in between.
// Layouts are runner/infer/quant.py's and static.py's; `Store` says which one a tensor has.
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RUNNER_AVX2 1
#endif

static inline int64_t divide(int64_t t, int64_t d, int64_t shift) { return shift >= 0 ? t >> shift : t / d; }

static inline int64_t first_column(const Segment& g, int64_t limit, int64_t S) {
  return std::clamp<int64_t>(g.start + g.start_plus_limit * limit, 0, S);
}
static inline int64_t end_column(const Segment& g, int64_t limit, int64_t S) {
  return std::clamp<int64_t>(g.stop + g.stop_plus_limit * limit, first_column(g, limit, S), S);
}
static inline int64_t stored(const Segment& g, int64_t t) {
  return g.modulo ? (t - g.base) % g.modulo : t - g.base;
}

static const int TILE = 128;  // columns per task
static const int ROWS = 8;     // columns decoded together (one vector of their 8 scores)

static inline float half_float(const uint8_t* p, int64_t i) {
  _Float16 h;
  std::memcpy(&h, p + 2 * i, 2);
  return (float)h;
}

#ifdef RUNNER_AVX2
// levels[codes] for 8 codes < 16 in int32 lanes, the 16 levels held in two vectors (vpermps, no gather).
static inline __m256 lookup(__m256i codes, __m256 low, __m256 high) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, codes), _mm256_permutevar8x32_ps(high, codes),
                          _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}
static inline __m256i bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
// The levels of 8 KIVI codes < 2^bits: the codes themselves when uniform (one conversion), else looked up.
static inline __m256 levels8(__m256i codes, __m256 low, __m256 high, int64_t bits, bool uniform) {
  if (uniform) return _mm256_cvtepi32_ps(codes);
  return bits == 4 ? lookup(codes, low, high) : _mm256_permutevar8x32_ps(low, codes);
}
#endif

// KIVI keys: the levels of column t's codes in out[0, dim). Codes are packed along the columns ([rows, dim]: a
// byte holds 8 / bits columns of one channel; 3 bits: 8 columns in 3 bytes, one per 8-column row).
static inline void key_levels(const Store& s, const uint8_t* codes, int64_t t, float* __restrict__ out) {
  const int64_t bits = s.bits, mask = (1 << bits) - 1, dim = s.dim;
  const int per_shift = bits == 2 ? 2 : bits == 4 ? 1 : 3;  // log2 of the columns per byte row: 4, 2 or 8
  const uint8_t* r = codes + (bits == 3 ? 3 : 1) * (t >> per_shift) * dim;
  const int shift = (int)(bits * (t & ((1 << per_shift) - 1)));
  auto word = [&](int64_t d) -> uint32_t { return bits == 3 ? r[d] | (r[dim + d] << 8) | (r[2 * dim + d] << 16) : r[d]; };
  int64_t d = 0;
#ifdef RUNNER_AVX2
  const __m256 low = _mm256_loadu_ps(s.levels), high = bits == 4 ? _mm256_loadu_ps(s.levels + 8) : low;
  const __m256i maskv = _mm256_set1_epi32((int)mask);
  for (; d + 8 <= dim; d += 8) {
    __m256i w = bytes8(r + d);
    if (bits == 3)
      w = _mm256_or_si256(w, _mm256_or_si256(_mm256_slli_epi32(bytes8(r + dim + d), 8), _mm256_slli_epi32(bytes8(r + 2 * dim + d), 16)));
    _mm256_storeu_ps(out + d, levels8(_mm256_and_si256(_mm256_srli_epi32(w, shift), maskv), low, high, bits, s.uniform));
  }
#endif
  for (; d < dim; d++) out[d] = s.levels[(word(d) >> shift) & mask];
}

// KIVI values: the levels of column t's codes in out[0, padded). A column's codes are plane groups (quant.pack):
// value v of group v / (per·c) is byte v mod c of the group, bits (v / c) mod per (per = 8 / bits codes a byte, c
// = plane bytes); 3 bits: 8 values in 3 bytes. BITS: the store's bits as a constant (shifts by immediates).
template <int BITS>
static inline void value_levels(const Store& s, const uint8_t* codes, int64_t t, float* __restrict__ out) {
  constexpr int per = BITS == 2 ? 4 : 2, mask = (1 << BITS) - 1;
  const int64_t c = s.plane;
  const uint8_t* row = codes + t * (s.padded * BITS >> 3);
  int64_t first = 0;
#ifdef RUNNER_AVX2
  const __m256 low = _mm256_loadu_ps(s.levels), high = BITS == 4 ? _mm256_loadu_ps(s.levels + 8) : low;
  const __m256i maskv = _mm256_set1_epi32(mask);
  auto put = [&](int64_t at, __m256i code) {
    _mm256_storeu_ps(out + at, levels8(_mm256_and_si256(code, maskv), low, high, BITS, s.uniform));
  };
  if constexpr (BITS == 3) {
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    for (; first + 16 <= s.padded; first += 8) {  // 4 bytes read, the 3 of these 8 values and the next's first
      int32_t word;
      std::memcpy(&word, row + 3 * (first >> 3), 4);
      put(first, _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts));
    }
    for (; first + 8 <= s.padded; first += 8) {  // the column's last 8: its last 3 bytes only
      const uint8_t* w = row + 3 * (first >> 3);
      put(first, _mm256_srlv_epi32(_mm256_set1_epi32(w[0] | (w[1] << 8) | (w[2] << 16)), shifts));
    }
  } else if (c % 8 == 0) {  // 8 bytes read once: 8 values of each of the per planes
    for (; first < s.padded; first += per * c)
      for (int64_t j = 0; j < c; j += 8) {
        const __m256i bytes = bytes8(row + first / per + j);
        put(first + j, bytes);
        put(first + c + j, _mm256_srli_epi32(bytes, BITS));
        if constexpr (per == 4) {
          put(first + 2 * c + j, _mm256_srli_epi32(bytes, 2 * BITS));
          put(first + 3 * c + j, _mm256_srli_epi32(bytes, 3 * BITS));
        }
      }
  }
#endif
  for (int64_t v = first; v < s.padded; v++) {
    const uint32_t code = BITS == 3 ? (row[3 * (v / 8)] | (row[3 * (v / 8) + 1] << 8) | (row[3 * (v / 8) + 2] << 16)) >> (3 * (v % 8))
                                    : row[v / (per * c) * c + v % c] >> (BITS * (v / c % per));
    out[v] = s.levels[code & mask];
  }
}

// value_levels for the store's bits.
static inline void value_levels(const Store& s, const uint8_t* codes, int64_t t, float* __restrict__ out) {
  if (s.bits == 4) value_levels<4>(s, codes, t, out);
  else if (s.bits == 3) value_levels<3>(s, codes, t, out);
  else value_levels<2>(s, codes, t, out);
}

// x[0, n) ← x·scale + low.
static inline void affine(float* x, int64_t n, float scale, float low) {
  int64_t j = 0;
#ifdef RUNNER_AVX2
  const __m256 sv = _mm256_set1_ps(scale), lv = _mm256_set1_ps(low);
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, _mm256_fmadd_ps(_mm256_loadu_ps(x + j), sv, lv));
#endif
  for (; j < n; j++) x[j] = x[j] * scale + low;
}

// KIVI keys: the levels of the ROWS columns from a0 (a multiple of ROWS) into rows [ROWS, dim], each byte row
// read once for all the columns it holds. BITS: the store's bits as a constant.
template <int BITS>
static inline void key_rows_levels(const Store& s, const uint8_t* codes, int64_t a0, float* __restrict__ rows) {
  const int64_t dim = s.dim;
  int64_t d = 0;
#ifdef RUNNER_AVX2
  constexpr int per = BITS == 3 ? 8 : 8 / BITS;  // columns a byte row holds
  const __m256 low = _mm256_loadu_ps(s.levels), high = BITS == 4 ? _mm256_loadu_ps(s.levels + 8) : low;
  const __m256i maskv = _mm256_set1_epi32((1 << BITS) - 1);
  const uint8_t* r = codes + (BITS == 3 ? 3 : 1) * (a0 / per) * dim;
  for (; d + 8 <= dim; d += 8)
    for (int first = 0; first < ROWS; first += per) {  // the byte row of columns first … first + per − 1
      const uint8_t* at = r + (BITS == 3 ? 3 : 1) * (first / per) * dim + d;
      __m256i word = bytes8(at);
      if constexpr (BITS == 3)
        word = _mm256_or_si256(word, _mm256_or_si256(_mm256_slli_epi32(bytes8(at + dim), 8), _mm256_slli_epi32(bytes8(at + 2 * dim), 16)));
      for (int k = 0; k < per; k++)
        _mm256_storeu_ps(rows + (first + k) * dim + d,
                         levels8(_mm256_and_si256(_mm256_srli_epi32(word, BITS * k), maskv), low, high, BITS, s.uniform));
    }
#endif
  if (d < dim) {  // the channels past the last 8 (a head_dim not a multiple of 8, or no AVX2): column by column
    std::vector<float> tail(dim);
    for (int k = 0; k < ROWS; k++) {
      key_levels(s, codes, a0 + k, tail.data());
      std::memcpy(rows + k * dim + d, tail.data() + d, (dim - d) * sizeof(float));
    }
  }
}

// Column t of one (row, head) as floats in out[0, dim) (KIVI values: [0, padded)).
template <int F>
__attribute__((always_inline)) static inline void decode(const Store& s, const uint8_t* codes, const uint8_t* scales, const uint8_t* mins,
                          int64_t t, float* __restrict__ out) {
  const int64_t dim = s.dim;
  if constexpr (F == F32) {
    const float* src = (const float*)codes + t * dim;
    for (int64_t d = 0; d < dim; d++) out[d] = src[d];
  } else if constexpr (F == F16) {
    const _Float16* src = (const _Float16*)codes + t * dim;
    int64_t d = 0;
#ifdef RUNNER_AVX2
    for (; d + 8 <= dim; d += 8) _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + d))));
#endif
    for (; d < dim; d++) out[d] = (float)src[d];
  } else if constexpr (F == BF16) {
    const uint16_t* src = (const uint16_t*)codes + t * dim;
    for (int64_t d = 0; d < dim; d++) {
      uint32_t u = (uint32_t)src[d] << 16;
      float f;
      std::memcpy(&f, &u, 4);
      out[d] = f;
    }
  } else if constexpr (F == Q8_0) {
    const int64_t nb = (dim + 31) / 32;
    const int8_t* row = (const int8_t*)codes + t * nb * 32;
    for (int64_t b = 0; b < nb; b++) {
      const float scale = half_float(scales, t * nb + b);
      for (int j = 0; j < 32; j++) out[b * 32 + j] = (float)row[b * 32 + j] * scale;
    }
  } else if constexpr (F == Q4_0 || F == NF4 || F == Q4_1) {  // a block of 32 = one plane group of 16 bytes
    const int64_t nb = (dim + 31) / 32;
    const uint8_t* row = codes + t * nb * 16;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* bytes = row + b * 16;
      float* o = out + b * 32;
      if constexpr (F == Q4_0) {
        const float scale = half_float(scales, t * nb + b);
        for (int j = 0; j < 16; j++) {
          o[j] = (float)((int)(bytes[j] & 15) - 8) * scale;
          o[16 + j] = (float)((int)(bytes[j] >> 4) - 8) * scale;
        }
      } else if constexpr (F == NF4) {
        const float scale = half_float(scales, t * nb + b);
#ifdef RUNNER_AVX2
        const __m256 low = _mm256_loadu_ps(s.levels), high = _mm256_loadu_ps(s.levels + 8), sv = _mm256_set1_ps(scale);
        for (int j = 0; j < 16; j += 8) {
          const __m256i code = bytes8(bytes + j);
          _mm256_storeu_ps(o + j, _mm256_mul_ps(lookup(_mm256_and_si256(code, _mm256_set1_epi32(15)), low, high), sv));
          _mm256_storeu_ps(o + 16 + j, _mm256_mul_ps(lookup(_mm256_srli_epi32(code, 4), low, high), sv));
        }
        continue;
#endif
        for (int j = 0; j < 16; j++) {
          o[j] = s.levels[bytes[j] & 15] * scale;
          o[16 + j] = s.levels[bytes[j] >> 4] * scale;
        }
      } else {
        const float scale = half_float(scales, 2 * (t * nb + b)), low = half_float(scales, 2 * (t * nb + b) + 1);
        for (int j = 0; j < 16; j++) {
          o[j] = (float)(bytes[j] & 15) * scale + low;
          o[16 + j] = (float)(bytes[j] >> 4) * scale + low;
        }
      }
    }
  } else if constexpr (F == KIVI_VALUE) {  // m + s·level, blocks of `group` channels of one column
    value_levels(s, codes, t, out);
    for (int64_t b = 0; b < s.blocks; b++) {
      const float scale = half_float(scales, t * s.blocks + b), low = half_float(mins, t * s.blocks + b);
      affine(out + b * s.group, s.group, scale, low);
    }
  } else {  // KIVI_KEY: s·level + m, scales and mins per group of columns and channel ([groups, dim] each)
    key_levels(s, codes, t, out);
    const int64_t group = divide(t, s.group, s.group_shift);
    const uint8_t* sc = scales + 2 * group * dim;
    const uint8_t* mn = mins + 2 * group * dim;
    int64_t d = 0;
#ifdef RUNNER_AVX2
    for (; d + 8 <= dim; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_loadu_ps(out + d), halves8(sc + 2 * d), halves8(mn + 2 * d)));
#endif
    for (; d < dim; d++) out[d] = out[d] * half_float(sc, d) + half_float(mn, d);
  }
}

// Where the outliers read last ended: a task reads its columns in ascending order, so the next columns' outliers
// are found by stepping on from there (a binary search only at a task's first columns, a new chunk, or columns
// that do not ascend).
struct Cursor {
  int64_t chunk = -1, next = 0, end = 0;  // the chunk, its first outlier not yet passed, the span's end read last
};

// Each outlier of `chunk` whose position (into its columns × dim, ascending) lies in [low, high): put(position −
// low, value).
template <typename Put>
static inline void each_outlier(const Store& s, const uint8_t* outliers, const uint8_t* index, int64_t chunk,
                                int64_t low, int64_t high, Cursor& cursor, Put put) {
  const int64_t k = s.count;
  const int16_t* short_index = (const int16_t*)index + chunk * k;
  const int32_t* long_index = (const int32_t*)index + chunk * k;
  auto position = [&](int64_t i) -> int64_t { return s.index_bytes == 2 ? short_index[i] : long_index[i]; };
  int64_t j = cursor.next;
  if (chunk != cursor.chunk || low < cursor.end) {
    int64_t last = k;
    j = 0;
    while (j < last) {
      const int64_t middle = (j + last) / 2;
      if (position(middle) < low) j = middle + 1; else last = middle;
    }
  }
  while (j < k && position(j) < low) j++;
  for (; j < k && position(j) < high; j++) put(position(j) - low, half_float(outliers, chunk * k + j));
  cursor = Cursor{chunk, j, high};
}

static inline void write_outliers(const Store& s, const uint8_t* outliers, const uint8_t* index, int64_t chunk,
                                  int64_t low, int64_t high, float* out, Cursor& cursor) {
  each_outlier(s, outliers, index, chunk, low, high, cursor, [&](int64_t i, float value) { out[i] = value; });
}

// The outliers of columns at[r] (where take[r]) written over their decoded rows [ROWS, dim]
// (kvcodes.restore_outliers). ROWS consecutive columns of one chunk (the usual case) are one span of positions,
// so one loop, whose exit is the one branch a column-by-column loop mispredicts per column (that cost 10× more).
static inline void patch(const Store& s, const uint8_t* outliers, const uint8_t* index, const int64_t* at,
                         const bool* take, float* rows, Cursor& cursor) {
  const int64_t dim = s.dim, first = divide(at[0], s.chunk, s.chunk_shift);
  bool run = take[0] && divide(at[ROWS - 1], s.chunk, s.chunk_shift) == first;
  for (int r = 1; r < ROWS; r++) run &= take[r] && at[r] == at[0] + r;
  if (run) {
    const int64_t low = (at[0] - first * s.chunk) * dim;
    write_outliers(s, outliers, index, first, low, low + ROWS * dim, rows, cursor);
    return;
  }
  for (int r = 0; r < ROWS; r++) {
    if (!take[r]) continue;
    const int64_t chunk = divide(at[r], s.chunk, s.chunk_shift), low = (at[r] - chunk * s.chunk) * dim;
    write_outliers(s, outliers, index, chunk, low, low + dim, rows + r * dim, cursor);
  }
}

// The scaled dot products of one query row q [dim] with ROWS decoded rows [ROWS, dim] into out[0, ROWS).
static inline void dots(const float* q, const float* rows, int64_t dim, float scaling, float* out) {
#ifdef RUNNER_AVX2
  if (dim % 8 == 0) {  // eight accumulators, then one transposing sum of all eight (no sum per row)
    __m256 a[ROWS];
    for (int r = 0; r < ROWS; r++) a[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int r = 0; r < ROWS; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + r * dim + d), a[r]);
    }
    const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scaling)));
    return;
  }
#endif
  for (int r = 0; r < ROWS; r++) {
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < dim; d++) acc += q[d] * rows[r * dim + d];
    out[r] = acc * scaling;
  }
}

// KIVI keys in the level domain: q·(s⊙l + m) = (q⊙s)·l + q·m, s and m being one group's, so a column decodes to
// its levels only (no scale or minimum per value): q⊙s [G,dim] and q·m [G] once per group (`held` says whose),
// the ROWS columns from stored column a0 as levels into rows [ROWS, dim], an outlier as the level (exact − m) / s
// that decodes to it (a channel whose s is 0: a correction q_d·(exact − m) per query row and column). `work`
// holds [G,dim] q⊙s, [G] q·m, [dim] s, [dim] m and [G,ROWS] corrections.
static inline void key_scores_in_levels(const Store& k, int64_t bh, int64_t a0, const float* q, int64_t G,
                                        int64_t& held, std::vector<float>& work, float* rows, Cursor& cursor) {
  const int64_t dim = k.dim, group = divide(a0, k.group, k.group_shift);
  float *scaled = work.data(), *bias = scaled + G * dim, *scale = bias + G, *minimum = scale + dim;
  float* correction = minimum + dim;
  if (group != held) {
    const uint8_t* sc = k.scales + bh * k.scales_bh + 2 * group * dim;
    const uint8_t* mn = k.mins + bh * k.mins_bh + 2 * group * dim;
    int64_t d0 = 0;
#ifdef RUNNER_AVX2
    for (; d0 + 8 <= dim; d0 += 8) _mm256_storeu_ps(scale + d0, halves8(sc + 2 * d0)), _mm256_storeu_ps(minimum + d0, halves8(mn + 2 * d0));
#endif
    for (int64_t d = d0; d < dim; d++) scale[d] = half_float(sc, d), minimum[d] = half_float(mn, d);
    for (int64_t g = 0; g < G; g++) {
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; d++) scaled[g * dim + d] = q[g * dim + d] * scale[d], sum += q[g * dim + d] * minimum[d];
      bias[g] = sum;
    }
    held = group;
  }
  const uint8_t* codes = k.codes + bh * k.codes_bh;
  if (k.bits == 4) key_rows_levels<4>(k, codes, a0, rows);
  else if (k.bits == 3) key_rows_levels<3>(k, codes, a0, rows);
  else key_rows_levels<2>(k, codes, a0, rows);
  std::fill(correction, correction + G * ROWS, 0.f);
  if (!k.count) return;
  const int64_t chunk = divide(a0, k.chunk, k.chunk_shift), low = (a0 - chunk * k.chunk) * dim;
  const int64_t dim_shift = (dim & (dim - 1)) ? -1 : __builtin_ctzll(dim);
  each_outlier(k, k.outliers + bh * k.outliers_bh, k.index + bh * k.index_bh, chunk, low, low + ROWS * dim, cursor,
               [&](int64_t i, float exact) {
                 const int64_t r = divide(i, dim, dim_shift), d = i - r * dim;
                 if (scale[d] != 0.f) {  // the level that decodes to it
                   rows[i] = (exact - minimum[d]) / scale[d];
                   return;
                 }
                 for (int64_t g = 0; g < G; g++) correction[g * ROWS + r] += q[g * dim + d] * (exact - minimum[d]);
               });
}

// Floats `decode` writes for one column: head_dim, whole blocks of the block kinds, KIVI values' coded channels.
static inline int64_t decoded_width(const Store& s) {
  const bool block = s.format == Q8_0 || s.format == Q4_0 || s.format == NF4 || s.format == Q4_1;
  return std::max(block ? (s.dim + 31) / 32 * 32 : s.padded, s.dim);
}

// ROWS stored columns at[r] of (row, head) bh decoded into rows [ROWS, dim], outliers written back, where take[r];
// zeros where not. `spare` holds decoded_width(s) floats.
template <int F>
static inline void decode_rows(const Store& s, int64_t bh, const int64_t* at, const bool* take,
                               float* __restrict__ rows, float* __restrict__ spare, Cursor& cursor) {
  const uint8_t* codes = s.codes + bh * s.codes_bh;
  const uint8_t* scales = s.scales + bh * s.scales_bh;
  const uint8_t* mins = s.mins + bh * s.mins_bh;
  const int64_t dim = s.dim;
  const bool padded = decoded_width(s) > dim;  // decoded into `spare` [width], then its first dim values copied
  for (int r = 0; r < ROWS; r++) {
    float* out = rows + r * dim;
    if (!take[r]) {
      std::memset(out, 0, dim * sizeof(float));
      continue;
    }
    decode<F>(s, codes, scales, mins, at[r], padded ? spare : out);
    if (padded) std::memcpy(out, spare, dim * sizeof(float));
  }
  if (s.count) patch(s, s.outliers + bh * s.outliers_bh, s.index + bh * s.index_bh, at, take, rows, cursor);
}

// Tiles of TILE columns a segment's columns [first, end) make, per (row, head).
static inline int64_t tiles_of(const Segment& g, int64_t limit, int64_t S) {
  return (end_column(g, limit, S) - first_column(g, limit, S) + TILE - 1) / TILE;
}

// scores [BH,G,S] = scaling · q [BH,G,D] · K[column] over the segment's columns whose mask [B,S] (stride
// mask_stride, may be null) is set; -inf for its masked ones (columns no segment holds: runner_scores' fill).
// Columns go ROWS at a time: decoded once, taken against the G rows of q. Called by every thread of a parallel
// region: the tasks (row, head, tile) are shared among them.
template <int F>
static void scores_impl(const Segment& segment, const float* q, const uint8_t* mask, int64_t mask_stride,
                        float* scores, int64_t B, int64_t H, int64_t G, int64_t S, int64_t limit, float scaling) {
  const Store& k = segment.store;
  const int64_t first = first_column(segment, limit, S), end = end_column(segment, limit, S);
  const int64_t tiles = tiles_of(segment, limit, S), dim = k.dim;
  std::vector<float> rows(ROWS * dim), spare(decoded_width(k));  // this thread's
  std::vector<float> levels(F == KIVI_KEY ? G * dim + G + 2 * dim + G * ROWS : 0);  // key_scores_in_levels'
  alignas(32) float sums[ROWS];
#pragma omp for schedule(static) nowait
  for (int64_t task = 0; task < B * H * tiles; task++) {
    const int64_t bh = task / tiles, b = bh / H, from = first + (task % tiles) * TILE, last = std::min(end, from + TILE);
    const float* qs = q + bh * G * dim;
    float* out = scores + bh * G * S;
    Cursor cursor;
    int64_t held = -1;  // KIVI keys: the group whose q⊙s and q·m `levels` holds
    for (int64_t t0 = from; t0 < last; t0 += ROWS) {
      bool seen[ROWS], any = false;
      int64_t at[ROWS];
      for (int r = 0; r < ROWS; r++) {
        const int64_t t = t0 + r;
        seen[r] = t < last && !(mask && !mask[b * mask_stride + t]);
        at[r] = seen[r] ? stored(segment, t) : 0;
        any |= seen[r];
      }
      if constexpr (F == KIVI_KEY) {  // ROWS whole columns of one group (and outlier chunk): in levels
        const int64_t a0 = t0 - segment.base;
        if (any && !segment.modulo && k.group % ROWS == 0 && (!k.count || k.chunk % ROWS == 0) &&
            (a0 & (ROWS - 1)) == 0 && t0 + ROWS <= last) {
          key_scores_in_levels(k, bh, a0, qs, G, held, levels, rows.data(), cursor);
          const float* bias = levels.data() + G * dim;
          for (int64_t g = 0; g < G; g++) {
            dots(levels.data() + g * dim, rows.data(), dim, scaling, sums);
            const float* correction = bias + G + 2 * dim + g * ROWS;
            for (int r = 0; r < ROWS; r++)
              out[g * S + t0 + r] = seen[r] ? sums[r] + (bias[g] + correction[r]) * scaling : -INFINITY;
          }
          continue;
        }
      }
      if (any) decode_rows<F>(k, bh, at, seen, rows.data(), spare.data(), cursor);
      for (int64_t g = 0; g < G; g++) {
        if (any) dots(qs + g * dim, rows.data(), dim, scaling, sums);
        for (int r = 0; r < ROWS && t0 + r < last; r++) out[g * S + t0 + r] = seen[r] ? sums[r] : -INFINITY;
      }
    }
  }
}

// acc [n] += Σ_r w[r] · rows[r] over ROWS decoded rows of n floats, `stride` apart.
static inline void accumulate(const float* w, const float* rows, int64_t n, int64_t stride, float* acc) {
#ifdef RUNNER_AVX2
  if (n % 8 == 0) {
    __m256 weight[ROWS];
    for (int r = 0; r < ROWS; r++) weight[r] = _mm256_set1_ps(w[r]);
    for (int64_t d = 0; d < n; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int r = 0; r < ROWS; r++) a = _mm256_fmadd_ps(weight[r], _mm256_loadu_ps(rows + r * stride + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
    return;
  }
#endif
  for (int r = 0; r < ROWS; r++)
#pragma omp simd
    for (int64_t d = 0; d < n; d++) acc[d] += w[r] * rows[r * stride + d];
}

// KIVI values in the level domain: Σ_r p_r·(s_r·l_r + m_r) = Σ_r (p_r·s_r)·l_r + Σ_r p_r·m_r per block of channels,
// so a column decodes to its levels only. The ROWS columns from stored column a0 as levels into rows [ROWS, width]
// (an outlier as the level (exact − m) / s that decodes to it); acc [G, dim] += the first sum; means [G, blocks,
// ROWS] += the second's terms (summed into acc by the caller, once per task); an outlier whose block's s is 0
// adds p·(exact − m) to acc. p: probabilities [G, S] from the first column's; `work`: 2·ROWS·blocks floats.
static inline void value_rows_in_levels(const Store& v, int64_t bh, int64_t a0, const float* p, int64_t S, int64_t G,
                                        float* rows, int64_t width, float* acc, float* means, float* work,
                                        Cursor& cursor) {
  const int64_t dim = v.dim, blocks = v.blocks, group = v.group;
  const uint8_t* scales = v.scales + bh * v.scales_bh + 2 * a0 * blocks;  // [ROWS, blocks] fp16 each
  const uint8_t* mins = v.mins + bh * v.mins_bh + 2 * a0 * blocks;
  float *scale = work, *minimum = work + ROWS * blocks;  // [blocks, ROWS]: a block's ROWS columns together
  for (int r = 0; r < ROWS; r++)
    for (int64_t b = 0; b < blocks; b++)
      scale[b * ROWS + r] = half_float(scales, r * blocks + b), minimum[b * ROWS + r] = half_float(mins, r * blocks + b);
  const uint8_t* codes = v.codes + bh * v.codes_bh;
  for (int r = 0; r < ROWS; r++) value_levels(v, codes, a0 + r, rows + r * width);
  if (v.count) {
    const int64_t dim_shift = (dim & (dim - 1)) ? -1 : __builtin_ctzll(dim);
    const uint8_t *outliers = v.outliers + bh * v.outliers_bh, *index = v.index + bh * v.index_bh;
    auto put = [&](int r, int64_t d, float exact) {
      const int64_t b = divide(d, group, v.group_shift);
      const float s = scale[b * ROWS + r], m = minimum[b * ROWS + r];
      if (s != 0.f) {
        rows[r * width + d] = (exact - m) / s;
        return;
      }
      for (int64_t g = 0; g < G; g++) acc[g * dim + d] += p[g * S + r] * (exact - m);
    };
    const int64_t first = divide(a0, v.chunk, v.chunk_shift);
    if (divide(a0 + ROWS - 1, v.chunk, v.chunk_shift) == first) {  // one span
      const int64_t low = (a0 - first * v.chunk) * dim;
      each_outlier(v, outliers, index, first, low, low + ROWS * dim, cursor, [&](int64_t at, float exact) {
        const int64_t r = divide(at, dim, dim_shift);
        put((int)r, at - r * dim, exact);
      });
    } else {
      for (int r = 0; r < ROWS; r++) {
        const int64_t chunk = divide(a0 + r, v.chunk, v.chunk_shift), low = (a0 + r - chunk * v.chunk) * dim;
        each_outlier(v, outliers, index, chunk, low, low + dim, cursor, [&](int64_t at, float exact) { put(r, at, exact); });
      }
    }
  }
  alignas(32) float w[ROWS];
  for (int64_t g = 0; g < G; g++)
    for (int64_t b = 0, from = 0; from < dim; b++, from += group) {
      float* mean = means + (g * blocks + b) * ROWS;
#ifdef RUNNER_AVX2
      const __m256 pv = _mm256_loadu_ps(p + g * S);
      _mm256_store_ps(w, _mm256_mul_ps(pv, _mm256_loadu_ps(scale + b * ROWS)));
      _mm256_storeu_ps(mean, _mm256_fmadd_ps(pv, _mm256_loadu_ps(minimum + b * ROWS), _mm256_loadu_ps(mean)));
#else
      for (int r = 0; r < ROWS; r++) w[r] = p[g * S + r] * scale[b * ROWS + r], mean[r] += p[g * S + r] * minimum[b * ROWS + r];
#endif
      accumulate(w, rows + from, std::min(group, dim - from), width, acc + g * dim + from);
    }
}

// partial [BH·tiles, G, Dv]: per task (row, head, tile), Σ over its columns of probs [BH,G,S] · V[column];
// columns whose G probabilities are all 0 are not read. Columns go ROWS at a time: decoded once, added to the G
// outputs. Called by every thread of a parallel region, as scores_impl.
template <int F>
static void weighted_impl(const Segment& segment, const float* probs, float* partial, int64_t B, int64_t H, int64_t G,
                          int64_t S, int64_t limit) {
  const Store& v = segment.store;
  const int64_t first = first_column(segment, limit, S), end = end_column(segment, limit, S);
  const int64_t tiles = tiles_of(segment, limit, S), dim = v.dim, width = G * dim;
  const int64_t decoded = decoded_width(v), blocks = F == KIVI_VALUE ? v.blocks : 0;
  std::vector<float> rows(ROWS * decoded), spare(decoded);  // this thread's
  std::vector<float> means(G * blocks * ROWS), work(2 * ROWS * blocks);  // value_rows_in_levels'
  float w[ROWS];
#pragma omp for schedule(static) nowait
  for (int64_t task = 0; task < B * H * tiles; task++) {
    const int64_t bh = task / tiles, from = first + (task % tiles) * TILE, last = std::min(end, from + TILE);
    const float* p = probs + bh * G * S;
    float* acc = partial + task * width;
    Cursor cursor;
    std::fill(acc, acc + width, 0.f);
    std::fill(means.begin(), means.end(), 0.f);
    for (int64_t t0 = from; t0 < last; t0 += ROWS) {
      bool used[ROWS], any = false;
      int64_t at[ROWS];
      for (int r = 0; r < ROWS; r++) {
        used[r] = false;
        for (int64_t g = 0; t0 + r < last && g < G; g++) used[r] |= p[g * S + t0 + r] != 0.f;
        at[r] = used[r] ? stored(segment, t0 + r) : 0;
        any |= used[r];
      }
      if (!any) continue;
      if constexpr (F == KIVI_VALUE) {  // ROWS whole consecutive columns: in levels
        if (!segment.modulo && t0 + ROWS <= last) {
          value_rows_in_levels(v, bh, t0 - segment.base, p + t0, S, G, rows.data(), decoded, acc, means.data(),
                               work.data(), cursor);
          continue;
        }
      }
      decode_rows<F>(v, bh, at, used, rows.data(), spare.data(), cursor);
      for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < ROWS; r++) w[r] = t0 + r < last ? p[g * S + t0 + r] : 0.f;
        accumulate(w, rows.data(), dim, dim, acc + g * dim);
      }
    }
    for (int64_t g = 0; g < G; g++)  // the levels' Σ p·m, per block
      for (int64_t b = 0; b < blocks; b++) {
        float mean = 0.f;
        for (int r = 0; r < ROWS; r++) mean += means[(g * blocks + b) * ROWS + r];
        for (int64_t d = b * v.group; d < std::min(dim, (b + 1) * v.group); d++) acc[g * dim + d] += mean;
      }
  }
}

#define DISPATCH(FN, SEGMENT, ...)                                   \
  switch ((SEGMENT).store.format) {                                  \
    case F32: FN<F32>(SEGMENT, __VA_ARGS__); break;                  \
    case F16: FN<F16>(SEGMENT, __VA_ARGS__); break;                  \
    case BF16: FN<BF16>(SEGMENT, __VA_ARGS__); break;                \
    case Q8_0: FN<Q8_0>(SEGMENT, __VA_ARGS__); break;                \
    case Q4_0: FN<Q4_0>(SEGMENT, __VA_ARGS__); break;                \
    case NF4: FN<NF4>(SEGMENT, __VA_ARGS__); break;                  \
    case Q4_1: FN<Q4_1>(SEGMENT, __VA_ARGS__); break;                \
    case KIVI_VALUE: FN<KIVI_VALUE>(SEGMENT, __VA_ARGS__); break;    \
    case KIVI_KEY: FN<KIVI_KEY>(SEGMENT, __VA_ARGS__); break;        \
  }

// scores [B·H,G,S]: -inf, then each segment's columns; queries [Q,B·H,G,D], a segment reading set `query`. One
// parallel region for all of it (segments hold disjoint columns).
void runner_scores(const Segment* segments, int64_t count, const float* queries, const uint8_t* mask,
                   int64_t mask_stride, float* scores, int64_t B, int64_t H, int64_t G, int64_t S, int64_t limit,
                   float scaling, int threads) {
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t row = 0; row < B * H * G; row++) std::fill(scores + row * S, scores + (row + 1) * S, -INFINITY);
    for (int64_t i = 0; i < count; i++) {
      const float* q = queries + segments[i].query * B * H * G * segments[i].store.dim;
      DISPATCH(scores_impl, segments[i], q, mask, mask_stride, scores, B, H, G, S, limit, scaling)
    }
  }
}

// out [O,B·H,G,Dv]: each output the sum of its segments' Σ p·V. One parallel region: the segments' tasks into
// partial sums, then each (row, head) summed by one thread.
void runner_weighted(const Segment* segments, int64_t count, int64_t outputs, const float* probs, float* out,
                     int64_t B, int64_t H, int64_t G, int64_t S, int64_t limit, int threads) {
  const int64_t width = G * segments[0].store.dim;
  std::vector<int64_t> offset(count + 1, 0);  // a segment's first task in `partial`
  for (int64_t i = 0; i < count; i++) offset[i + 1] = offset[i] + B * H * tiles_of(segments[i], limit, S);
  std::unique_ptr<float[]> partial(new float[std::max<int64_t>(offset[count], 1) * width]);
#pragma omp parallel num_threads(threads)
  {
    for (int64_t i = 0; i < count; i++)
      DISPATCH(weighted_impl, segments[i], probs, partial.get() + offset[i] * width, B, H, G, S, limit)
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
      for (int64_t o = 0; o < outputs; o++)
        std::fill(out + (o * B * H + bh) * width, out + (o * B * H + bh + 1) * width, 0.f);
      for (int64_t i = 0; i < count; i++) {
        const int64_t tiles = (offset[i + 1] - offset[i]) / (B * H);
        float* o = out + (segments[i].output * B * H + bh) * width;
        for (int64_t tile = 0; tile < tiles; tile++) {
          const float* a = partial.get() + (offset[i] + bh * tiles + tile) * width;
          for (int64_t j = 0; j < width; j++) o[j] += a[j];
        }
      }
    }
  }
}

