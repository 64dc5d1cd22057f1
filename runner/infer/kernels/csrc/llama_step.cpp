// One decode step of a llama-family model (llama, qwen2) in C++: every layer's norms, products, rotary embedding,
// cache write and attention, for a few rows of one new token each (and, in a mixed step, a joining prompt's tokens
// as extra rows), without Python between them. Registered as the torch op runner::llama_step (native.py builds it;
// runner/infer/compiled/native_step.py hands it a model's tensors and decides where it serves).
//
// Why: the compiled engine's step is inductor's graph driven by its Python wrapper, about 40 statements a layer. At
// batch 1 on 2 cores that wrapper and dynamo's entry cost 3–4 ms of SmolLM2's step (24 ms in float32, 7 ms on
// 4-bit GGUF weights), which is what llama.cpp, whose products read at the same rate as ours, does not spend.
// Here the products are runner's own ops (linear_rows, gguf_rows and their _group forms: called through the
// dispatcher from C++, about a microsecond each), attention is decode_attention.cpp's kernel called directly, and
// everything between them is a vectorized loop that reads and writes the model's dtype and computes in float32.
//
// Arithmetic: as the compiled step's, up to the order of float sums. Elementwise work runs in float32 and is
// rounded to the model's dtype where the model's own forward stores a tensor of that dtype (norm outputs, the
// residual stream, q/k after rotation, the MLP's activation), as inductor does with emulate_precision_casts.
//
// Inputs (shapes: B rows, E hidden, H query heads, Hkv KV heads, D head dim, S cache columns, V vocabulary):
//   hidden  [B,E] the embedded tokens, in the model's dtype (float32 or bfloat16)
//   tensors PER_LAYER a layer (LAYER_TENSORS' order), then the final norm and the head; a float product's weight
//           is W [N,K] seen transposed ([K,N], strides (1,K)), a GGUF product's its blocks [N, row bytes]; biases
//           (q, k, v) may be None
//   codes   PRODUCTS a layer, then the head's: -1 float (runner::linear_rows), else ggml type | interleaved << 8
//   caches  2 a layer: K and V [B,Hkv,S,D] in fp32 / fp16 / bf16, written at `column`
//   mask    [B,S] bool: the columns each row attends to (its own new one included, and its extra tokens')
//   cos/sin [N,D] float32: the rotary embedding at each token's position (the model's rotary module's)
//   dims    layers, H, Hkv, D, column, most rows of a float product on linear_rows (more: aten's mm)
//   extra   [P,2] int64 or None: (row, column) of P more tokens after the B rows' (hidden [N,E], N = B + P), a
//           joining prompt's but its last, whose last is its row's token at `column` (a mixed step: the prompt's
//           products share the decode rows' weight reads). A row's extra tokens are consecutive, in ascending
//           columns, each attending causally to its row's masked columns up to its own (aten's sdpa).
// → logits [B,V] in the head's output dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "decode_attention.h"

namespace {

enum LayerTensor { LN1, Q, K, V, O, LN2, GATE, UP, DOWN, BQ, BK, BV, PER_LAYER };
constexpr int PRODUCTS = 7;  // q, k, v, o, gate, up, down: their codes' order
constexpr int64_t FLOAT_PRODUCT = -1, INTERLEAVED = 256;

// --- products: runner's ops through the dispatcher ---------------------------------------------------------------

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias,
                       int64_t max_rows) {
  if (x.size(0) > max_rows) return bias ? at::addmm(*bias, x, wt) : at::mm(x, wt);  // a prompt's rows: oneDNN
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("runner::linear_rows", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool)>();
  return op.call(x, wt, bias, true);
}

// A group of float products that read the same x, of at most max_rows rows: runner::linear_rows_group.
std::vector<at::Tensor> linear_rows_group(const at::Tensor& x, const std::vector<at::Tensor>& wts,
                                          const c10::List<std::optional<at::Tensor>>& biases) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("runner::linear_rows_group", "").typed<
      std::vector<at::Tensor>(const at::Tensor&, at::TensorList, const c10::List<std::optional<at::Tensor>>&, bool)>();
  return op.call(x, wts, biases, true);
}

