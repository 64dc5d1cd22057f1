// A few rows of float activations through a GGUF-quantized weight kept as stored: y [M,N] = x [M,K] · W [N,K]ᵀ where
// W is uint8 [N, row_bytes], one row of llama.cpp blocks per output row. Registered as the torch ops
//   runner::gguf_rows(Tensor x, Tensor blocks, int ggml_type, int path=0, bool interleaved=False) -> Tensor
//   runner::gguf_dequantize(Tensor blocks, int ggml_type) -> Tensor
//   runner::gguf_interleave(Tensor blocks, int ggml_type) -> Tensor  (Q4_0 / Q4_1 / Q5_0 in 8-row spans: gguf_interleaved.cpp)
//   runner::gguf_span_rows(Tensor blocks, Tensor ids, int ggml_type) -> Tensor  (interleaved rows as the file stores them)
//   runner::gguf_rows_group(Tensor x, Tensor[] blocks, int ggml_type, int path=0, bool interleaved=True)
//       -> Tensor[]  (several weights of one type against one x)
//   runner::gguf_paths() -> int[]
// (native.py builds them; gguf_rows.py loads them). Types: Q4_0, Q4_1, Q5_0, Q8_0 here; Q4_K, Q6_K in
// gguf_kquants.cpp. Paths: 1 portable C++, 2 AVX2 + FMA, 3 AVX-512 F + BW (this build's best where the CPU has
// them): Q4_0, Q4_1, Q5_0 and Q8_0 on 512-bit registers; the K-quants and the interleaved layouts run their AVX2
// code (VNNI where present) under it.
//
// Why: a decode step streams every weight once, so its speed is the rate at which the weights are read; read as
// 4–8-bit blocks they are 4–8× fewer bytes than float32, provided the arithmetic keeps up. It is llama.cpp's: each
// row of x is quantized once per call (q8_1 with its block sum for Q4_0, Q4_1 and Q5_0; q8_K for the
// K-quants; Q8_0's x at 16 bits, below), then each block's dot product is summed in integers and scaled by the two
// blocks' scales, the sums of a row accumulated in floats. Ported from llama.cpp (MIT): the AVX2 loops of
// ggml_vec_dot_q4_0_q8_0, ggml_vec_dot_q4_1_q8_1 and ggml_vec_dot_q5_0_q8_0 with their helpers bytes_from_nibbles_32, bytes_from_bits_32 and
// mul_sum_i8_pairs_float (ggml/src/ggml-cpu/arch/x86/quants.c); the scalar dot products and dequantize_row_* of
// ggml/src/ggml-quants.c. Changed: x's scales are float32, a weight block is unpacked once for up to GROUP rows, and
// Q4_0 and Q5_0 are done as Q4_1 with m = −8·d and −16·d against q8_1 (Σ(q − 8)·x = Σq·x − 8·Σx: the same
// integers, fewer instructions).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <vector>

#include "gguf_blocks.h"

namespace runner_gguf {
namespace {

// --- portable: integer block sums, scaled in float (ggml-quants.c's reference dot products) ---

float dot_scalar(const BlockQ4_0* w, const XQ8_1* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    int sumi = 0;
    for (int j = 0; j < 16; j++)
      sumi += ((w[b].qs[j] & 0x0f) - 8) * x[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * x[b].qs[j + 16];
    sum += static_cast<float>(sumi) * (half_to_float(w[b].d) * x[b].d);
  }
  return sum;
}

float dot_scalar(const BlockQ4_1* w, const XQ8_1* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    int sumi = 0;
    for (int j = 0; j < 16; j++) sumi += (w[b].qs[j] & 0x0f) * x[b].qs[j] + (w[b].qs[j] >> 4) * x[b].qs[j + 16];
    sum += static_cast<float>(sumi) * (half_to_float(w[b].d) * x[b].d) + half_to_float(w[b].m) * x[b].s;
  }
  return sum;
}

inline uint32_t high_bits(const BlockQ5_0& w) {
  uint32_t qh;
  std::memcpy(&qh, w.qh, 4);
  return qh;
}

// Element i of a Q5_0 block, −16..15: its nibble and bit i of qh.
inline int q5(int nibble, uint32_t qh, int i) { return (nibble | static_cast<int>(((qh >> i) & 1) << 4)) - 16; }

float dot_scalar(const BlockQ5_0* w, const XQ8_1* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    const uint32_t qh = high_bits(w[b]);
    int sumi = 0;
    for (int j = 0; j < 16; j++) {
      sumi += q5(w[b].qs[j] & 0x0f, qh, j) * x[b].qs[j] + q5(w[b].qs[j] >> 4, qh, j + 16) * x[b].qs[j + 16];
    }
    sum += static_cast<float>(sumi) * (half_to_float(w[b].d) * x[b].d);
  }
  return sum;
}

