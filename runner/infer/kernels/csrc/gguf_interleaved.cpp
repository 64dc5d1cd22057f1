// Q4_0, Q4_1 and Q5_0 weights with 8 rows interleaved (gguf_blocks.h's layout note), for runner::gguf_rows(...,
// interleaved=True) and runner::gguf_interleave (gguf_rows.cpp registers both).
//
// Why: a row-at-a-time dot product spends ~20 instructions on each 20-byte block (two fp16 scales converted one at
// a time, the nibbles unpacked, a horizontal sum per row), so on AVX2 it is compute-bound at about half the rate the
// memory delivers. With 8 rows' blocks side by side, one 256-bit register holds 4 consecutive weights of each of 8
// rows: x's 4 bytes are broadcast, maddubs + madd give each row's partial sum in its own lane, the 8 rows' scales
// convert in one instruction, and 8 results are stored at once (no horizontal sum): ~6 instructions a block.
// llama.cpp repacks Q4_0 the same way on AVX2 (ggml-cpu/repack.cpp, block_q4_0x8); this layout is ours (the scales
// first, then the nibbles of 4-byte groups), and Q4_1 and Q5_0 too (Q5_0's fifth bits stay in each row's 32-bit qh,
// picked out per group of 4 by a byte shuffle). Same bytes as the file's: only their order differs, within each span
// of 8 rows.
#include "gguf_blocks.h"

namespace runner_gguf {
namespace {

// The interleaved block of 8 rows: d[8] fp16, (Q4_1) m[8] fp16 or (Q5_0) qh[8] uint32 (row r's fifth bits), then
// for t = 0..3 the 4 bytes qs[4t..4t+3] of each row 0..7 (low nibbles: elements 4t..4t+3; high: 16+4t..16+4t+3).
constexpr int64_t ROWS = 8;
template <int64_t T> constexpr int64_t scale_bytes = T == Q4_1 ? 32 : T == Q5_0 ? 48 : 16;
template <int64_t T> constexpr int64_t group_block_bytes = scale_bytes<T> + ROWS * 16;

template <int64_t T> constexpr int64_t block_bytes = group_block_bytes<T> / ROWS;  // a plain block: 18, 20 or 22

// f(offset in the interleaved block, offset in row r's plain block, bytes) for each of row r's fields: the layout,
// read one way to interleave and the other to read a row back.
template <int64_t T, typename F>
inline void each_field(int64_t r, F f) {
  f(2 * r, 0, 2);                                       // d
  if constexpr (T == Q4_1) f(16 + 2 * r, 2, 2);         // m
  if constexpr (T == Q5_0) f(16 + 4 * r, 2, 4);         // qh
  const int64_t qs = block_bytes<T> - 16;               // the plain block's nibbles follow its header
  for (int64_t t = 0; t < 4; t++) f(scale_bytes<T> + t * 32 + r * 4, qs + 4 * t, 4);
}

template <int64_t T>
void interleave_span(const uint8_t* plain, int64_t nb, uint8_t* out) {
  for (int64_t b = 0; b < nb; b++, out += group_block_bytes<T>) {
    for (int64_t r = 0; r < ROWS; r++) {
      const uint8_t* block = plain + (r * nb + b) * block_bytes<T>;
      each_field<T>(r, [&](int64_t at, int64_t from, int64_t n) { std::memcpy(out + at, block + from, n); });
    }
  }
}

// Row r's offset: Q4_1's m; −8·d for Q4_0 and −16·d for Q5_0, whose q − 8 / q − 16 is done as q with that offset
// against x's block sum.
template <int64_t T>
inline float offset_of(const uint8_t* block, int64_t r, float d) {
  if constexpr (T == Q4_1) return half_to_float(block + 16 + 2 * r);
  return (T == Q5_0 ? -16.0f : -8.0f) * d;
}

// Row r's code for element i (nibble n): Q5_0's fifth bit from its qh, else the nibble.
template <int64_t T>
inline int code_of(const uint8_t* block, int64_t r, int n, int i) {
  if constexpr (T != Q5_0) return n;
  uint32_t qh;
  std::memcpy(&qh, block + 16 + 4 * r, 4);
  return n | static_cast<int>(((qh >> i) & 1) << 4);
}

// G rows of x (stride nb) against the 8 weight rows of one span → y[g·y_stride + r].
template <int64_t T>
void dot_span_scalar(const uint8_t* span, const XQ8_1* x, int64_t G, int64_t nb, float* y, int64_t y_stride) {
  for (int64_t g = 0; g < G; g++) {
    float sums[ROWS] = {};
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* block = span + b * group_block_bytes<T>;
      const XQ8_1& xb = x[g * nb + b];
      for (int64_t r = 0; r < ROWS; r++) {
        int sumi = 0;
        for (int64_t t = 0; t < 4; t++) {
          const uint8_t* q = block + scale_bytes<T> + t * 32 + r * 4;
          for (int j = 0; j < 4; j++) {
            const int i = static_cast<int>(4 * t) + j;
            sumi += code_of<T>(block, r, q[j] & 0x0f, i) * xb.qs[i] + code_of<T>(block, r, q[j] >> 4, 16 + i) * xb.qs[16 + i];
          }
        }
        const float d = half_to_float(block + 2 * r);
        sums[r] += static_cast<float>(sumi) * (d * xb.d) + offset_of<T>(block, r, d) * xb.s;
      }
    }
    for (int64_t r = 0; r < ROWS; r++) y[g * y_stride + r] = sums[r];
  }
}

#ifdef RUNNER_GGUF_AVX2
// Q5_0's fifth bits of one group of 4 elements for the 8 rows (lane r: row r's qh): 16 in byte j of lane r where bit
// 8·byte + shift + j of qh_r is set (a byte shuffle, a test, a select: the layout keeps the file's bytes).
inline __m256i fifth_bits(__m256i qh, int byte, int shift) {
  const __m256i within = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808, 0x0c0c0c0c);
  const __m256i bits = _mm256_shuffle_epi8(qh, _mm256_add_epi8(within, _mm256_set1_epi8(static_cast<char>(byte))));
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x08040201u << shift));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, mask), mask), _mm256_set1_epi8(16));
}

