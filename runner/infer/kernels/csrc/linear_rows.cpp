// A few rows through a Linear: y [M,N] = x [M,K] · W [N,K]ᵀ (+ bias [N]), M ≤ MAX_ROWS (16; the paths without
// AMX take 8 at a time), float32 or bfloat16,
// W an nn.Linear's weight as stored (row-major). Registered as the torch op runner::linear_rows (native.py builds
// it); cpu_linear.py's pass has the compiled decode step call it where a product of M ≤ MAX_ROWS rows would call
// aten's mm.
//
// Why: a decode step is a chain of matrix-vector products that stream the weights once, so its speed is the rate
// at which they are read. aten's one-row product read SmolLM2's weights at about 11 GB/s on a 2-core Zen 4 whose
// copy runs at 32 GB/s; this loop reads them at 25 GB/s in float32 (benchmarks/linear_rows.py). Each weight row is
// read once for all M rows of x; threads split the weight rows (each reads its own part of W).
//
// bfloat16 (AVX2): a float is the bf16 bits shifted up 16, so 16 weights become two float vectors with one AND
// (the odd ones, already in the high halves) and one shift (the even ones); x is split the same way once per call,
// into even and odd floats of each 16, so the products pair up (with AVX-512 BF16: `block_dp`). Sums are float32
// (as aten's bf16 mm accumulates); the result is rounded to bfloat16 once. With AMX: `product_amx`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "prefetch.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RUNNER_AVX2 1
#endif

namespace {

constexpr int64_t MAX_ROWS = 16;  // the AMX path's tile height
constexpr int64_t PATH_ROWS = 8;  // the other paths' most rows a pass: more are taken 8 at a time
constexpr int64_t STEP = 16;  // weights per inner step (two vectors of 8 floats)

#ifdef RUNNER_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 16 weights as two float vectors, in the order `split_rows` puts x in.
inline void load16(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}
inline void load16(const c10::BFloat16* w, __m256& a, __m256& b) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));                            // weights 0, 2, 4, …
  b = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFF0000)));  // weights 1, 3, 5, …
}
#endif

// x [M,K] → float32 [M,K] in load16's order for the whole steps of 16 (then the tail as is).
template <typename T>
std::vector<float> split_rows(const T* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  const int64_t whole = K / STEP * STEP;
  for (int64_t m = 0; m < M; m++) {
    const T* row = x + m * K;
    float* to = out.data() + m * K;
    for (int64_t k = 0; k < whole; k += STEP)
      for (int64_t j = 0; j < STEP; j++) {
        const int64_t at = std::is_same_v<T, c10::BFloat16> ? (j % 2) * 8 + j / 2 : j;
        to[k + at] = static_cast<float>(row[k + j]);
      }
    for (int64_t k = whole; k < K; k++) to[k] = static_cast<float>(row[k]);
  }
  return out;
}

// R weight rows against M rows of x → y [M,N] (row stride N) in T, bias (or nullptr) added before rounding.
template <int R, int M, typename T>
inline void block(const T* w, const float* x, const T* bias, T* y, int64_t K, int64_t N) {
  const int64_t whole = K / STEP * STEP;
  float sums[M][R] = {};
#ifdef RUNNER_AVX2
  __m256 acc[M][R];
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += STEP) {
    __m256 a[R], b[R];
    for (int r = 0; r < R; r++) {
      runner_prefetch::prefetch_ahead(w + r * K + k, STEP * sizeof(T));
      load16(w + r * K + k, a[r], b[r]);
    }
    for (int m = 0; m < M; m++) {
      const __m256 xa = _mm256_loadu_ps(x + m * K + k), xb = _mm256_loadu_ps(x + m * K + k + 8);
      for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(b[r], xb, _mm256_fmadd_ps(a[r], xa, acc[m][r]));
    }
  }
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) sums[m][r] = hsum(acc[m][r]);
#else
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++)
      for (int64_t k = 0; k < whole; k++) {
        const int64_t j = k % STEP, at = std::is_same_v<T, c10::BFloat16> ? (j % 2) * 8 + j / 2 : j;
        sums[m][r] += static_cast<float>(w[r * K + k]) * x[m * K + k - j + at];
      }