#ifdef RUNNER_GGUF_AVX2
// --- AVX2 (quants.c) ---

// 16 bytes of nibbles → 32 bytes: the low nibbles (elements 0..15), then the high ones (16..31).
inline __m256i bytes_from_nibbles_32(const uint8_t* qs) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

// 32 bits → 32 bytes, 0xFF where the bit is set.
inline __m256i bytes_from_bits_32(const uint8_t* bits) {
  uint32_t x32;
  std::memcpy(&x32, bits, 4);
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuffle);
  const __m256i all_but_own_bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, all_but_own_bit), _mm256_set1_epi64x(-1));
}

// Σ of 32 products of unsigned × signed bytes, as 8 floats (pairs in int16: no overflow for |w| ≤ 128, |x| ≤ 127).
inline __m256 mul_sum_us8_pairs_float(__m256i unsigned_w, __m256i signed_x) {
#ifdef RUNNER_GGUF_VNNI
  return _mm256_cvtepi32_ps(dot_bytes(_mm256_setzero_si256(), unsigned_w, signed_x));
#else
  const __m256i pairs = _mm256_maddubs_epi16(unsigned_w, signed_x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), pairs));
#endif
}

// Q4_1, Q4_0 and Q5_0: unsigned codes (maddubs takes them as they are) and m · x's block sum, m = −8·d for Q4_0 and
// −16·d for Q5_0 (llama.cpp subtracts 8 or 16 from the codes and takes signs instead: more instructions a block).
inline float offset_of(const BlockQ4_1& w, float) { return half_to_float(w.m); }
inline float offset_of(const BlockQ4_0&, float d) { return -8.0f * d; }
inline float offset_of(const BlockQ5_0&, float d) { return -16.0f * d; }

inline __m256i unsigned_codes(const BlockQ4_0& w) { return bytes_from_nibbles_32(w.qs); }
inline __m256i unsigned_codes(const BlockQ4_1& w) { return bytes_from_nibbles_32(w.qs); }
inline __m256i unsigned_codes(const BlockQ5_0& w) {  // the nibble | 16 where the 5th bit is set: 0..31
  return _mm256_or_si256(bytes_from_nibbles_32(w.qs), _mm256_and_si256(bytes_from_bits_32(w.qh), _mm256_set1_epi8(16)));
}

template <int G, typename W>
void dot_avx2(const W* w, const XQ8_1* x, int64_t nb, float* y, int64_t y_stride) {
  __m256 acc[G];
  float mins[G] = {};
  for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    prefetch_ahead(w + b, sizeof(W));
    const float dw = half_to_float(w[b].d), mw = offset_of(w[b], dw);
    const __m256i qw = unsigned_codes(w[b]);  // |Σ of a maddubs pair| ≤ 2·31·127: no int16 overflow
    for (int g = 0; g < G; g++) {
      const XQ8_1& xb = x[g * nb + b];
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      mins[g] += mw * xb.s;
      acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), mul_sum_us8_pairs_float(qw, qx), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) y[g * y_stride] = hsum(acc[g]) + mins[g];
}
#endif

