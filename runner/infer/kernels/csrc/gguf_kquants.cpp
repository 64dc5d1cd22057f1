// The K-quants of runner::gguf_rows (gguf_rows.cpp registers the ops): Q4_K and Q6_K weight rows of 256-element
// super-blocks against x's rows quantized to q8_K (gguf_blocks.h), and their dequantization.
//
// Q4_K: 8 sub-blocks of 32 with 6-bit scales sc and mins m (packed in 12 bytes), x = d·sc·q − dmin·m, q 0..15.
// Q6_K: 16 sub-blocks of 16 with int8 scales, x = d·sc·(q − 32), q 0..63 (4 low bits in ql, 2 high in qh).
// A super-block's dot product is an integer Σ sc·Σ(q·q8) (and Σ m·bsum for Q4_K's mins, from x's 16-sums), scaled
// once by d·d_x. Ported from llama.cpp (MIT): the AVX2 loops of ggml_vec_dot_q4_K_q8_K and ggml_vec_dot_q6_K_q8_K
// (ggml/src/ggml-cpu/arch/x86/quants.c), the reference dot products and dequantize_row_q4_K / q6_K
// (ggml/src/ggml-quants.c). Changed: x's d is float32 (q8_K's is too), a weight block is unpacked once for up to
// GROUP rows of x.
#include "gguf_blocks.h"

namespace runner_gguf {
namespace {

// Q4_K's 12 bytes → the 8 scales (bytes 0..7) and the 8 mins (bytes 8..15), as llama.cpp unpacks them.
inline void scales_and_mins(const uint8_t* packed, uint8_t out[16]) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  u[3] = ((u[2] >> 4) & kmask2) | (((u[1] >> 6) & kmask3) << 4);
  const uint32_t mins_low = u[1] & kmask1;
  u[1] = (u[2] & kmask2) | (((u[0] >> 6) & kmask3) << 4);
  u[2] = mins_low;
  u[0] &= kmask1;
  std::memcpy(out, u, 16);
}

float dot_scalar(const BlockQ4_K* w, const XQ8_K* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    uint8_t sm[16];
    scales_and_mins(w[b].scales, sm);
    int isum = 0, msum = 0;
    for (int s = 0; s < 8; s++) {
      const uint8_t* q = w[b].qs + (s / 2) * 32;
      const int8_t* q8 = x[b].qs + s * 32;
      const int shift = (s % 2) * 4;
      int sumi = 0;
      for (int j = 0; j < 32; j++) sumi += ((q[j] >> shift) & 0x0f) * q8[j];
      isum += sm[s] * sumi;
      msum += sm[8 + s] * (x[b].bsums[2 * s] + x[b].bsums[2 * s + 1]);
    }
    sum += (half_to_float(w[b].d) * x[b].d) * static_cast<float>(isum)
           - (half_to_float(w[b].dmin) * x[b].d) * static_cast<float>(msum);
  }
  return sum;
}

// Q6_K's element 128·h + 32·k + l (h half, k quarter, l < 32), 0..63.
inline int q6(const BlockQ6_K& w, int h, int k, int l) {
  const uint8_t low = w.ql[h * 64 + (k % 2) * 32 + l], high = w.qh[h * 32 + l];
  return ((k < 2 ? low & 0x0f : low >> 4)) | (((high >> (2 * k)) & 3) << 4);
}

float dot_scalar(const BlockQ6_K* w, const XQ8_K* x, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; b++) {
    int isum = 0;
    for (int h = 0; h < 2; h++)
      for (int k = 0; k < 4; k++)
        for (int half = 0; half < 2; half++) {  // 16 elements, one scale
          int sumi = 0;
          for (int l = half * 16; l < half * 16 + 16; l++) sumi += (q6(w[b], h, k, l) - 32) * x[b].qs[h * 128 + k * 32 + l];
          isum += w[b].scales[h * 8 + k * 2 + half] * sumi;
        }
    sum += (half_to_float(w[b].d) * x[b].d) * static_cast<float>(isum);
  }
  return sum;
}

#ifdef RUNNER_GGUF_AVX2
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <int G>
void dot_avx2(const BlockQ4_K* w, const XQ8_K* x, int64_t nb, float* y, int64_t y_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256 acc[G];
  __m128 acc_m[G];
  for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps(), acc_m[g] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    prefetch_ahead(w + b, sizeof(*w));
    const float d = half_to_float(w[b].d), dmin = half_to_float(w[b].dmin);
    uint8_t sm[16];
    scales_and_mins(w[b].scales, sm);
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
    const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    const __m256i scales = _mm256_inserti128_si256(_mm256_castsi128_si256(sc128), sc128, 1);
    __m256i q4l[4], q4h[4], scale_l[4], scale_h[4];
    for (int j = 0; j < 4; j++) {
      const __m256i bits = load32(w[b].qs + 32 * j);
      q4l[j] = _mm256_and_si256(bits, m4);
      q4h[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
      // broadcast scale 2j (2j+1): the int16 at bytes 4j, 4j+1 (4j+2, 4j+3)
      scale_l[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(((4 * j + 1) << 8) | (4 * j))));
      scale_h[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<short>(((4 * j + 3) << 8) | (4 * j + 2))));
    }
    for (int g = 0; g < G; g++) {
      const XQ8_K& xb = x[g * nb + b];
      const __m256i q8sums = load32(xb.bsums);
      const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
      acc_m[g] = _mm_fmadd_ps(_mm_set1_ps(dmin * xb.d), _mm_cvtepi32_ps(_mm_madd_epi16(mins, q8s)), acc_m[g]);
      __m256i sumi = _mm256_setzero_si256();
      for (int j = 0; j < 4; j++) {
        const __m256i p16l = _mm256_madd_epi16(scale_l[j], _mm256_maddubs_epi16(q4l[j], load32(xb.qs + 64 * j)));
        const __m256i p16h = _mm256_madd_epi16(scale_h[j], _mm256_maddubs_epi16(q4h[j], load32(xb.qs + 64 * j + 32)));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
      }
      acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(sumi), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) {
    __m128 m = _mm_add_ps(acc_m[g], _mm_movehl_ps(acc_m[g], acc_m[g]));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    y[g * y_stride] = hsum(acc[g]) - _mm_cvtss_f32(m);
  }
}

