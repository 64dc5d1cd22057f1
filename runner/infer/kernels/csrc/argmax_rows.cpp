// Greedy decoding's argmax over rows of logits at the speed of reading them. aten's CPU argmax keeps an index beside
// every compare in scalar code: 88-110 µs for a row of 49,152 floats on 2 AVX-512 cores, seven times its own amax
// (docs/performance.md). Three vector passes instead: a NaN count, the row's maximum, the first index holding it.
// The answer is aten's in every case: the first maximum; a row with a NaN goes to aten's argmax (the first NaN).
// bfloat16 and float16 rows are widened a row at a time into a float32 buffer that stays in cache (exact: the same
// order, the same ties), not the whole [M,V] first: a 16-row Qwen step's 151,936-wide logits are 9.7 MB in float32.
//
//   runner::argmax_rows(Tensor logits) -> Tensor     float32 / bfloat16 / float16 [M,V] → int64 [M]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The row's maximum ignoring NaNs (the caller checks for them). Without -ffast-math the compiler will not turn a
// float max loop into vector instructions (NaN order), so the AVX-512 and AVX2 builds say it themselves.
float row_max(const float* row, int64_t V) {
  int64_t i = 0;
  float best = row[0];
#if defined(__AVX512F__)
  __m512 lanes = _mm512_set1_ps(row[0]);
  for (; i + 16 <= V; i += 16) lanes = _mm512_max_ps(lanes, _mm512_loadu_ps(row + i));
  best = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX2__)
  __m256 low = _mm256_set1_ps(row[0]), high = low;
  for (; i + 16 <= V; i += 16) {
    low = _mm256_max_ps(low, _mm256_loadu_ps(row + i));
    high = _mm256_max_ps(high, _mm256_loadu_ps(row + i + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(low, high));
  for (float v : lanes) best = v > best ? v : best;
#endif
  for (; i < V; i++) best = row[i] > best ? row[i] : best;
  return best;
}

// The first index holding `best` (a value of the row).
int64_t first_index(const float* row, int64_t V, float best) {
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; k + 16 <= V; k += 16) {
    const __mmask16 hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + k), target, _CMP_EQ_OQ);
    if (hits) return k + __builtin_ctz(hits);
  }
#elif defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; k + 8 <= V; k += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + k), target, _CMP_EQ_OQ));
    if (hits) return k + __builtin_ctz(hits);
  }
#endif
  for (; k < V; k++)
    if (row[k] == best) return k;
  return 0;  // not reached
}

// The first index of the row's maximum, or -1 when the row holds a NaN (counted in a loop the compiler vectorizes).
int64_t row_argmax(const float* row, int64_t V) {
  int32_t nans = 0;
  for (int64_t k = 0; k < V; k++) nans += row[k] != row[k];
  return nans ? -1 : first_index(row, V, row_max(row, V));
}

// Each row's argmax into index[M] (-1: the row holds a NaN); T float, or a 16-bit float widened a row at a time.
template <typename T>
void argmax_of(const at::Tensor& x, int64_t* index) {
  const int64_t M = x.size(0), V = x.size(1);
  const T* data = x.const_data_ptr<T>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(std::is_same_v<T, float> ? 0 : V);
    for (int64_t m = begin; m < end; m++) {
      const T* row = data + m * V;
      if constexpr (std::is_same_v<T, float>) {
        index[m] = row_argmax(row, V);
      } else {
        for (int64_t k = 0; k < V; k++) wide[k] = static_cast<float>(row[k]);
        index[m] = row_argmax(wide.data(), V);
      }
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  const auto type = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) &&
              logits.size(1) >= 1, "argmax_rows: logits must be float32, bfloat16 or float16 [M,V] with V ≥ 1, got ",
              type, " ", logits.sizes());
  const at::Tensor x = logits.contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  bool unordered = false;
  if (type == at::kFloat) argmax_of<float>(x, index);
  else if (type == at::kBFloat16) argmax_of<c10::BFloat16>(x, index);
  else argmax_of<c10::Half>(x, index);
  for (int64_t m = 0; m < M; m++) unordered |= index[m] < 0;
  return unordered ? at::argmax(x, 1) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