#endif
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) {
      float sum = sums[m][r] + (bias ? static_cast<float>(bias[r]) : 0.0f);
      for (int64_t k = whole; k < K; k++) sum += static_cast<float>(w[r * K + k]) * x[m * K + k];
      y[m * N + r] = static_cast<T>(sum);  // bfloat16: rounded to nearest even
    }
}

#ifdef __AVX512F__
#define RUNNER_AVX512 1
// float32 where the CPU has AVX-512: one 64-byte load a weight row per step (a cache line), 4 rows a block. On a
// 2-core AVX-512 Xeon it read SmolLM2's 211 weights at the rate of a plain sum over them (19.9 against 22.9 ms for
// the AVX2 path's two 32-byte loads, 8 rows a block). Same arguments as `block`, x as is.
template <int R, int M>
inline void block512(const float* w, const float* x, const float* bias, float* y, int64_t K, int64_t N) {
  const int64_t whole = K / 16 * 16;
  __m512 acc[M][R];
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < whole; k += 16) {
    __m512 ws[R];
    for (int r = 0; r < R; r++) {
      runner_prefetch::prefetch_ahead(w + r * K + k, 64);
      ws[r] = _mm512_loadu_ps(w + r * K + k);
    }
    for (int m = 0; m < M; m++) {
      const __m512 xs = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < R; r++) acc[m][r] = _mm512_fmadd_ps(ws[r], xs, acc[m][r]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) {
      float sum = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[r] : 0.0f);
      for (int64_t k = whole; k < K; k++) sum += w[r * K + k] * x[m * K + k];
      y[m * N + r] = sum;
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RUNNER_DPBF16 1
// bfloat16 where the CPU has AVX-512 BF16: `vdpbf16ps` takes 32 weights and 32 of x (raw bfloat16) per instruction
// into 16 float sums, a quarter of the AVX2 path's instructions (measured: 12.0 against 15.7 ms for SmolLM2's
// weights at one row). Same arguments as `block`, x unsplit.
template <int R, int M>
inline void block_dp(const c10::BFloat16* w, const c10::BFloat16* x, const c10::BFloat16* bias, c10::BFloat16* y,
                     int64_t K, int64_t N) {
  const int64_t whole = K / 32 * 32;
  __m512 acc[M][R];
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < whole; k += 32) {
    __m512bh ws[R];
    for (int r = 0; r < R; r++) {
      runner_prefetch::prefetch_ahead(w + r * K + k, 64);
      ws[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
    for (int m = 0; m < M; m++) {
      const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], ws[r], xs);
    }
  }
  for (int m = 0; m < M; m++)
    for (int r = 0; r < R; r++) {
      float sum = _mm512_reduce_add_ps(acc[m][r]) + (bias ? static_cast<float>(bias[r]) : 0.0f);
      for (int64_t k = whole; k < K; k++) sum += static_cast<float>(w[r * K + k]) * static_cast<float>(x[m * K + k]);
      y[m * N + r] = static_cast<c10::BFloat16>(sum);
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RUNNER_AMX 1
// bfloat16 where the CPU has AMX: the weights are the tiles' left operand as they lie (16 rows of W, 32 of its
// columns: 16 rows of 64 bytes at W's row stride), x the right one, turned once per call into pairs of columns
// (VNNI: pair p holds x[m][2p], x[m][2p+1] for every row m), so one `tdpbf16ps` multiplies 1 KiB of weights by up
// to 16 rows of x into a 16 × M tile of float sums, and nothing is repacked. Two weight tiles share each x tile.
// Sums are float32 in the tile unit's order (per row of x, the same whatever M: a row's result does not depend on
// the others); denormal inputs count as zero (as `vdpbf16ps`). Linux lends a process the tile registers on
// request (arch_prctl); where it refuses, the vdpbf16ps path runs. On a 2-core Xeon with AMX, SmolLM2's weights
// at 16 rows: 16.6 ms against aten's 31.0 (its oneDNN product reads them at ~9 GB/s whatever the rows); at one
// row as fast as vdpbf16ps (benchmarks/linear_rows.py). Tried: four tiles a block of x (64 weight rows, 64 streams),
// prefetching the next block, two sums per block alternating: none faster.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// Whether a bfloat16 product of a [N,K] weight runs on the AMX path: whole tiles (K and N multiples of 32), the
// tiles granted.
bool amx_takes(int64_t K, int64_t N) { return K % 32 == 0 && N % 32 == 0 && amx_permitted(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: the sums of two blocks of 16 weight rows; tmm2, tmm3: their next 32 columns; tmm4: 16 column pairs ×
// M rows of x, shared by both.
inline void configure_tiles(int64_t M) {
  TileConfig config;
  for (int t = 0; t < 5; t++) config.rows[t] = 16, config.colsb[t] = t == 2 || t == 3 ? 64 : M * 4;
  _tile_loadconfig(&config);
}

// A tile of 16 × M float sums → y's columns [n, n + 16) of every row m, bias added, rounded to bfloat16 (to nearest
// even, as c10's conversion).
inline void store_sums(const float* sums, int64_t M, const c10::BFloat16* bias, c10::BFloat16* y, int64_t n,
                       int64_t N) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(M)));  // sums[i * M + m], i = 0..15
  const __m256i bias16 = bias ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + n)) : _mm256_setzero_si256();
  const __m512 add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bias16), 16));  // bf16 → float
  for (int64_t m = 0; m < M; m++) {
    const __m512 sum = _mm512_add_ps(_mm512_i32gather_ps(column, sums + m, 4), add);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + n), (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

// One product of a group on the AMX path: W [N,K], its bias [N] or null, its output y [M,N].
struct AmxProduct {
  const c10::BFloat16* w;
  const c10::BFloat16* bias;
  c10::BFloat16* y;
  int64_t N;
};

// y_i [M,N_i] = x [M,K] · W_iᵀ for the products of a group that read the same x (q, k, v; gate, up), M ≤ 16, K a
// multiple of 32, every N_i of 32: x turned into pairs once, and every product's blocks of 32 weight rows split
// between the threads in one parallel region. One region a group, not one a product: each region ends in a barrier
// where a thread waits for the other, and x is paired once. Qwen2.5-Coder-0.5B's products at 16 rows on a 2-core
// Xeon with AMX: 64.2 ms a product at a time, 61.5 grouped (benchmarks/linear_rows.py).
void product_amx(const std::vector<AmxProduct>& group, const c10::BFloat16* x, int64_t M, int64_t K) {
  const int64_t P = K / 2;  // column pairs: x as [M,P] 32-bit pairs, turned to [P,M]
  std::vector<uint32_t> pairs(P * M);
  const auto* x32 = reinterpret_cast<const uint32_t*>(x);
  for (int64_t m = 0; m < M; m++)
    for (int64_t p = 0; p < P; p++) pairs[p * M + m] = x32[m * P + p];
  std::vector<std::pair<const AmxProduct*, int64_t>> blocks;  // (product, its first weight row)
  for (const AmxProduct& product : group)
    for (int64_t n = 0; n < product.N; n += 32) blocks.emplace_back(&product, n);
  const int64_t count = static_cast<int64_t>(blocks.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    configure_tiles(M);
    alignas(64) float sums[16 * 16];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < count; b++) {
      const auto [product, n] = blocks[b];
      const c10::BFloat16* rows = product->w + n * K;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, pairs.data() + k / 2 * M, M * 4);
        _tile_loadd(2, rows + k, K * 2);
        _tile_loadd(3, rows + 16 * K + k, K * 2);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
      }
      _tile_stored(0, sums, M * 4);
      store_sums(sums, M, product->bias, product->y, n, product->N);
      _tile_stored(1, sums, M * 4);
      store_sums(sums, M, product->bias, product->y, n + 16, product->N);
    }
    _tile_release();
  }
}
#endif

