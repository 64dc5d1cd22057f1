// One decode step of a llama-family model (llama, qwen2) in C++: every layer's norms, products, rotary embedding,
// cache write and attention, for a few rows of one new token each, without Python between them. Registered as the
// torch op runner::llama_step (native.py builds it; runner/infer/compiled/native_step.py hands it a model's
// tensors and decides where it serves).
//
// Why: the compiled engine's step is inductor's graph driven by its Python wrapper, about 40 statements a layer. At
// batch 1 on 2 cores that wrapper and dynamo's entry cost 3–4 ms of SmolLM2's step (24 ms in float32, 7 ms on
// 4-bit GGUF weights), which is what llama.cpp, whose products read at the same rate as ours, does not spend.
// Here the products are runner's own ops (linear_rows, gguf_rows, gguf_rows_group: called through the dispatcher
// from C++, about a microsecond each), attention is decode_attention.cpp's kernel called directly, and everything
// between them is a loop over a few hundred floats.
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
//   mask    [B,S] bool: the columns each row attends to (its own new one included)
//   cos/sin [B,D] float32: the rotary embedding at each row's position (the model's rotary module's)
//   dims    layers, H, Hkv, D, column
// → logits [B,V] in the head's output dtype.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
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

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& wt, const std::optional<at::Tensor>& bias) {
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
                                 const int64_t* which, const int64_t* biases, const int64_t* codes, int n) {
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
      out.push_back(codes[i] == FLOAT_PRODUCT ? linear_rows(x, w, bias(i)) : gguf_rows(x, w, codes[i]));
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

float rounded(float v, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(v)) : v; }

// A [B,N] tensor (float32 or bfloat16) → floats.
std::vector<float> floats(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  std::vector<float> out(c.numel());
  if (c.scalar_type() == at::kFloat) {
    std::copy_n(c.const_data_ptr<float>(), out.size(), out.begin());
  } else {
    const c10::BFloat16* p = c.const_data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < out.size(); i++) out[i] = static_cast<float>(p[i]);
  }
  return out;
}

// floats [B,N] → a tensor of `like`'s dtype (values already representable in it).
at::Tensor tensor_of(const std::vector<float>& v, int64_t B, const at::TensorOptions& like) {
  at::Tensor t = at::empty({B, static_cast<int64_t>(v.size()) / B}, like);
  if (t.scalar_type() == at::kFloat) {
    std::copy(v.begin(), v.end(), t.data_ptr<float>());
  } else {
    c10::BFloat16* p = t.data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < v.size(); i++) p[i] = c10::BFloat16(v[i]);
  }
  return t;
}

// The model's RMSNorm (llama's and qwen2's): x·rsqrt(mean(x²) + eps) in float32, rounded to the dtype, times the
// weight, rounded again. h [B,E] floats → [B,E] floats.
std::vector<float> rms_norm(const std::vector<float>& h, int64_t B, const at::Tensor& weight, double eps, bool bf16) {
  const std::vector<float> w = floats(weight);
  const int64_t E = static_cast<int64_t>(w.size());
  std::vector<float> out(h.size());
  for (int64_t b = 0; b < B; b++) {
    const float* x = h.data() + b * E;
    float squares = 0;
    for (int64_t e = 0; e < E; e++) squares += x[e] * x[e];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(E) + static_cast<float>(eps));
    for (int64_t e = 0; e < E; e++) out[b * E + e] = rounded(w[e] * rounded(x[e] * scale, bf16), bf16);
  }
  return out;
}

// HF's rotate_half rotation, in place: x [B, heads·D] ← x·cos + rotate_half(x)·sin, per head.
void rotate(std::vector<float>& x, int64_t B, int64_t heads, int64_t D, const float* cos, const float* sin,
            bool bf16) {
  const int64_t half = D / 2;
  std::vector<float> head(D);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < heads; h++) {
      float* v = x.data() + (b * heads + h) * D;
      std::copy_n(v, D, head.begin());
      for (int64_t d = 0; d < D; d++) {
        const float turned = d < half ? -head[d + half] : head[d - half];
        v[d] = rounded(head[d] * cos[b * D + d] + turned * sin[b * D + d], bf16);
      }
    }
}

