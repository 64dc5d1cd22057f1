// GGUF's quantized block formats as llama.cpp stores them (ggml-common.h), the activation blocks x is quantized to
// before the integer dot products (q8_1, q8_K: ggml-quants.c's quantize_row_q8_*; Q8_0's 16-bit x), and what
// gguf_rows.cpp, gguf_kquants.cpp and gguf_interleaved.cpp share: the half → float conversion, the row loop that
// splits weight rows between threads, and the K-quant and interleaved entry points. The block layouts are byte arrays
// (alignment 1): a row of blocks may start anywhere.
//
// Activation scales are float32 (llama.cpp stores them as fp16): one rounding fewer, and nothing reads them but
// these kernels. Everything else (what is summed in integers, what in floats) is llama.cpp's arithmetic.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RUNNER_GGUF_AVX2 1
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define RUNNER_GGUF_VNNI 1  // the AVX2 path's byte products in one instruction (vpdpbusd) where the CPU has it
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RUNNER_GGUF_AVX512 1  // the 32-element types' products on 512-bit registers (gguf_rows.cpp)
#endif
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace runner_gguf {

using runner_prefetch::prefetch_ahead;

// ggml_type values (ggml.h) of the formats these kernels read.
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
enum Path : int64_t { BEST = 0, SCALAR = 1, AVX2 = 2, AVX512 = 3 };

constexpr int64_t QK = 32;    // elements of a q4_0 / q4_1 / q5_0 / q8_0 block
constexpr int64_t QK_K = 256; // elements of a K-quant super-block

struct BlockQ4_0 { uint8_t d[2]; uint8_t qs[16]; };                                   // x = d·(q − 8)
struct BlockQ4_1 { uint8_t d[2]; uint8_t m[2]; uint8_t qs[16]; };                     // x = d·q + m
struct BlockQ5_0 { uint8_t d[2]; uint8_t qh[4]; uint8_t qs[16]; };                    // x = d·(q − 16), 5th bit in qh
struct BlockQ8_0 { uint8_t d[2]; int8_t qs[32]; };                                    // x = d·q
struct BlockQ4_K { uint8_t d[2]; uint8_t dmin[2]; uint8_t scales[12]; uint8_t qs[128]; };  // 8 × 32, 6-bit sc/m
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint8_t d[2]; };    // 16 × 16, int8 sc
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ6_K) == 210);

// x's blocks: q = round(x / d), d = max|x| / 127 (float32).
struct XQ8_1 { float d; float s; int8_t qs[32]; };              // s = d·Σq (Q4_1's m multiplies it)
struct XQ8_K { float d; int8_t qs[256]; int16_t bsums[16]; };   // bsums: Σq of each 16 (the K-quants' mins)
struct XQ16_0 { float d; int16_t qs[32]; };                       // Q8_0's x: 16 bits, d = max|x| / 32767

inline float half_to_float(const uint8_t* bytes) {
  uint16_t h;
  std::memcpy(&h, bytes, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: a normal float
    float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
#endif
}

// n values of x → int8 with d = max|x| / 127 (0 for an all-zero block); returns d. With AVX2 (n a multiple of 32),
// the same arithmetic 8 at a time: bit-equal to the loop below.
inline float quantize_int8(const float* x, int64_t n, int8_t* q) {
#ifdef RUNNER_GGUF_AVX2
  if (n % 32 == 0) {
    __m256 amax8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(x + i)));
    __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(amax4, _mm_movehdup_ps(amax4)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(id);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
    for (int64_t i = 0; i < n; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; j++) {
        const __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), scale);
        v[j] = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
    }
    return d;
  }
#endif
  float amax = 0.0f;
  for (int64_t i = 0; i < n; i++) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < n; i++) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * id), -127.0f, 127.0f));
  return d;
}