at::Tensor gguf_rows(const at::Tensor& x, const at::Tensor& blocks, int64_t code) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("runner::gguf_rows", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, bool)>();
  return op.call(x, blocks, code % INTERLEAVED, 0, code >= INTERLEAVED);
}

std::vector<at::Tensor> gguf_rows_group(const at::Tensor& x, at::TensorList blocks, int64_t code) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("runner::gguf_rows_group", "").typed<
      std::vector<at::Tensor>(const at::Tensor&, at::TensorList, int64_t, int64_t, bool)>();
  return op.call(x, blocks, code % INTERLEAVED, 0, code >= INTERLEAVED);
}

// x [B,K] through n products that read it (q, k, v or gate, up) → their outputs [B,N_i]; GGUF weights of one type
// (and layout) in one call (x quantized once, one parallel region), as the compiled step's pass groups them, and
// float weights of linear_rows' rows in one call too. A bias is added in the float product, or after a GGUF one.
std::vector<at::Tensor> products(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                                 const int64_t* which, const int64_t* biases, const int64_t* codes, int n,
                                 int64_t max_rows) {
  const auto bias = [&](int i) { return biases ? tensors.get(biases[i]) : std::nullopt; };
  std::vector<at::Tensor> out;
  bool grouped = n > 1 && (codes[0] != FLOAT_PRODUCT || x.size(0) <= max_rows);
  for (int i = 1; i < n; i++) grouped = grouped && codes[i] == codes[0];
  if (grouped && codes[0] == FLOAT_PRODUCT) {
    std::vector<at::Tensor> wts;
    c10::List<std::optional<at::Tensor>> given;
    for (int i = 0; i < n; i++) wts.push_back(*tensors.get(which[i])), given.push_back(bias(i));
    out = linear_rows_group(x, wts, given);
  } else if (grouped) {
    std::vector<at::Tensor> blocks;
    for (int i = 0; i < n; i++) blocks.push_back(*tensors.get(which[i]));
    out = gguf_rows_group(x, blocks, codes[0]);
  } else {
    for (int i = 0; i < n; i++) {
      const at::Tensor w = *tensors.get(which[i]);
      out.push_back(codes[i] == FLOAT_PRODUCT ? linear_rows(x, w, bias(i), max_rows) : gguf_rows(x, w, codes[i]));
    }
  }
  for (int i = 0; i < n; i++)
    if (codes[i] != FLOAT_PRODUCT && bias(i)) out[i].add_(*bias(i));
  return out;
}

// --- elementwise, in float32 -------------------------------------------------------------------------------------

// e^x in float32 without a branch or a call, so that `omp simd` loops vectorize it (std::exp is a libm call per
// value: at 16 rows the softmax and SiLU loops spent more than the products of a small model's layer). Cephes'
// expf: x = n·ln 2 + r with ln 2 in two parts, |r| ≤ ln 2 / 2, e^r by a degree-7 polynomial, 2^n through the
// exponent bits; within 2 ulp of e^x, 0 below x = -87.3 (a masked score's -inf), e^88.3 above 88.3.
inline float exp_of(float in) {
  const float x = std::min(std::max(in, -87.3f), 88.3f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5·2²³)
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return in < -87.3f ? 0.0f : p * scale;
}

// v rounded to the nearest bfloat16 (ties to even), as a float; branch-free, so loops of it vectorize. NaN is not
// kept apart (none reaches here); ±inf stay.
inline float to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// Activations are read and written in the model's dtype T (float or c10::BFloat16) by the loops below, arithmetic in
// float32: no float32 copies of a step's activations (at thousands of a prompt's tokens, aten's conversions and the
// page faults of their fresh buffers cost more than the loops themselves). Only the residual stream is float32.
template <typename T>
constexpr bool is_bf16 = std::is_same_v<T, c10::BFloat16>;

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// v already rounded to T (`rounded`), so storing it is exact.
inline void store(float* at, float v) { *at = v; }
inline void store(c10::BFloat16* at, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  at->x = static_cast<uint16_t>(u >> 16);
}