// K or V [B, Hkv·D] floats into column `column` of a [B,Hkv,S,D] cache in its storage dtype.
void write_column(const std::vector<float>& x, at::Tensor& cache, int64_t column) {
  const int64_t B = cache.size(0), H = cache.size(1), S = cache.size(2), D = cache.size(3);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const float* from = x.data() + (b * H + h) * D;
      const int64_t at = ((b * H + h) * S + column) * D;
      switch (cache.scalar_type()) {
        case at::kFloat: std::copy_n(from, D, cache.data_ptr<float>() + at); break;
        case at::kHalf: for (int64_t d = 0; d < D; d++) cache.data_ptr<c10::Half>()[at + d] = c10::Half(from[d]); break;
        default: for (int64_t d = 0; d < D; d++) cache.data_ptr<c10::BFloat16>()[at + d] = c10::BFloat16(from[d]);
      }
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

// One query per row: q [B, H·D] floats over the cache's columns [0, limit) → [B, H·D] floats, query heads grouped
// on their KV head (G = H / Hkv), softmax in float32.
std::vector<float> attend(const std::vector<float>& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& mask, int64_t B, int64_t H, int64_t limit, double scaling) {
  const int64_t Hkv = keys.size(1), S = keys.size(2), D = keys.size(3), G = H / Hkv;
  const Segment k = plain_segment(keys), v = plain_segment(values);
  std::vector<float> scores(B * H * S), out(B * H * D);
  const int threads = at::get_num_threads();
  runner_scores(&k, 1, q.data(), static_cast<const uint8_t*>(mask.const_data_ptr()), mask.stride(0), scores.data(),
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
  runner_weighted(&v, 1, 1, scores.data(), out.data(), B, Hkv, G, S, limit, threads);
  return out;
}

at::Tensor llama_step(const at::Tensor& hidden, const c10::List<std::optional<at::Tensor>>& tensors,
                      at::IntArrayRef codes, at::TensorList caches, const at::Tensor& mask, const at::Tensor& cos,
                      const at::Tensor& sin, at::IntArrayRef dims, double eps, double scaling) {
  TORCH_CHECK(dims.size() == 5, "llama_step: dims are layers, heads, KV heads, head dim, column");
  const int64_t layers = dims[0], H = dims[1], Hkv = dims[2], D = dims[3], column = dims[4], B = hidden.size(0);
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * PER_LAYER + 2 &&
              static_cast<int64_t>(codes.size()) == layers * PRODUCTS + 1 &&
              static_cast<int64_t>(caches.size()) == 2 * layers, "llama_step: ", tensors.size(), " tensors, ",
              codes.size(), " codes and ", caches.size(), " caches for ", layers, " layers");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.stride(1) == 1 && mask.size(0) == B, "llama_step: mask [B,S]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D,
              "llama_step: cos and sin [B,D] float32");
  for (const at::Tensor& c : caches)
    TORCH_CHECK(c.is_contiguous() && c.size(0) == B && c.size(1) == Hkv && c.size(3) == D && column < c.size(2),
                "llama_step: caches [B,Hkv,S,D] contiguous, the column inside");
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  const at::TensorOptions options = hidden.options();
  std::vector<float> h = floats(hidden);  // the residual stream [B,E]
  const float* c = cos.const_data_ptr<float>();
  const float* s = sin.const_data_ptr<float>();
  for (int64_t l = 0; l < layers; l++) {
    const int64_t at = l * PER_LAYER;
    const int64_t* code = codes.data() + l * PRODUCTS;
    const at::Tensor x = tensor_of(rms_norm(h, B, *tensors.get(at + LN1), eps, bf16), B, options);
    const int64_t qkv[3] = {at + Q, at + K, at + V}, biases[3] = {at + BQ, at + BK, at + BV};
    const std::vector<at::Tensor> out = products(x, tensors, qkv, biases, code, 3);
    std::vector<float> q = floats(out[0]), k = floats(out[1]), v = floats(out[2]);
    rotate(q, B, H, D, c, s, bf16);
    rotate(k, B, Hkv, D, c, s, bf16);
    at::Tensor keys = caches[2 * l], values = caches[2 * l + 1];
    write_column(k, keys, column);
    write_column(v, values, column);
    std::vector<float> attention = attend(q, keys, values, mask, B, H, column + 1, scaling);
    for (float& a : attention) a = rounded(a, bf16);
    const int64_t o = at + O;
    const at::Tensor projected = products(tensor_of(attention, B, options), tensors, &o, nullptr, code + 3, 1)[0];
    const std::vector<float> added = floats(projected);
    for (size_t i = 0; i < h.size(); i++) h[i] = rounded(h[i] + added[i], bf16);
    const at::Tensor y = tensor_of(rms_norm(h, B, *tensors.get(at + LN2), eps, bf16), B, options);
    const int64_t gate_up[2] = {at + GATE, at + UP};
    const std::vector<at::Tensor> mlp = products(y, tensors, gate_up, nullptr, code + 4, 2);
    const std::vector<float> gate = floats(mlp[0]), up = floats(mlp[1]);
    std::vector<float> act(gate.size());
    at::parallel_for(0, static_cast<int64_t>(act.size()), 4096, [&](int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; i++) act[i] = gate[i] / (1.0f + exp_of(-gate[i]));
      for (int64_t i = begin; i < end; i++) act[i] = rounded(rounded(act[i], bf16) * up[i], bf16);
    });
    const int64_t down = at + DOWN;
    const std::vector<float> back = floats(products(tensor_of(act, B, options), tensors, &down, nullptr,
                                                    code + 6, 1)[0]);
    for (size_t i = 0; i < h.size(); i++) h[i] = rounded(h[i] + back[i], bf16);
  }
  const int64_t head = layers * PER_LAYER + 1;
  const at::Tensor x = tensor_of(rms_norm(h, B, *tensors.get(head - 1), eps, bf16), B, options);
  return products(x, tensors, &head, nullptr, codes.data() + layers * PRODUCTS, 1)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("llama_step(Tensor hidden, Tensor?[] tensors, int[] codes, Tensor[] caches, Tensor mask, Tensor cos, "
        "Tensor sin, int[] dims, float eps, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) { m.impl("llama_step", &llama_step); }