#ifdef RUNNER_GGUF_AVX512
// --- AVX-512: two blocks a step (Q4_0, Q4_1, Q5_0 against q8_1) ---

// Two blocks' unsigned codes in one register: block 0 in bytes 0..31, block 1 in 32..63; Q5_0's fifth bits from a
// 64-bit mask in one instruction (AVX2 spends four a block on them).
template <typename W>
inline __m512i unsigned_codes_2(const W* w) {
  const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[0].qs));
  const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[1].qs));
  __m512i codes = _mm512_inserti32x4(_mm512_castsi128_si512(p0), _mm_srli_epi16(p0, 4), 1);
  codes = _mm512_inserti32x4(_mm512_inserti32x4(codes, p1, 2), _mm_srli_epi16(p1, 4), 3);
  codes = _mm512_and_si512(codes, _mm512_set1_epi8(0x0f));
  if constexpr (std::is_same_v<W, BlockQ5_0>) {
    const uint64_t fifth = high_bits(w[0]) | (uint64_t{high_bits(w[1])} << 32);
    codes = _mm512_or_si512(codes, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(16)));
  }
  return codes;
}

// 16 int32 lanes, each the sum of 4 products of unsigned × signed bytes (exact).
inline __m512i dot_bytes_512(__m512i unsigned_w, __m512i signed_x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned_w, signed_x);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(unsigned_w, signed_x), _mm512_set1_epi16(1));
#endif
}

template <int G, typename W>
void dot_avx512(const W* w, const XQ8_1* x, int64_t nb, float* y, int64_t y_stride) {
  __m512 acc[G];
  float rest[G] = {};  // the offsets' sums, and an odd last block's products
  for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < nb; b += 2) {
    prefetch_ahead(w + b, 2 * sizeof(W));
    const float d0 = half_to_float(w[b].d), d1 = half_to_float(w[b + 1].d);
    const float m0 = offset_of(w[b], d0), m1 = offset_of(w[b + 1], d1);
    const __m512i qw = unsigned_codes_2(w + b);
    for (int g = 0; g < G; g++) {
      const XQ8_1 &x0 = x[g * nb + b], &x1 = x[g * nb + b + 1];
      const __m512i qx = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0.qs))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1.qs)), 1);
      const __m512 scale = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d0 * x0.d)),
                                                               _mm256_castps_pd(_mm256_set1_ps(d1 * x1.d)), 1));
      rest[g] += m0 * x0.s + m1 * x1.s;
      acc[g] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot_bytes_512(qw, qx)), acc[g]);
    }
  }
  if (b < nb) {  // an odd number of blocks: the last one as the AVX2 path does it
    const float d = half_to_float(w[b].d), m = offset_of(w[b], d);
    const __m256i qw = unsigned_codes(w[b]);
    for (int g = 0; g < G; g++) {
      const XQ8_1& xb = x[g * nb + b];
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      rest[g] += m * xb.s + hsum(_mm256_mul_ps(_mm256_set1_ps(d * xb.d), mul_sum_us8_pairs_float(qw, qx)));
    }
  }
  for (int g = 0; g < G; g++) y[g * y_stride] = _mm512_reduce_add_ps(acc[g]) + rest[g];
}
#endif

// --- Q8_0 against x at 16 bits: not llama.cpp's 8-bit x ---
// Why: 8-bit activations move a Q8_0 model's logits by ~0.1 on SmolLM2, enough to flip near-tied greedy tokens;
// 16-bit x (per block of 32, d = max|x|/32767) moves them 256 times less, and the integer products cost a third of
// float ones (one vpmaddwd per 16 weights instead of converting every code to a float), so the step reads Q8_0 at
// the memory's rate instead of being bound by conversions. A block's products sum exactly in int32; in AVX2 each
// lane's sum of 4 (|Σ| ≤ 4·127·32767 < 2^24) is exact in float32 too.