template <typename T>
inline float rounded(float v) { return is_bf16<T> ? to_bf16(v) : v; }

// h += added (T), rounded to T (the residual stream, float32 [N,E]).
template <typename T>
void add_rounded(at::Tensor& h, const at::Tensor& added) {
  float* x = h.data_ptr<float>();
  const T* y = added.const_data_ptr<T>();
  at::parallel_for(0, h.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; i++) x[i] = rounded<T>(x[i] + load(y[i]));
  });
}

// The model's RMSNorm (llama's and qwen2's): x·rsqrt(mean(x²) + eps) in float32, rounded to T, times the weight,
// rounded again. h [N,E] float32 → [N,E] T.
template <typename T>
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps, const at::TensorOptions& options) {
  const int64_t N = h.size(0), E = h.size(1);
  at::Tensor out = at::empty({N, E}, options);
  const float* in = h.const_data_ptr<float>();
  const T* w = weight.const_data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      const float* x = in + b * E;
      float squares = 0;
#pragma omp simd reduction(+ : squares)
      for (int64_t e = 0; e < E; e++) squares += x[e] * x[e];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(E) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t e = 0; e < E; e++) store(o + b * E + e, rounded<T>(load(w[e]) * rounded<T>(x[e] * scale)));
    }
  });
  return out;
}

// HF's rotate_half rotation, in place on x [N, heads·D] (T): x·cos + rotate_half(x)·sin per head, rounded to T.
template <typename T>
void rotate(at::Tensor& x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  TORCH_CHECK(x.is_contiguous(), "llama_step: a product's output is not contiguous");
  const int64_t half = D / 2, N = x.size(0);
  T* data = x.data_ptr<T>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> head(D);
    for (int64_t b = begin; b < end; b++)
      for (int64_t h = 0; h < heads; h++) {
        T* v = data + (b * heads + h) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) head[d] = load(v[d]);
        const float* c = cos + b * D;
        const float* s = sin + b * D;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) store(v + d, rounded<T>(head[d] * c[d] - head[d + half] * s[d]));
#pragma omp simd
        for (int64_t d = half; d < D; d++) store(v + d, rounded<T>(head[d] * c[d] + head[d - half] * s[d]));
      }
  });
}

// The MLP's activation SiLU(gate)·up, each rounded to T: [N,F] T → [N,F] T. In blocks through a float32 buffer, in
// two loops: gcc 12 does not vectorize `rounded(rounded(silu(g)) * u)` in one.
template <typename T>
at::Tensor silu_times(const at::Tensor& gate, const at::Tensor& up) {
  constexpr int64_t BLOCK = 1024;
  at::Tensor act = at::empty_like(gate);
  const T* g = gate.const_data_ptr<T>();
  const T* u = up.const_data_ptr<T>();
  T* a = act.data_ptr<T>();
  at::parallel_for(0, act.numel(), 4 * BLOCK, [&](int64_t begin, int64_t end) {
    float values[BLOCK];
    for (int64_t first = begin; first < end; first += BLOCK) {
      const int64_t n = std::min(BLOCK, end - first);
#pragma omp simd
      for (int64_t i = 0; i < n; i++) {
        const float x = load(g[first + i]);
        values[i] = rounded<T>(x / (1.0f + exp_of(-x)));
      }
#pragma omp simd
      for (int64_t i = 0; i < n; i++) store(a + first + i, rounded<T>(values[i] * load(u[first + i])));
    }
  });
  return act;
}