template <int G>
void dot_avx2(const BlockQ6_K* w, const XQ8_K* x, int64_t nb, float* y, int64_t y_stride) {
  const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), m32s = _mm256_set1_epi8(32);
  __m256 acc[G];
  for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    prefetch_ahead(w + b, sizeof(*w));
    const float d = half_to_float(w[b].d);
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].scales));
    __m256i q[8], scale[8];  // element groups of 32 in order; each with its two scales (16 elements each) as int16
    for (int h = 0; h < 2; h++) {
      const __m256i bits1 = load32(w[b].ql + 64 * h), bits2 = load32(w[b].ql + 64 * h + 32);
      const __m256i high = load32(w[b].qh + 32 * h);
      const __m256i low[4] = {_mm256_and_si256(bits1, m4), _mm256_and_si256(bits2, m4),
                              _mm256_and_si256(_mm256_srli_epi16(bits1, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(bits2, 4), m4)};
      for (int k = 0; k < 4; k++) {
        const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * k), m2), 4);
        q[4 * h + k] = _mm256_or_si256(low[k], top);
        const int s = 8 * h + 2 * k;  // scales s (first 16) and s + 1 (next 16)
        const __m128i pick = _mm_set_epi8(s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s + 1, s, s, s, s, s, s, s, s);
        scale[4 * h + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
      }
    }
    for (int g = 0; g < G; g++) {
      const XQ8_K& xb = x[g * nb + b];
      __m256i sumi = _mm256_setzero_si256();
      for (int i = 0; i < 8; i++) {
        const __m256i q8 = load32(xb.qs + 32 * i);  // (q − 32)·q8 = q·q8 − 32·q8: maddubs takes q unsigned
        const __m256i p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q[i], q8), _mm256_maddubs_epi16(m32s, q8));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale[i], p16));
      }
      acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb.d), _mm256_cvtepi32_ps(sumi), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) y[g * y_stride] = hsum(acc[g]);
}
#endif

template <typename WB>
void rows_typed(const std::vector<Weight>& weights, const XQ8_K* x, int64_t M, int64_t nb, Path path) {
  const auto row = [nb](const Weight& w, int64_t n) { return reinterpret_cast<const WB*>(w.blocks) + n * nb; };
#ifdef RUNNER_GGUF_AVX2
  if (path >= AVX2) {  // AVX512 too: these have no 512-bit code of their own
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

}  // namespace

void rows_q4_K(const std::vector<Weight>& weights, const XQ8_K* x, int64_t M, int64_t nb, Path path) {
  rows_typed<BlockQ4_K>(weights, x, M, nb, path);
}
void rows_q6_K(const std::vector<Weight>& weights, const XQ8_K* x, int64_t M, int64_t nb, Path path) {
  rows_typed<BlockQ6_K>(weights, x, M, nb, path);
}

// Exactly gguf.quants.dequantize: (d·sc)·q − dmin·m and (d·sc)·(q − 32), each product rounded (unfused).
__attribute__((optimize("fp-contract=off"))) void dequantize_q4_K(const BlockQ4_K* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++) {
    uint8_t sm[16];
    scales_and_mins(w[b].scales, sm);
    const float d = half_to_float(w[b].d), dmin = half_to_float(w[b].dmin);
    for (int s = 0; s < 8; s++, out += 32) {
      const float scale = d * static_cast<float>(sm[s]), min = dmin * static_cast<float>(sm[8 + s]);
      const uint8_t* q = w[b].qs + (s / 2) * 32;
      for (int j = 0; j < 32; j++) out[j] = scale * static_cast<float>((q[j] >> ((s % 2) * 4)) & 0x0f) - min;
    }
  }
}

__attribute__((optimize("fp-contract=off"))) void dequantize_q6_K(const BlockQ6_K* w, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; b++) {
    const float d = half_to_float(w[b].d);
    for (int h = 0; h < 2; h++)
      for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++, out++)
          *out = (d * static_cast<float>(w[b].scales[h * 8 + k * 2 + l / 16])) * static_cast<float>(q6(w[b], h, k, l) - 32);
  }
}

}  // namespace runner_gguf