float dot_scalar(const BlockQ8_0* w, const XQ16_0* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    int32_t block = 0;
    for (int j = 0; j < QK; j++) block += static_cast<int32_t>(w[b].qs[j]) * x[b].qs[j];
    sum += half_to_float(w[b].d) * x[b].d * static_cast<float>(block);
  }
  return sum;
}

#ifdef RUNNER_GGUF_AVX2
// G rows of x against one Q8_0 weight row: each block's 32 codes widened to int16 once for G rows.
template <int G>
void dot_avx2(const BlockQ8_0* w, const XQ16_0* x, int64_t nb, float* y, int64_t y_stride) {
  __m256 acc[G];
  for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    prefetch_ahead(w + b, sizeof(BlockQ8_0));
    const __m256i q0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].qs)));
    const __m256i q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].qs + 16)));
    const float d = half_to_float(w[b].d);
    for (int g = 0; g < G; g++) {
      const XQ16_0& xb = x[g * nb + b];
      const __m256i sums = _mm256_add_epi32(
          _mm256_madd_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs))),
          _mm256_madd_epi16(q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs + 16))));
      acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(sums), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) y[g * y_stride] = hsum(acc[g]);
}
#endif

#ifdef RUNNER_GGUF_AVX512
// The same on 512-bit registers: a block's 32 codes widened to int16 in one, one vpmaddwd against x's 32 int16 (each
// int32 lane a sum of 2 products, exact in float32), one conversion and one fma a block.
template <int G>
void dot_avx512(const BlockQ8_0* w, const XQ16_0* x, int64_t nb, float* y, int64_t y_stride) {
  __m512 acc[G];
  for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    prefetch_ahead(w + b, sizeof(BlockQ8_0));
    const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs)));
    const float d = half_to_float(w[b].d);
    for (int g = 0; g < G; g++) {
      const XQ16_0& xb = x[g * nb + b];
      const __m512i sums = _mm512_madd_epi16(q, _mm512_loadu_si512(xb.qs));
      acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(d * xb.d), _mm512_cvtepi32_ps(sums), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) y[g * y_stride] = _mm512_reduce_add_ps(acc[g]);
}
#endif

// Each weight's y [M,N] = x's quantized rows (XB blocks, nb a row) · the weight's rows (WB blocks, nb a row).
template <typename WB, typename XB>
void rows_typed(const std::vector<Weight>& weights, const XB* x, int64_t M, int64_t nb, Path path) {
  const auto row = [nb](const Weight& w, int64_t n) { return reinterpret_cast<const WB*>(w.blocks) + n * nb; };
#ifdef RUNNER_GGUF_AVX512
  if (path == AVX512) {
    return each_row(weights, M, [&](const Weight& w, int64_t n, int64_t m, int64_t g) {
      with_group(g, [&](auto group) {
        dot_avx512<decltype(group)::value>(row(w, n), x + m * nb, nb, w.y + m * w.N + n, w.N);
      });
    });
  }
#endif
#ifdef RUNNER_GGUF_AVX2
  if (path == AVX2) {
    return each_row(weights, M, [&](const Weight& w, int64_t n, int64_t m, int64_t g) {
      with_group(g, [&](auto group) {
        dot_avx2<decltype(group)::value>(row(w, n), x + m * nb, nb, w.y + m * w.N + n, w.N);
      });
    });
  }
#endif
  each_row(weights, M, [&](const Weight& w, int64_t n, int64_t m, int64_t g) {
    for (int64_t i = m; i < m + g; i++) w.y[i * w.N + n] = dot_scalar(row(w, n), x + i * nb, nb);
  });
}

// --- dequantization: exactly gguf.quants.dequantize (products and sums rounded as numpy rounds them, unfused) ---

#define RUNNER_UNFUSED __attribute__((optimize("fp-contract=off")))

RUNNER_UNFUSED void dequantize_blocks(const BlockQ4_0* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++, out += QK) {
    const float d = half_to_float(w[b].d);
    for (int j = 0; j < 16; j++) {
      out[j] = d * static_cast<float>((w[b].qs[j] & 0x0f) - 8);
      out[j + 16] = d * static_cast<float>((w[b].qs[j] >> 4) - 8);
    }
  }
}