// Rows per block: as many accumulators as fit in 16 registers beside the loads (AVX2 and vdpbf16ps).
template <int M>
constexpr int rows_per_block() { return M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1; }

// block512's: 4 rows of 64-byte loads (8 rows or 2 read no faster at one row of x), 16 accumulators at most.
template <int M>
constexpr int rows_per_block512() { return M <= 4 ? 4 : 2; }

// The rows of W in blocks of R, split between the threads; BLOCK is `block`, `block512` or `block_dp` (X: what it
// reads x as).
template <int M, int R, typename T, typename X, typename Block>
void product(Block block_of, const T* w, const X* x, const T* bias, T* y, int64_t N, int64_t K) {
  const int64_t blocks = N / R;
#pragma omp parallel for num_threads(at::get_num_threads()) schedule(static)
  for (int64_t i = 0; i < blocks; i++)
    block_of(std::integral_constant<int, R>{}, w + i * R * K, x, bias ? bias + i * R : nullptr, y + i * R);
  for (int64_t n = blocks * R; n < N; n++)
    block_of(std::integral_constant<int, 1>{}, w + n * K, x, bias ? bias + n : nullptr, y + n);
}

// f(std::integral_constant<int, M>) for M = 1..MAX_ROWS: the row count as a template constant.
template <typename F>
void with_rows(int64_t M, F f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// `widest`: bfloat16 on vdpbf16ps and float32 on 64-byte loads where the CPU has them (else the AVX2 path).
template <typename T>
void linear_rows_typed(const at::Tensor& x, const T* w, const T* bias, at::Tensor& y, int64_t N, bool widest) {
  const int64_t M = x.size(0), K = x.size(1);
  T* out = y.data_ptr<T>();
#ifdef RUNNER_AMX
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (widest && amx_takes(K, N)) return product_amx({{w, bias, out, N}}, x.data_ptr<T>(), M, K);
  }
#endif
  if (M > PATH_ROWS) {
    for (int64_t start = 0; start < M; start += PATH_ROWS) {
      at::Tensor part = y.narrow(0, start, std::min(PATH_ROWS, M - start));
      linear_rows_typed<T>(x.narrow(0, start, part.size(0)), w, bias, part, N, widest);
    }
    return;
  }
#ifdef RUNNER_DPBF16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (widest) {
      return with_rows(M, [&](auto rows) {
        constexpr int m = decltype(rows)::value;
        const auto block_of = [K, N](auto r, const T* w, const T* x, const T* bias, T* y) {
          block_dp<decltype(r)::value, m>(w, x, bias, y, K, N);
        };
        product<m, rows_per_block<m>()>(block_of, w, x.data_ptr<T>(), bias, out, N, K);
      });
    }
  }