// K or V [N, Hkv·D] (T) of N tokens into a [B,Hkv,S,D] cache in its storage dtype: token i at row rows[i], column
// columns[i].
template <typename T>
void write_tokens(const at::Tensor& x, at::Tensor& cache, const std::vector<int64_t>& rows,
                  const std::vector<int64_t>& columns) {
  const int64_t H = cache.size(1), S = cache.size(2), D = cache.size(3), N = static_cast<int64_t>(rows.size());
  const T* data = x.const_data_ptr<T>();
  const auto write = [&](auto* to) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++)
        for (int64_t h = 0; h < H; h++) {
          const T* from = data + (i * H + h) * D;
          auto* at = to + ((rows[i] * H + h) * S + columns[i]) * D;
          for (int64_t d = 0; d < D; d++) at[d] = static_cast<std::remove_reference_t<decltype(*at)>>(load(from[d]));
        }
    });
  };
  switch (cache.scalar_type()) {
    case at::kFloat: write(cache.data_ptr<float>()); break;
    case at::kHalf: write(cache.data_ptr<c10::Half>()); break;
    default: write(cache.data_ptr<c10::BFloat16>());
  }
}

// decode_attention.cpp's Segment for a whole plain cache: columns [0, limit).
Segment plain_segment(const at::Tensor& cache) {
  Segment g{};
  Store& s = g.store;
  s.format = cache.scalar_type() == at::kFloat ? F32 : cache.scalar_type() == at::kHalf ? F16 : BF16;
  s.dim = cache.size(3);
  s.codes = static_cast<const uint8_t*>(cache.const_data_ptr());
  s.codes_bh = cache.size(2) * cache.size(3) * cache.element_size();
  s.group_shift = s.chunk_shift = -1;
  g.stop_plus_limit = 1;
  return g;
}

// One query per row: q [B, H·D] float32 over the cache's columns [0, limit) → out [B, H·D] float32, query heads
// grouped on their KV head (G = H / Hkv), softmax in float32.
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask, int64_t B,
            int64_t H, int64_t limit, double scaling, at::Tensor& out) {
  const int64_t Hkv = keys.size(1), S = keys.size(2), G = H / Hkv;
  const Segment k = plain_segment(keys), v = plain_segment(values);
  const std::unique_ptr<float[]> scores(new float[B * H * S]);  // not zeroed: runner_scores fills every column
  const int threads = at::get_num_threads();
  runner_scores(&k, 1, q.const_data_ptr<float>(), static_cast<const uint8_t*>(mask.const_data_ptr()), mask.stride(0),
                scores.get(), B, Hkv, G, S, limit, static_cast<float>(scaling), threads);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      float* p = scores.get() + r * S;
      float top = -INFINITY, sum = 0;
#pragma omp simd reduction(max : top)
      for (int64_t s = 0; s < limit; s++) top = std::max(top, p[s]);
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < limit; s++) sum += (p[s] = exp_of(p[s] - top));
      const float inverse = 1.0f / sum;
#pragma omp simd
      for (int64_t s = 0; s < limit; s++) p[s] *= inverse;
    }
  });
  runner_weighted(&v, 1, 1, scores.get(), out.data_ptr<float>(), B, Hkv, G, S, limit, threads);
}

// A run of extra tokens of one row: tokens [first, last) of the extra ones, reading the row's columns
// [start, stop) where `allowed` [n, stop − start] (each token its row's masked columns up to its own: causal), or
// with `allowed` undefined where that is sdpa's own causal mask: the run fills the whole window, nothing masked in
// it (a prompt with no cached prefix), so sdpa skips the blocks above the diagonal and builds no mask.
struct Run {
  int64_t first, last, row, start, stop;
  at::Tensor allowed;
};

std::vector<Run> runs_of(const at::Tensor& mask, const std::vector<int64_t>& rows, const std::vector<int64_t>& columns) {
  std::vector<Run> runs;
  const int64_t P = static_cast<int64_t>(rows.size());
  for (int64_t first = 0, last = 0; first < P; first = last) {
    while (last < P && rows[last] == rows[first]) last++;
    const int64_t row = rows[first], stop = columns[last - 1] + 1;
    const at::Tensor seen = mask.select(0, row).slice(0, 0, stop);  // [stop]
    const int64_t start = seen.to(at::kByte).argmax().item<int64_t>();  // the row's first masked column
    const at::Tensor window = seen.slice(0, start, stop);  // [w]
    if (stop - start == last - first && window.all().item<bool>()) {
      runs.push_back({first, last, row, start, stop, at::Tensor()});
      continue;
    }
    const at::Tensor own = at::arange(start, stop, at::TensorOptions().dtype(at::kLong));  // [w]
    const at::Tensor at_most = at::from_blob(const_cast<int64_t*>(columns.data() + first), {last - first, 1},
                                             at::TensorOptions().dtype(at::kLong));  // [n,1]
    runs.push_back({first, last, row, start, stop, window.unsqueeze(0).logical_and(own.unsqueeze(0).le(at_most))});
  }
  return runs;
}