RUNNER_UNFUSED void dequantize_blocks(const BlockQ4_1* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++, out += QK) {
    const float d = half_to_float(w[b].d), m = half_to_float(w[b].m);
    for (int j = 0; j < 16; j++) {
      out[j] = d * static_cast<float>(w[b].qs[j] & 0x0f) + m;
      out[j + 16] = d * static_cast<float>(w[b].qs[j] >> 4) + m;
    }
  }
}

RUNNER_UNFUSED void dequantize_blocks(const BlockQ5_0* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++, out += QK) {
    const float d = half_to_float(w[b].d);
    const uint32_t qh = high_bits(w[b]);
    for (int j = 0; j < 16; j++) {
      out[j] = d * static_cast<float>(q5(w[b].qs[j] & 0x0f, qh, j));
      out[j + 16] = d * static_cast<float>(q5(w[b].qs[j] >> 4, qh, j + 16));
    }
  }
}

RUNNER_UNFUSED void dequantize_blocks(const BlockQ8_0* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++, out += QK) {
    const float d = half_to_float(w[b].d);
    for (int j = 0; j < QK; j++) out[j] = static_cast<float>(w[b].qs[j]) * d;
  }
}

// --- the ops ---

struct Format { int64_t elements, bytes; const char* name; };

Format format_of(int64_t type) {
  switch (type) {
    case Q4_0: return {QK, sizeof(BlockQ4_0), "Q4_0"};
    case Q4_1: return {QK, sizeof(BlockQ4_1), "Q4_1"};
    case Q5_0: return {QK, sizeof(BlockQ5_0), "Q5_0"};
    case Q8_0: return {QK, sizeof(BlockQ8_0), "Q8_0"};
    case Q4_K: return {QK_K, sizeof(BlockQ4_K), "Q4_K"};
    case Q6_K: return {QK_K, sizeof(BlockQ6_K), "Q6_K"};
    default: TORCH_CHECK(false, "gguf_rows: ggml type ", type, " is not one these kernels read (Q4_0=2, Q4_1=3, "
                         "Q5_0=6, Q8_0=8, Q4_K=12, Q6_K=14)");
  }
  return {};
}

std::vector<int64_t> gguf_paths() {
#ifdef RUNNER_GGUF_AVX512
  return {SCALAR, AVX2, AVX512};
#elif defined(RUNNER_GGUF_AVX2)
  return {SCALAR, AVX2};
#else
  return {SCALAR};
#endif
}

Path chosen_path(int64_t path) {
  const std::vector<int64_t> built = gguf_paths();
  if (path == BEST) return static_cast<Path>(built.back());
  TORCH_CHECK(path == SCALAR || path == AVX2 || path == AVX512, "gguf_rows: path ", path,
              " is none of 0 (best), 1 (scalar), 2 (avx2), 3 (avx512)");
  TORCH_CHECK(std::find(built.begin(), built.end(), path) != built.end(), "gguf_rows: path ", path,
              path == AVX2 ? " (avx2)" : " (avx512)", " is not built on this CPU (gguf_paths() lists those that are)");
  return static_cast<Path>(path);
}

// blocks uint8 [R, row_bytes] of `type` → the elements K of a row (checked against row_bytes).
int64_t row_elements(const at::Tensor& blocks, const Format& format, int64_t k_expected = -1) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "gguf_rows: blocks must be contiguous uint8 [rows, row_bytes], got ", blocks.scalar_type(), " ",
              blocks.sizes());
  const int64_t row_bytes = blocks.size(1);
  if (k_expected >= 0) {
    TORCH_CHECK(k_expected % format.elements == 0, "gguf_rows: K = ", k_expected, " is not a multiple of ",
                format.name, "'s block of ", format.elements);
    TORCH_CHECK(row_bytes == k_expected / format.elements * format.bytes, "gguf_rows: row_bytes ", row_bytes,
                " does not match K = ", k_expected, " in ", format.name, " (", k_expected / format.elements * format.bytes,
                " bytes)");
    return k_expected;
  }
  TORCH_CHECK(row_bytes % format.bytes == 0, "gguf_rows: row_bytes ", row_bytes, " is not a whole number of ",
              format.name, " blocks of ", format.bytes, " bytes");
  return row_bytes / format.bytes * format.elements;
}

