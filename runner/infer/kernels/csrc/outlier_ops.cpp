// The two selections of KIVI's outliers (runner/infer/kvcodes.py: split_outliers) as C++ torch ops:
//   lane_median(x [..., n, L]) → [..., 1, L]: the lower median of each of the L lanes over n values, the value
//     torch.median gives (sorted position (n − 1) / 2; NaN where a lane holds one);
//   top_indices(scores [..., n], k) → int64 [..., k]: the positions of the k largest scores in ascending order, what
//     topk(k).indices.sort() gives (NaN counts as the largest, as in topk; among equal scores at the cut, the
//     lowest positions).
// Why: aten's selections branch on the data and mispredict about once per value. Measured on fresh data, one
// thread: median 517 µs for 192 lanes of 128, topk 140 µs a row of 8192 (on the same data timed again, 93 and
// 15 µs: beware that benchmark). lane_median sorts 8 lanes at a time through Batcher's odd-even merge network
// (n padded to a power of two with +inf): min and max of vectors. top_indices finds the k-th largest by radix
// select on the scores' bits (histograms of 11, 11 and 10 bits), then takes one ascending pass.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// The comparators (i < j: after them position i holds the smaller) of Batcher's odd-even merge sort of n = 2^k.
std::vector<std::pair<int, int>> odd_even_network(int n) {
  std::vector<std::pair<int, int>> pairs;
  for (int p = 1; p < n; p <<= 1)
    for (int k = p; k >= 1; k >>= 1)
      for (int j = k % p; j + k < n; j += 2 * k)
        for (int i = 0; i < std::min(k, n - j - k); i++)
          if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) pairs.emplace_back(i + j, i + j + k);
  return pairs;
}

// Lanes [l0, l0 + width) of one [n, L] slice → out[l0 …]: `width` lanes (≤ 8) sorted through the network.
void median_lanes(const float* x, int64_t n, int64_t L, int64_t l0, int64_t width, int64_t padded,
                  const std::vector<std::pair<int, int>>& pairs, float* out) {
  const int64_t middle = (n - 1) / 2;
#if defined(__AVX2__)
  if (width == 8) {
    std::vector<__m256> v(padded, _mm256_set1_ps(std::numeric_limits<float>::infinity()));
    __m256 nan = _mm256_setzero_ps();  // lanes that hold a NaN (all ones)
    for (int64_t i = 0; i < n; i++) {
      v[i] = _mm256_loadu_ps(x + i * L + l0);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    for (const auto& [i, j] : pairs) {
      const __m256 a = v[i], b = v[j];
      v[i] = _mm256_min_ps(a, b), v[j] = _mm256_max_ps(a, b);
    }
    _mm256_storeu_ps(out + l0, _mm256_blendv_ps(v[middle], _mm256_set1_ps(NAN), nan));
    return;
  }
#endif
  std::vector<float> lane(n);
  for (int64_t l = l0; l < l0 + width; l++) {
    bool nan = false;
    for (int64_t i = 0; i < n; i++) lane[i] = x[i * L + l], nan |= std::isnan(lane[i]);
    std::nth_element(lane.begin(), lane.begin() + middle, lane.end());
    out[l] = nan ? NAN : lane[middle];
  }
}

at::Tensor lane_median(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                    "lane_median: x [..., n, L] float32 on the CPU");
  const at::Tensor c = x.contiguous();
  const int64_t n = c.size(-2), L = c.size(-1), slices = n && L ? c.numel() / (n * L) : 0;
  TORCH_CHECK_VALUE(n > 0, "lane_median: no values to take the median of (n = 0)");
  std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
  shape[shape.size() - 2] = 1;
  at::Tensor out = at::empty(shape, c.options());
  int64_t padded = 1;
  while (padded < n) padded *= 2;
  const auto pairs = odd_even_network(static_cast<int>(padded));
  const int64_t blocks = (L + 7) / 8;
  const float* src = c.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, slices * blocks, 256, [&](int64_t begin, int64_t end) {  // a task: about 2 µs at n = 128
    for (int64_t task = begin; task < end; task++) {
      const int64_t slice = task / blocks, l0 = (task % blocks) * 8;
      median_lanes(src + slice * n * L, n, L, l0, std::min<int64_t>(8, L - l0), padded, pairs, dst + slice * L);
    }
  });
  return out;
}

// A float's bits as an unsigned key in the floats' order (NaN above +inf, as topk ranks it).
inline uint32_t order_key(float f) {
  if (std::isnan(f)) return UINT32_MAX;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// One row of n scores → out[0, k): the ascending positions of the k largest. `keys`, `pool`: n entries each.
void top_row(const float* x, int64_t n, int64_t k, uint32_t* keys, uint32_t* pool, int64_t* out) {
  int64_t held = n, want = k;  // candidates in `pool` (all keys at first), how many of the largest are still sought
  for (int64_t i = 0; i < n; i++) keys[i] = pool[i] = order_key(x[i]);
  uint32_t prefix = 0, prefix_mask = 0;  // the bits of the k-th largest key found so far
  for (const int shift : {21, 10, 0}) {
    const int width = shift == 0 ? 10 : 11;
    std::array<int64_t, 2048> count{};
    for (int64_t i = 0; i < held; i++) count[(pool[i] >> shift) & ((1u << width) - 1)]++;
    int64_t bin = (1 << width) - 1;
    for (; count[bin] < want; bin--) want -= count[bin];  // bins above hold keys all larger than the k-th
    prefix |= static_cast<uint32_t>(bin) << shift, prefix_mask |= ((1u << width) - 1) << shift;
    int64_t kept = 0;
    for (int64_t i = 0; i < held; i++)
      if ((pool[i] & prefix_mask) == prefix) pool[kept++] = pool[i];
    held = kept;
  }
  // prefix is the k-th largest key; `want` of the keys equal to it are taken, the lowest positions first
  for (int64_t i = 0, j = 0; i < n && j < k; i++)
    if (keys[i] > prefix || (keys[i] == prefix && want-- > 0)) out[j++] = i;
}

at::Tensor top_indices(const at::Tensor& scores, int64_t k) {
  TORCH_CHECK_VALUE(scores.dim() >= 1 && scores.scalar_type() == at::kFloat && scores.device().is_cpu(),
                    "top_indices: scores [..., n] float32 on the CPU");
  const at::Tensor c = scores.contiguous();
  const int64_t n = c.size(-1), rows = n ? c.numel() / n : 0;
  TORCH_CHECK_VALUE(0 <= k && k <= n, "top_indices: k = ", k, " of n = ", n, " scores");
  std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
  shape.back() = k;
  at::Tensor out = at::empty(shape, c.options().dtype(at::kLong));
  const float* src = c.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {  // a row of 8192: about 20 µs
    std::vector<uint32_t> keys(n), pool(n);
    for (int64_t row = begin; row < end; row++)
      if (k) top_row(src + row * n, n, k, keys.data(), pool.data(), dst + row * k);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("lane_median(Tensor x) -> Tensor");
  m.def("top_indices(Tensor scores, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) {
  m.impl("lane_median", &lane_median);
  m.impl("top_indices", &top_indices);
}