// Q8_0's x at 16 bits a value: 256 times finer than llama.cpp's 8 (see gguf_rows.cpp's Q8_0 products).
inline void quantize_row(const float* x, int64_t k, XQ16_0* out) {
  for (int64_t b = 0; b < k / QK; b++, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = d;
    for (int j = 0; j < QK; j++)
      out[b].qs[j] = static_cast<int16_t>(std::clamp(std::nearbyint(x[j] * id), -32767.0f, 32767.0f));
  }
}
inline void quantize_row(const float* x, int64_t k, XQ8_1* out) {
  for (int64_t b = 0; b < k / QK; b++) {
    out[b].d = quantize_int8(x + b * QK, QK, out[b].qs);
    int sum = 0;
    for (int j = 0; j < QK; j++) sum += out[b].qs[j];
    out[b].s = out[b].d * static_cast<float>(sum);
  }
}
inline void quantize_row(const float* x, int64_t k, XQ8_K* out) {
  for (int64_t b = 0; b < k / QK_K; b++) {
    out[b].d = quantize_int8(x + b * QK_K, QK_K, out[b].qs);
    for (int g = 0; g < 16; g++) {
      int sum = 0;
      for (int j = 0; j < 16; j++) sum += out[b].qs[g * 16 + j];
      out[b].bsums[g] = static_cast<int16_t>(sum);
    }
  }
}

constexpr int64_t GROUP = 4;  // rows of x dotted with a weight block while it is unpacked (accumulators in registers)

// f(std::integral_constant<int, G>) for G = 1..GROUP.
template <typename F>
inline void with_group(int64_t g, F f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// One weight of a product (or of several sharing one x): its N rows of blocks and its output y [M,N].
struct Weight { const uint8_t* blocks; int64_t N; float* y; };

// f(weight, u) for each unit u < units(weight) of every weight (rows, or spans of interleaved rows): the units of all
// the weights are shared out between the threads as one run (one parallel region, `grain` units at the least), so
// each thread reads its own contiguous part of the weights.
template <typename Units, typename F>
inline void each_unit(const std::vector<Weight>& weights, int64_t grain, Units units, F f) {
  std::vector<int64_t> first{0};  // weights[i]'s units are first[i] .. first[i + 1]
  for (const Weight& w : weights) first.push_back(first.back() + units(w));
  at::parallel_for(0, first.back(), grain, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t u = begin; u < end; u++) {
      while (u >= first[i + 1]) i++;
      f(weights[i], u - first[i]);
    }
  });
}

// dot(w, n, m, G) for every row n of every weight and each group of ≤ GROUP rows of x from m: every row of x is
// served while a weight row is in cache, so W is read from memory once whatever M is.
template <typename Dot>
inline void each_row(const std::vector<Weight>& weights, int64_t M, Dot dot) {
  each_unit(weights, 16, [](const Weight& w) { return w.N; }, [&](const Weight& w, int64_t n) {
    for (int64_t m = 0; m < M; m += GROUP) dot(w, n, m, std::min(GROUP, M - m));
  });
}

// The K-quants (gguf_kquants.cpp): each weight's y [M,N] = x · Wᵀ from x's q8_K rows (nb blocks each) and W's rows
// of nb super-blocks; `path` SCALAR or AVX2 (checked by the caller). dequantize_*: nb blocks → nb·256 floats.
void rows_q4_K(const std::vector<Weight>& weights, const XQ8_K* x, int64_t M, int64_t nb, Path path);
void rows_q6_K(const std::vector<Weight>& weights, const XQ8_K* x, int64_t M, int64_t nb, Path path);
void dequantize_q4_K(const BlockQ4_K* blocks, int64_t nb, float* out);
void dequantize_q6_K(const BlockQ6_K* blocks, int64_t nb, float* out);

// Q4_0 / Q4_1 / Q5_0 with 8 rows interleaved (gguf_interleaved.cpp; N a multiple of 8): interleave_rows reorders the bytes
// of each span of 8 plain rows (the same bytes); rows_interleaved is rows_typed on that layout, for one weight or
// several of the same type and K against the same x.
void interleave_rows(const uint8_t* plain, int64_t type, int64_t N, int64_t row_bytes, uint8_t* out);
// The rows ids[0..R) of interleaved blocks [N, row_bytes] as the file stores them → out [R, row_bytes] (an
// embedding's lookup; ids checked by the caller).
void span_rows(const uint8_t* blocks, int64_t type, int64_t row_bytes, const int64_t* ids, int64_t R, uint8_t* out);
void rows_interleaved(const std::vector<Weight>& weights, int64_t type, const XQ8_1* x, int64_t M, int64_t nb,
                      Path path);

#ifdef RUNNER_GGUF_VNNI
// acc + the sums of 4 products of unsigned bytes u8 and signed bytes s8 in each int32 lane (exact).
inline __m256i dot_bytes(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u8, s8);
#else
  return _mm256_dpbusd_avx_epi32(acc, u8, s8);
#endif
}
#endif

#ifdef RUNNER_GGUF_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace runner_gguf