template <typename XB>
std::vector<XB> quantized_rows(const at::Tensor& x, int64_t M, int64_t K, int64_t elements) {
  std::vector<XB> out(M * (K / elements));
  const float* data = x.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) quantize_row(data + m * K, K, out.data() + m * (K / elements));
  return out;
}

// Q4_0, Q4_1 and Q5_0 are the types gguf_interleaved.cpp reads with 8 rows interleaved.
void check_interleavable(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q5_0,
              "gguf_rows: only Q4_0 (2), Q4_1 (3) and Q5_0 (6) are read interleaved, not ", type);
  TORCH_CHECK(blocks.size(0) % 8 == 0, "gguf_rows: interleaving takes rows in spans of 8, and ", blocks.size(0),
              " rows are not a whole number of them");
}

// x float32 [M,K] with M ≥ 1 (`op` names the caller in the error), contiguous.
at::Tensor checked_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) >= 1, op,
              ": x must be float32 [M,K] with M ≥ 1, got ", x.scalar_type(), " ", x.sizes());
  return x.contiguous();
}

// x [M,K] (checked) against weights of one type and K (interleaved or not, all alike): x quantized once, one parallel
// region → y [M,N_i] each.
std::vector<at::Tensor> products(const at::Tensor& x, at::TensorList blocks, int64_t type, Path path,
                                 bool interleaved) {
  const Format format = format_of(type);
  const int64_t M = x.size(0), K = x.size(1), nb = K / format.elements;
  std::vector<at::Tensor> ys;
  std::vector<Weight> weights;
  for (const at::Tensor& w : blocks) {
    row_elements(w, format, K);
    if (interleaved) check_interleavable(w, type);
    ys.push_back(at::empty({M, w.size(0)}, x.options()));
    weights.push_back({w.data_ptr<uint8_t>(), w.size(0), ys.back().data_ptr<float>()});
  }
  if (interleaved) {
    rows_interleaved(weights, type, quantized_rows<XQ8_1>(x, M, K, QK).data(), M, nb, path);
    return ys;
  }
  switch (type) {
    case Q4_0: rows_typed<BlockQ4_0>(weights, quantized_rows<XQ8_1>(x, M, K, QK).data(), M, nb, path); break;
    case Q4_1: rows_typed<BlockQ4_1>(weights, quantized_rows<XQ8_1>(x, M, K, QK).data(), M, nb, path); break;
    case Q5_0: rows_typed<BlockQ5_0>(weights, quantized_rows<XQ8_1>(x, M, K, QK).data(), M, nb, path); break;
    case Q8_0: rows_typed<BlockQ8_0>(weights, quantized_rows<XQ16_0>(x, M, K, QK).data(), M, nb, path); break;
    case Q4_K: rows_q4_K(weights, quantized_rows<XQ8_K>(x, M, K, QK_K).data(), M, nb, path); break;
    default: rows_q6_K(weights, quantized_rows<XQ8_K>(x, M, K, QK_K).data(), M, nb, path); break;
  }
  return ys;
}

at::Tensor gguf_rows(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t path, bool interleaved) {
  return products(checked_x(x, "gguf_rows"), {blocks}, type, chosen_path(path), interleaved)[0];
}

// gguf_rows(x, blocks[i], type, path, interleaved) for each i: x quantized once, one parallel region.
std::vector<at::Tensor> gguf_rows_group(const at::Tensor& x, at::TensorList blocks, int64_t type, int64_t path,
                                        bool interleaved) {
  TORCH_CHECK(!blocks.empty(), "gguf_rows_group: no weights");
  return products(checked_x(x, "gguf_rows_group"), blocks, type, chosen_path(path), interleaved);
}