#endif
#ifdef RUNNER_AVX512
  if constexpr (std::is_same_v<T, float>) {
    if (widest) {
      return with_rows(M, [&](auto rows) {
        constexpr int m = decltype(rows)::value;
        const auto block_of = [K, N](auto r, const float* w, const float* x, const float* bias, float* y) {
          block512<decltype(r)::value, m>(w, x, bias, y, K, N);
        };
        product<m, rows_per_block512<m>()>(block_of, w, x.data_ptr<float>(), bias, out, N, K);
      });
    }
  }
#endif
  const std::vector<float> xs = split_rows(x.data_ptr<T>(), M, K);
  with_rows(M, [&](auto rows) {
    constexpr int m = decltype(rows)::value;
    const auto block_of = [K, N](auto r, const T* w, const float* x, const T* bias, T* y) {
      block<decltype(r)::value, m>(w, x, bias, y, K, N);
    };
    product<m, rows_per_block<m>()>(block_of, w, xs.data(), bias, out, N, K);
  });
}

// What linear_rows asks of x [M,K], one weight wt [K,N] and its bias.
void check_product(const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && x.size(1) == wt.size(0), "linear_rows: x [M,K] and wt [K,N]");
  const int64_t M = x.size(0), K = x.size(1), N = wt.size(1);
  TORCH_CHECK(M >= 1 && M <= MAX_ROWS, "linear_rows: 1 to ", MAX_ROWS, " rows, got ", M);
  TORCH_CHECK(wt.stride(0) == 1 && (wt.stride(1) == K || N == 1), "linear_rows: wt must be a row-major W [N,K], seen "
              "transposed (strides (1, K))");
  TORCH_CHECK(x.scalar_type() == wt.scalar_type(), "linear_rows: x and the weight differ in dtype");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                        bias->scalar_type() == x.scalar_type()), "linear_rows: bias must be [N] in x's dtype");
}