// The extra tokens' attention: q's rows [B, N) (the model's dtype) → out's, a run at a time on aten's sdpa
// (grouped heads).
void attend_extra(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const std::vector<Run>& runs,
                  int64_t B, int64_t H, double scaling, at::Tensor& out) {
  const int64_t D = keys.size(3);
  for (const Run& run : runs) {
    const int64_t n = run.last - run.first;
    const at::Tensor query = q.slice(0, B + run.first, B + run.last).view({1, n, H, D}).transpose(1, 2);  // [1,H,n,D]
    const auto side = [&](const at::Tensor& cache) {  // [1,Hkv,w,D] in the query's dtype
      return cache.select(0, run.row).slice(1, run.start, run.stop).unsqueeze(0).to(q.scalar_type());
    };
    const bool causal = !run.allowed.defined();
    const at::Tensor result = at::scaled_dot_product_attention(
        query, side(keys), side(values), causal ? std::nullopt : std::optional<at::Tensor>(run.allowed), 0.0, causal,
        scaling, true);  // [1,H,n,D]
    out.slice(0, B + run.first, B + run.last).copy_(result.transpose(1, 2).reshape({n, H * D}));
  }
}

template <typename T>
at::Tensor step(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& tensors,
                      at::IntArrayRef codes, at::TensorList caches, const at::Tensor& mask, const at::Tensor& cos,
                      const at::Tensor& sin, at::IntArrayRef dims, double eps, double scaling,
                      const std::optional<at::Tensor>& extra) {
  TORCH_CHECK(dims.size() == 6, "llama_step: dims are layers, heads, KV heads, head dim, column, max rows");
  const int64_t layers = dims[0], H = dims[1], Hkv = dims[2], D = dims[3], column = dims[4], max_rows = dims[5];
  const int64_t N = hidden.size(0), B = mask.size(0), P = N - B;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * PER_LAYER + 2 &&
              static_cast<int64_t>(codes.size()) == layers * PRODUCTS + 1 &&
              static_cast<int64_t>(caches.size()) == 2 * layers, "llama_step: ", tensors.size(), " tensors, ",
              codes.size(), " codes and ", caches.size(), " caches for ", layers, " layers");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous(), "llama_step: mask [B,S] contiguous");
  TORCH_CHECK(P == (extra ? extra->size(0) : 0), "llama_step: hidden has ", N, " tokens for ", B, " rows and ",
              extra ? extra->size(0) : 0, " extra tokens");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == N * D,
              "llama_step: cos and sin [N,D] float32");
  for (const at::Tensor& c : caches)
    TORCH_CHECK(c.is_contiguous() && c.size(0) == B && c.size(1) == Hkv && c.size(3) == D && column < c.size(2),
                "llama_step: caches [B,Hkv,S,D] contiguous, the column inside");
  std::vector<int64_t> rows(N), columns(N, column);  // each token's place: the B rows' at `column`, then the extra
  for (int64_t b = 0; b < B; b++) rows[b] = b;
  if (P) {
    TORCH_CHECK(extra->scalar_type() == at::kLong && extra->dim() == 2 && extra->size(1) == 2,
                "llama_step: extra [P,2] int64");
    const at::Tensor places = extra->contiguous();
    const int64_t* e = places.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < P; i++) {
      rows[B + i] = e[2 * i], columns[B + i] = e[2 * i + 1];
      TORCH_CHECK(rows[B + i] >= 0 && rows[B + i] < B && columns[B + i] >= 0 && columns[B + i] < column,
                  "llama_step: an extra token's row or column is outside the cache, or not left of `column`");
    }
  }
  const std::vector<int64_t> extra_columns(columns.begin() + B, columns.end());
  const std::vector<Run> runs = runs_of(mask, std::vector<int64_t>(rows.begin() + B, rows.end()), extra_columns);
  const at::TensorOptions options = hidden.options();
  at::Tensor h = hidden.to(at::kFloat, false, true).contiguous();  // the residual stream [N,E], a copy
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  at::Tensor attention = at::empty({N, H * D}, options);  // every layer's, in T
  at::Tensor rows_attention = at::empty({B, H * D}, at::TensorOptions().dtype(at::kFloat));  // the B rows' first
  for (int64_t l = 0; l < layers; l++) {
    const int64_t at = l * PER_LAYER;
    const int64_t* code = codes.data() + l * PRODUCTS;
    const at::Tensor x = rms_norm<T>(h, *tensors.get(at + LN1), eps, options);
    const int64_t qkv[3] = {at + Q, at + K, at + V}, biases[3] = {at + BQ, at + BK, at + BV};
    std::vector<at::Tensor> out = products(x, tensors, qkv, biases, code, 3, max_rows);  // q, k, v [N,·] in T
    rotate<T>(out[0], H, D, c, s);
    rotate<T>(out[1], Hkv, D, c, s);
    at::Tensor keys = caches[2 * l], values = caches[2 * l + 1];
    write_tokens<T>(out[1], keys, rows, columns);
    write_tokens<T>(out[2], values, rows, columns);
    attend(out[0].slice(0, 0, B).to(at::kFloat).contiguous(), keys, values, mask, B, H, column + 1, scaling,
           rows_attention);
    attention.slice(0, 0, B).copy_(rows_attention);  // rounded to T, as the model's attention output is
    // After the last layer only the B rows are read (the head): its attention, o and MLP run for them alone, the
    // extra tokens' K and V written above (a 2,064-token mixed step of Qwen2.5-Coder-0.5B: 1/24 of its products).
    const int64_t M = l == layers - 1 ? B : N;
    if (P && M == N) attend_extra(out[0], keys, values, runs, B, H, scaling, attention);
    at::Tensor read = h.slice(0, 0, M);  // the residual stream's rows read on: its first M, added to in place
    const int64_t o = at + O;
    add_rounded<T>(read, products(attention.slice(0, 0, M), tensors, &o, nullptr, code + 3, 1, max_rows)[0]);
    const at::Tensor y = rms_norm<T>(read, *tensors.get(at + LN2), eps, options);
    const int64_t gate_up[2] = {at + GATE, at + UP};
    const std::vector<at::Tensor> mlp = products(y, tensors, gate_up, nullptr, code + 4, 2, max_rows);
    const int64_t down = at + DOWN;
    add_rounded<T>(read, products(silu_times<T>(mlp[0], mlp[1]), tensors, &down, nullptr, code + 6, 1, max_rows)[0]);
  }
  const int64_t head = layers * PER_LAYER + 1;  // the head reads the B rows only
  const at::Tensor x = rms_norm<T>(h.slice(0, 0, B), *tensors.get(head - 1), eps, options);
  return products(x, tensors, &head, nullptr, codes.data() + layers * PRODUCTS, 1, max_rows)[0];
}

at::Tensor llama_step(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& tensors,
                      at::IntArrayRef codes, at::TensorList caches, const at::Tensor& mask, const at::Tensor& cos,
                      const at::Tensor& sin, at::IntArrayRef dims, double eps, double scaling,
                      const std::optional<at::Tensor>& extra) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16,
              "llama_step: hidden in float32 or bfloat16");
  return (hidden.scalar_type() == at::kBFloat16 ? step<c10::BFloat16> : step<float>)(
      hidden, tensors, codes, caches, mask, cos, sin, dims, eps, scaling, extra);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("llama_step(Tensor hidden, Tensor?[] tensors, int[] codes, Tensor[] caches, Tensor mask, Tensor cos, "
        "Tensor sin, int[] dims, float eps, float scaling, Tensor? extra=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) { m.impl("llama_step", &llama_step); }
