// One decode step of a llama-family model (llama, qwen2) in C++: every layer's norms, products, rotary embedding,
// cache write and attention, for a few rows of one new token each (and, in a mixed step, a joining prompt's tokens
// as extra rows), without Python between them. Registered as the torch op runner::llama_step (native.py builds it;
// runner/infer/compiled/native_step.py hands it a model's tensors and decides where it serves).
//
// Why: the compiled engine's step is inductor's graph driven by its Python wrapper, about 40 statements a layer. At
// batch 1 on 2 cores that wrapper and dynamo's entry cost 3–4 ms of SmolLM2's step (24 ms in float32, 7 ms on
// 4-bit GGUF weights), which is what llama.cpp, whose products read at the same rate as ours, does not spend.
// Here the products are runner's own ops (linear_rows, gguf_rows, gguf_rows_group: called through the dispatcher
// from C++, about a microsecond each), attention is decode_attention.cpp's kernel called directly, and everything
// between them is a vectorized loop over float32 tensors (aten converts to and from the model's dtype).
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
// (and layout) in one call (x quantized once, one parallel region), as the compiled step's pass groups them.
// A bias is added in the float product, or after a GGUF one.
std::vector<at::Tensor> products(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& tensors,
                                 const int64_t* which, const int64_t* biases, const int64_t* codes, int n,
                                 int64_t max_rows) {
  const auto bias = [&](int i) { return biases ? tensors.get(biases[i]) : std::nullopt; };
  std::vector<at::Tensor> out;
  bool grouped = n > 1 && codes[0] != FLOAT_PRODUCT;
  for (int i = 1; i < n; i++) grouped = grouped && codes[i] == codes[0];
  if (grouped) {
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

inline float rounded(float v, bool bf16) { return bf16 ? to_bf16(v) : v; }

// Every tensor of floats below is float32, contiguous, [rows, values]: aten converts to and from the model's dtype
// (vectorized, in parallel), the loops here read and write its data.
at::Tensor floats(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// floats → the model's dtype (values already representable in it).
at::Tensor tensor_of(const at::Tensor& v, const at::TensorOptions& like) { return v.to(like.dtype()); }

// h += added, rounded to the dtype (the residual stream).
void add_rounded(at::Tensor& h, const at::Tensor& added, bool bf16) {
  float* x = h.data_ptr<float>();
  const float* y = added.const_data_ptr<float>();
  at::parallel_for(0, h.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; i++) x[i] = rounded(x[i] + y[i], bf16);
  });
}

// The model's RMSNorm (llama's and qwen2's): x·rsqrt(mean(x²) + eps) in float32, rounded to the dtype, times the
// weight, rounded again. h [N,E] floats → [N,E] floats.
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& weight, double eps, bool bf16) {
  const at::Tensor w = floats(weight);
  const int64_t N = h.size(0), E = h.size(1);
  at::Tensor out = at::empty_like(h);
  const float* in = h.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) {
      const float* x = in + b * E;
      float squares = 0;
#pragma omp simd reduction(+ : squares)
      for (int64_t e = 0; e < E; e++) squares += x[e] * x[e];
      const float scale = 1.0f / std::sqrt(squares / static_cast<float>(E) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t e = 0; e < E; e++) o[b * E + e] = rounded(wp[e] * rounded(x[e] * scale, bf16), bf16);
    }
  });
  return out;
}

// HF's rotate_half rotation, in place: x [N, heads·D] ← x·cos + rotate_half(x)·sin, per head.
void rotate(at::Tensor& x, int64_t heads, int64_t D, const float* cos, const float* sin, bool bf16) {
  const int64_t half = D / 2, N = x.size(0);
  float* data = x.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> head(D);
    for (int64_t b = begin; b < end; b++)
      for (int64_t h = 0; h < heads; h++) {
        float* v = data + (b * heads + h) * D;
        std::copy_n(v, D, head.begin());
        const float* c = cos + b * D;
        const float* s = sin + b * D;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) v[d] = rounded(head[d] * c[d] - head[d + half] * s[d], bf16);
#pragma omp simd
        for (int64_t d = half; d < D; d++) v[d] = rounded(head[d] * c[d] + head[d - half] * s[d], bf16);
      }
  });
}

// K or V [N, Hkv·D] floats of N tokens into a [B,Hkv,S,D] cache in its storage dtype: token i at row rows[i],
// column columns[i].
void write_tokens(const at::Tensor& x, at::Tensor& cache, const std::vector<int64_t>& rows,
                  const std::vector<int64_t>& columns) {
  const int64_t H = cache.size(1), S = cache.size(2), D = cache.size(3), N = static_cast<int64_t>(rows.size());
  const float* data = x.const_data_ptr<float>();
  const auto write = [&](auto* to) {
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i++)
        for (int64_t h = 0; h < H; h++) {
          const float* from = data + (i * H + h) * D;
          auto* at = to + ((rows[i] * H + h) * S + columns[i]) * D;
          for (int64_t d = 0; d < D; d++) at[d] = static_cast<std::remove_reference_t<decltype(*at)>>(from[d]);
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

// One query per row: q's first B rows [B, H·D] floats over the cache's columns [0, limit) → out's first B rows,
// query heads grouped on their KV head (G = H / Hkv), softmax in float32.
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& mask, int64_t B,
            int64_t H, int64_t limit, double scaling, at::Tensor& out) {
  const int64_t Hkv = keys.size(1), S = keys.size(2), G = H / Hkv;
  const Segment k = plain_segment(keys), v = plain_segment(values);
  std::vector<float> scores(B * H * S);
  const int threads = at::get_num_threads();
  runner_scores(&k, 1, q.const_data_ptr<float>(), static_cast<const uint8_t*>(mask.const_data_ptr()), mask.stride(0), scores.data(),
                B, Hkv, G, S, limit, static_cast<float>(scaling), threads);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      float* p = scores.data() + r * S;
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
  runner_weighted(&v, 1, 1, scores.data(), out.data_ptr<float>(), B, Hkv, G, S, limit, threads);
}

// A run of extra tokens of one row: tokens [first, last) of the extra ones, reading the row's columns
// [start, stop) where `allowed` [n, stop − start] (each token its row's masked columns up to its own: causal).
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
    const at::Tensor own = at::arange(start, stop, at::TensorOptions().dtype(at::kLong));  // [w]
    const at::Tensor at_most = at::from_blob(const_cast<int64_t*>(columns.data() + first), {last - first, 1},
                                             at::TensorOptions().dtype(at::kLong));  // [n,1]
    runs.push_back({first, last, row, start, stop,
                    seen.slice(0, start, stop).unsqueeze(0).logical_and(own.unsqueeze(0).le(at_most))});  // [n,w]
  }
  return runs;
}