// x [M,K]; wt [K,N] = W [N,K] (row-major, as an nn.Linear stores it) transposed, as aten's mm receives it.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias,
                       bool widest) {
  check_product(x, wt, bias);
  const int64_t M = x.size(0), N = wt.size(1);
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    linear_rows_typed<float>(rows, wt.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr, y, N, widest);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_rows: float32 or bfloat16, got ", x.scalar_type());
    using B = c10::BFloat16;
    linear_rows_typed<B>(rows, wt.data_ptr<B>(), bias ? bias->data_ptr<B>() : nullptr, y, N, widest);
  }
  return y;
}

// Whether a bfloat16 product of a [N,K] weight runs on the AMX path here (compiled for it: `amx_takes`).
bool amx(int64_t K, int64_t N) {
#ifdef RUNNER_AMX
  return amx_takes(K, N);
#else
  return false;
#endif
}

// x [M,K] through the products of a group that read it (q, k, v; gate, up) → their outputs, each as linear_rows
// gives it: on the AMX path in one parallel region (`product_amx`), elsewhere one linear_rows call a product.
std::vector<at::Tensor> linear_rows_group(const at::Tensor& x, at::TensorList wts,
                                          const c10::List<std::optional<at::Tensor>>& biases, bool widest) {
  TORCH_CHECK(biases.size() == wts.size(), "linear_rows_group: one bias (or None) a weight");
  bool tiles = widest && x.scalar_type() == at::kBFloat16;
  for (size_t i = 0; i < wts.size(); i++) {
    check_product(x, wts[i], biases.get(i));
    tiles = tiles && amx(x.size(1), wts[i].size(1));
  }
  std::vector<at::Tensor> out;
  if (!tiles) {
    for (size_t i = 0; i < wts.size(); i++) out.push_back(linear_rows(x, wts[i], biases.get(i), widest));
    return out;
  }
#ifdef RUNNER_AMX
  using B = c10::BFloat16;
  const at::Tensor rows = x.contiguous();
  std::vector<AmxProduct> group;
  for (size_t i = 0; i < wts.size(); i++) {
    const int64_t N = wts[i].size(1);
    out.push_back(at::empty({x.size(0), N}, x.options()));
    const std::optional<at::Tensor> bias = biases.get(i);
    group.push_back({wts[i].data_ptr<B>(), bias ? bias->data_ptr<B>() : nullptr, out.back().data_ptr<B>(), N});
  }
  product_amx(group, rows.data_ptr<B>(), x.size(0), x.size(1));
#endif
  return out;
}

bool vectorized() {
#ifdef RUNNER_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("linear_rows(Tensor x, Tensor wt, Tensor? bias, bool widest=True) -> Tensor");
  m.def("linear_rows_group(Tensor x, Tensor[] wts, Tensor?[] biases, bool widest=True) -> Tensor[]");
  m.def("linear_rows_vectorized() -> bool", &vectorized);
  m.def("linear_rows_amx(int K, int N) -> bool", &amx);
}

TORCH_LIBRARY_IMPL(runner, CPU, m) {
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_group", &linear_rows_group);
}