template <int G, int64_t T>
void dot_span_avx2(const uint8_t* span, const XQ8_1* x, int64_t nb, float* y, int64_t y_stride) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[G];
  for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* block = span + b * group_block_bytes<T>;
    prefetch_ahead(block, group_block_bytes<T>);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));  // [8 rows]
    const __m256 offset = T == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)))
                                    : _mm256_mul_ps(d, _mm256_set1_ps(T == Q5_0 ? -16.0f : -8.0f));
    __m256i low[4], high[4];  // lane r: 4 codes of row r, elements 4t.. (low) and 16+4t.. (high)
    for (int t = 0; t < 4; t++) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + scale_bytes<T> + 32 * t));
      low[t] = _mm256_and_si256(packed, low_nibbles);
      high[t] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
    }
    if constexpr (T == Q5_0) {  // codes 0..31: |Σ of 8 maddubs| ≤ 8·2·31·127 = 62992 overflows int16 (below)
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      for (int t = 0; t < 4; t++) {
        low[t] = _mm256_or_si256(low[t], fifth_bits(qh, t / 2, 4 * (t % 2)));
        high[t] = _mm256_or_si256(high[t], fifth_bits(qh, 2 + t / 2, 4 * (t % 2)));
      }
    }
    for (int g = 0; g < G; g++) {
      const XQ8_1& xb = x[g * nb + b];
      int32_t xq[8];
      std::memcpy(xq, xb.qs, 32);
#ifdef RUNNER_GGUF_VNNI
      // vpdpbusd: 4 byte products summed into each row's int32 lane; two chains, the same integers as below
      __m256i sum_low = _mm256_setzero_si256(), sum_high = _mm256_setzero_si256();
      for (int t = 0; t < 4; t++) {
        sum_low = dot_bytes(sum_low, low[t], _mm256_set1_epi32(xq[t]));
        sum_high = dot_bytes(sum_high, high[t], _mm256_set1_epi32(xq[4 + t]));
      }
      const __m256 sumi = _mm256_cvtepi32_ps(_mm256_add_epi32(sum_low, sum_high));  // [8 rows]
#else
      // int16 lanes: 4 maddubs sum to ≤ 4·2·15·127 = 15240 (Q4) or 4·2·31·127 = 31496 (Q5_0), so low and high are
      // widened apart (each below 2^15)
      __m256i low16 = _mm256_maddubs_epi16(low[0], _mm256_set1_epi32(xq[0]));
      __m256i high16 = _mm256_maddubs_epi16(high[0], _mm256_set1_epi32(xq[4]));
      for (int t = 1; t < 4; t++) {
        low16 = _mm256_add_epi16(low16, _mm256_maddubs_epi16(low[t], _mm256_set1_epi32(xq[t])));
        high16 = _mm256_add_epi16(high16, _mm256_maddubs_epi16(high[t], _mm256_set1_epi32(xq[4 + t])));
      }
      const __m256 sumi = _mm256_cvtepi32_ps(  // [8 rows]
          _mm256_add_epi32(_mm256_madd_epi16(low16, ones), _mm256_madd_epi16(high16, ones)));
#endif
      acc[g] = _mm256_fmadd_ps(sumi, _mm256_mul_ps(d, _mm256_set1_ps(xb.d)), acc[g]);
      acc[g] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xb.s), acc[g]);
    }
  }
  for (int g = 0; g < G; g++) _mm256_storeu_ps(y + g * y_stride, acc[g]);
}
#endif