// The extra tokens' attention: q's rows [B, N) → out's, a run at a time on aten's sdpa (grouped heads).
void attend_extra(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const std::vector<Run>& runs,
                  int64_t B, int64_t H, double scaling, const at::TensorOptions& options, at::Tensor& out) {
  const int64_t D = keys.size(3);
  for (const Run& run : runs) {
    const int64_t n = run.last - run.first;
    const at::Tensor query = tensor_of(q.slice(0, B + run.first, B + run.last), options).view({1, n, H, D})
                                 .transpose(1, 2);  // [1,H,n,D]
    const auto side = [&](const at::Tensor& cache) {  // [1,Hkv,w,D] in the query's dtype
      return cache.select(0, run.row).slice(1, run.start, run.stop).unsqueeze(0).to(options.dtype());
    };
    const at::Tensor result = at::scaled_dot_product_attention(query, side(keys), side(values), run.allowed, 0.0,
                                                               false, scaling, true);  // [1,H,n,D]
    out.slice(0, B + run.first, B + run.last).copy_(result.transpose(1, 2).reshape({n, H * D}));
  }
}

at::Tensor llama_step(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& tensors,
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
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  const at::TensorOptions options = hidden.options();
  at::Tensor h = hidden.to(at::kFloat, false, true).contiguous();  // the residual stream [N,E], a copy
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  for (int64_t l = 0; l < layers; l++) {
    const int64_t at = l * PER_LAYER;
    const int64_t* code = codes.data() + l * PRODUCTS;
    const at::Tensor x = tensor_of(rms_norm(h, *tensors.get(at + LN1), eps, bf16), options);
    const int64_t qkv[3] = {at + Q, at + K, at + V}, biases[3] = {at + BQ, at + BK, at + BV};
    const std::vector<at::Tensor> out = products(x, tensors, qkv, biases, code, 3, max_rows);
    at::Tensor q = floats(out[0]), k = floats(out[1]);
    const at::Tensor v = floats(out[2]);
    rotate(q, H, D, c, s, bf16);
    rotate(k, Hkv, D, c, s, bf16);
    at::Tensor keys = caches[2 * l], values = caches[2 * l + 1];
    write_tokens(k, keys, rows, columns);
    write_tokens(v, values, rows, columns);
    at::Tensor attention = at::empty_like(q);  // [N, H·D]
    attend(q, keys, values, mask, B, H, column + 1, scaling, attention);  // the B rows' first
    if (P) attend_extra(q, keys, values, runs, B, H, scaling, options, attention);
    const int64_t o = at + O;
    const at::Tensor projected = products(tensor_of(attention, options), tensors, &o, nullptr, code + 3, 1,
                                          max_rows)[0];  // rounds the attention to the dtype on the way
    add_rounded(h, floats(projected), bf16);
    const at::Tensor y = tensor_of(rms_norm(h, *tensors.get(at + LN2), eps, bf16), options);
    const int64_t gate_up[2] = {at + GATE, at + UP};
    const std::vector<at::Tensor> mlp = products(y, tensors, gate_up, nullptr, code + 4, 2, max_rows);
    const at::Tensor gate = floats(mlp[0]), up = floats(mlp[1]);
    at::Tensor act = at::empty_like(gate);
    const float* g = gate.const_data_ptr<float>();
    const float* u = up.const_data_ptr<float>();
    float* a = act.data_ptr<float>();
    at::parallel_for(0, act.numel(), 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; i++) a[i] = rounded(g[i] / (1.0f + exp_of(-g[i])), bf16);  // in one loop
#pragma omp simd
      for (int64_t i = begin; i < end; i++) a[i] = rounded(a[i] * u[i], bf16);  // with this, gcc 12 vectorizes none
    });
    const int64_t down = at + DOWN;
    add_rounded(h, floats(products(tensor_of(act, options), tensors, &down, nullptr, code + 6, 1, max_rows)[0]), bf16);
  }
  const int64_t head = layers * PER_LAYER + 1;  // the head reads the B rows only
  const at::Tensor x = tensor_of(rms_norm(h.slice(0, 0, B), *tensors.get(head - 1), eps, bf16), options);
  return products(x, tensors, &head, nullptr, codes.data() + layers * PRODUCTS, 1, max_rows)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("llama_step(Tensor hidden, Tensor?[] tensors, int[] codes, Tensor[] caches, Tensor mask, Tensor cos, "
        "Tensor sin, int[] dims, float eps, float scaling, Tensor? extra=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) { m.impl("llama_step", &llama_step); }