at::Tensor gguf_interleave(const at::Tensor& blocks, int64_t type) {
  row_elements(blocks, format_of(type));
  check_interleavable(blocks, type);
  at::Tensor out = at::empty_like(blocks);
  interleave_rows(blocks.data_ptr<uint8_t>(), type, blocks.size(0), blocks.size(1), out.data_ptr<uint8_t>());
  return out;
}

at::Tensor gguf_span_rows(const at::Tensor& blocks, const at::Tensor& ids_in, int64_t type) {
  row_elements(blocks, format_of(type));
  check_interleavable(blocks, type);
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && ids_in.dim() == 1, "gguf_span_rows: ids must be int64 [R], got ",
              ids_in.scalar_type(), " ", ids_in.sizes());
  const at::Tensor ids = ids_in.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); i++)
    TORCH_CHECK(id[i] >= 0 && id[i] < blocks.size(0), "gguf_span_rows: id ", id[i], " is not a row of ", blocks.size(0));
  at::Tensor out = at::empty({ids.size(0), blocks.size(1)}, blocks.options());
  span_rows(blocks.data_ptr<uint8_t>(), type, blocks.size(1), id, ids.size(0), out.data_ptr<uint8_t>());
  return out;
}

template <typename WB>
void dequantize_rows(const at::Tensor& blocks, int64_t nb, int64_t per_row, float* out,
                     void (*rows)(const WB*, int64_t, float*)) {
  const auto* w = reinterpret_cast<const WB*>(blocks.data_ptr<uint8_t>());
  at::parallel_for(0, blocks.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) rows(w + r * nb, nb, out + r * per_row);
  });
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type) {
  const Format format = format_of(type);
  const int64_t K = row_elements(blocks, format), nb = K / format.elements;
  at::Tensor out = at::empty({blocks.size(0), K}, blocks.options().dtype(at::kFloat));
  float* data = out.data_ptr<float>();
  switch (type) {
    case Q4_0: dequantize_rows<BlockQ4_0>(blocks, nb, K, data, &dequantize_blocks); break;
    case Q4_1: dequantize_rows<BlockQ4_1>(blocks, nb, K, data, &dequantize_blocks); break;
    case Q5_0: dequantize_rows<BlockQ5_0>(blocks, nb, K, data, &dequantize_blocks); break;
    case Q8_0: dequantize_rows<BlockQ8_0>(blocks, nb, K, data, &dequantize_blocks); break;
    case Q4_K: dequantize_rows<BlockQ4_K>(blocks, nb, K, data, &dequantize_q4_K); break;
    default: dequantize_rows<BlockQ6_K>(blocks, nb, K, data, &dequantize_q6_K); break;
  }
  return out;
}

}  // namespace
}  // namespace runner_gguf

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("gguf_rows(Tensor x, Tensor blocks, int ggml_type, int path=0, bool interleaved=False) -> Tensor");
  m.def("gguf_interleave(Tensor blocks, int ggml_type) -> Tensor");
  m.def("gguf_rows_group(Tensor x, Tensor[] blocks, int ggml_type, int path=0, bool interleaved=True) -> Tensor[]");
  m.def("gguf_dequantize(Tensor blocks, int ggml_type) -> Tensor");
  m.def("gguf_span_rows(Tensor blocks, Tensor ids, int ggml_type) -> Tensor");
  m.def("gguf_paths() -> int[]", &runner_gguf::gguf_paths);
}

TORCH_LIBRARY_IMPL(runner, CPU, m) {
  m.impl("gguf_rows", &runner_gguf::gguf_rows);
  m.impl("gguf_dequantize", &runner_gguf::gguf_dequantize);
  m.impl("gguf_span_rows", &runner_gguf::gguf_span_rows);
  m.impl("gguf_interleave", &runner_gguf::gguf_interleave);
  m.impl("gguf_rows_group", &runner_gguf::gguf_rows_group);
}