// y[m·y_stride + r] for the M rows of x against the 8 rows of one span, G rows of x at a time.
template <int64_t T>
void rows_of_span(const uint8_t* span, const XQ8_1* x, int64_t M, int64_t nb, float* y, int64_t y_stride, Path path) {
  for (int64_t m = 0; m < M; m += GROUP) {
    const int64_t g = std::min(GROUP, M - m);
#ifdef RUNNER_GGUF_AVX2
    if (path >= AVX2) {  // AVX512 too: these have no 512-bit code of their own
      with_group(g, [&](auto group) {
        dot_span_avx2<decltype(group)::value, T>(span, x + m * nb, nb, y + m * y_stride, y_stride);
      });
      continue;
    }
#endif
    dot_span_scalar<T>(span, x + m * nb, g, nb, y + m * y_stride, y_stride);
  }
}

// Row r of a span as the file stores it (interleave_span's inverse for one row).
template <int64_t T>
void plain_row(const uint8_t* span, int64_t nb, int64_t r, uint8_t* out) {
  for (int64_t b = 0; b < nb; b++, out += block_bytes<T>) {
    const uint8_t* block = span + b * group_block_bytes<T>;
    each_field<T>(r, [&](int64_t at, int64_t to, int64_t n) { std::memcpy(out + to, block + at, n); });
  }
}

// f(std::integral_constant<int64_t, T>) for the interleaved type T named by `type` (Q4_0, Q4_1 or Q5_0).
template <typename F>
inline void with_type(int64_t type, F f) {
  if (type == Q4_1) f(std::integral_constant<int64_t, Q4_1>{});
  else if (type == Q5_0) f(std::integral_constant<int64_t, Q5_0>{});
  else f(std::integral_constant<int64_t, Q4_0>{});
}

// Several weights against the same x, their spans shared out between the threads as one run (one parallel region).
template <int64_t T>
void rows_spans(const std::vector<Weight>& weights, const XQ8_1* x, int64_t M, int64_t nb, Path path) {
  const int64_t span_bytes = nb * group_block_bytes<T>;
  each_unit(weights, 2, [](const Weight& w) { return w.N / ROWS; }, [&](const Weight& w, int64_t s) {
    rows_of_span<T>(w.blocks + s * span_bytes, x, M, nb, w.y + s * ROWS, w.N, path);
  });
}

}  // namespace

void rows_interleaved(const std::vector<Weight>& weights, int64_t type, const XQ8_1* x, int64_t M, int64_t nb,
                      Path path) {
  with_type(type, [&](auto t) { rows_spans<decltype(t)::value>(weights, x, M, nb, path); });
}

void interleave_rows(const uint8_t* plain, int64_t type, int64_t N, int64_t row_bytes, uint8_t* out) {
  with_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    at::parallel_for(0, N / ROWS, 16, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; s++) {
        const int64_t at_byte = s * ROWS * row_bytes;
        interleave_span<T>(plain + at_byte, row_bytes / block_bytes<T>, out + at_byte);
      }
    });
  });
}

void span_rows(const uint8_t* blocks, int64_t type, int64_t row_bytes, const int64_t* ids, int64_t R, uint8_t* out) {
  with_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    for (int64_t i = 0; i < R; i++)
      plain_row<T>(blocks + ids[i] / ROWS * ROWS * row_bytes, row_bytes / block_bytes<T>, ids[i] % ROWS,
                   out + i * row_bytes);
  });
}

}  // namespace runner_gguf
