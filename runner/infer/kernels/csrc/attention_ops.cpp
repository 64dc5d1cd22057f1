// decode_attention.cpp's kernel as two torch ops, runner::cache_scores and runner::cache_weighted (their Python side,
// the layouts and the fake tensors for tracing: runner/infer/cpu_attention.py). C++ ops, so that a compiled step
// calls them as cheaply as aten's (about 6 µs; as Python custom ops they cost 20–30 µs a call, 60 calls a step).
// A call's arguments are flat: per segment, 6 tensors (codes, scales, mins, outliers, index, levels; any may be
// None) and LAYOUT ints (the store's format, dim, bits, group, plane, padded, chunk, then the Segment fields).
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "decode_attention.h"

namespace {

constexpr int64_t LAYOUT = 7 + 8;  // ints per segment: Side.layout (7), then cpu_attention.SEGMENT_FIELDS (8)

// (address, bytes from one (row, head) to the next) of a contiguous [B,H,…] tensor; (nullptr, 0) for none or empty.
std::pair<const uint8_t*, int64_t> per_head(const std::optional<at::Tensor>& t, int64_t heads) {
  if (!t || t->numel() == 0) return {nullptr, 0};
  TORCH_CHECK_VALUE(t->is_contiguous(), "cpu_attention reads contiguous tensors (got strides ", t->strides(),
                    " for ", t->sizes(), ")");
  return {static_cast<const uint8_t*>(t->data_ptr()), t->numel() / (t->size(0) * heads) * t->element_size()};
}

int64_t shift_of(int64_t n) { return n > 0 && (n & (n - 1)) == 0 ? 63 - __builtin_clzll(n) : -1; }

// The segments of a call, each one's `query` (scores) or `output` (weighted) checked to be below `sets`: the kernel
// trusts them as offsets.
std::vector<Segment> segments_of(const c10::List<std::optional<at::Tensor>>& tensors, at::IntArrayRef layouts,
                                 int64_t heads, bool scores, int64_t sets) {
  const int64_t n = static_cast<int64_t>(layouts.size()) / LAYOUT;
  TORCH_CHECK_VALUE(n >= 1 && static_cast<int64_t>(layouts.size()) == n * LAYOUT &&
                    static_cast<int64_t>(tensors.size()) == 6 * n, n, " segments: ", tensors.size(),
                    " tensors and ", layouts.size(), " layout ints do not match");
  std::vector<Segment> segments(n);
  for (int64_t i = 0; i < n; i++) {
    const int64_t* l = layouts.data() + i * LAYOUT;
    const auto tensor = [&](int j) { return tensors.get(6 * i + j); };
    Segment& g = segments[i];
    Store& s = g.store;
    s.format = l[0], s.dim = l[1], s.bits = l[2], s.group = l[3], s.plane = l[4], s.padded = l[5], s.chunk = l[6];
    s.blocks = s.format == KIVI_VALUE ? s.padded / s.group : 0;
    s.group_shift = shift_of(s.group), s.chunk_shift = shift_of(s.chunk);
    const std::optional<at::Tensor> outliers = tensor(3), index = tensor(4), levels = tensor(5);
    s.count = outliers ? outliers->size(-1) : 0;
    s.index_bytes = index ? index->element_size() : 0;
    std::tie(s.codes, s.codes_bh) = per_head(tensor(0), heads);
    std::tie(s.scales, s.scales_bh) = per_head(tensor(1), heads);
    std::tie(s.mins, s.mins_bh) = per_head(tensor(2), heads);
    std::tie(s.outliers, s.outliers_bh) = per_head(outliers, heads);
    std::tie(s.index, s.index_bh) = per_head(index, heads);
    s.levels = nullptr, s.uniform = 0;
    if (levels) {
      TORCH_CHECK_VALUE(levels->numel() == 16 && levels->scalar_type() == at::kFloat && levels->is_contiguous(),
                        "the kernel loads 16 float32 levels (two vectors of 8), used or not: see `levels16`");
      s.levels = levels->data_ptr<float>();
      s.uniform = s.bits > 0;
      for (int64_t v = 0; s.uniform && v < (int64_t{1} << s.bits); v++) s.uniform = s.levels[v] == float(v);
    }
    g.start = l[7], g.start_plus_limit = l[8], g.stop = l[9], g.stop_plus_limit = l[10];
    g.base = l[11], g.modulo = l[12], g.query = l[13], g.output = l[14];
    TORCH_CHECK_VALUE(!(g.modulo && g.start < g.base), "segment ", i, " is a ring starting at ", g.start,
                      ", before its base ", g.base);
    const int64_t set = scores ? g.query : g.output;
    TORCH_CHECK_VALUE(set >= 0 && set < sets, "a segment's ", scores ? "query" : "output", " is not below ", sets);
  }
  return segments;
}

// A 0-d integer tensor's value: read in place when it is a CPU int64 (item() is a trip through the dispatcher, and
// a decode step makes two of these calls a layer).
int64_t value_of(const at::Tensor& t) {
  return t.scalar_type() == at::kLong && t.device().is_cpu() ? *t.const_data_ptr<int64_t>() : t.item<int64_t>();
}

// queries [Q,B,H,G,D] float32 → [B,H,G,S] scaling·q·K over S = `columns` columns, each read from the segment
// holding it; -inf for columns no segment holds and where `mask` ([B,S'] bool; its last S columns are these) is
// False. `limit` (0-d) moves the segments' ends that say so.
at::Tensor cache_scores(const at::Tensor& queries, const c10::List<std::optional<at::Tensor>>& tensors,
                        at::IntArrayRef layouts, const std::optional<at::Tensor>& mask, int64_t columns,
                        const at::Tensor& limit, double scaling) {
  TORCH_CHECK_VALUE(queries.dim() == 5 && queries.scalar_type() == at::kFloat, "queries: [Q,B,H,G,D] float32");
  const at::Tensor q = queries.contiguous();
  const int64_t b = q.size(1), heads = q.size(2), groups = q.size(3);
  const std::vector<Segment> segments = segments_of(tensors, layouts, heads, true, q.size(0));
  at::Tensor out = at::empty({b, heads, groups, columns}, q.options());
  at::Tensor rows;  // the mask's last `columns` columns, one byte (0 or 1) each
  if (mask) {
    TORCH_CHECK_VALUE(mask->size(0) == b, "the mask has ", mask->size(0), " rows for ", b, " rows of queries");
    rows = mask->scalar_type() == at::kBool && mask->stride(-1) == 1 ? *mask : mask->to(at::kBool).contiguous();
    rows = rows.slice(-1, rows.size(-1) - columns);
  }
  runner_scores(segments.data(), static_cast<int64_t>(segments.size()), q.data_ptr<float>(),
                mask ? static_cast<const uint8_t*>(rows.data_ptr()) : nullptr, mask ? rows.stride(0) : 0,
                out.data_ptr<float>(), b, heads, groups, columns, value_of(limit), static_cast<float>(scaling),
                at::get_num_threads());
  return out;
}

// probs [B,H,G,S] float32 → [O,B,H,G,Dv]: output o is Σ probs·V over the columns of the segments whose `output` is o.
at::Tensor cache_weighted(const at::Tensor& probs, const c10::List<std::optional<at::Tensor>>& tensors,
                          at::IntArrayRef layouts, int64_t outputs, const at::Tensor& limit) {
  TORCH_CHECK_VALUE(probs.dim() == 4 && probs.scalar_type() == at::kFloat, "probs: [B,H,G,S] float32");
  const at::Tensor p = probs.contiguous();
  const int64_t b = p.size(0), heads = p.size(1), groups = p.size(2), columns = p.size(3);
  const std::vector<Segment> segments = segments_of(tensors, layouts, heads, false, outputs);
  at::Tensor out = at::empty({outputs, b, heads, groups, layouts[1]}, p.options());
  runner_weighted(segments.data(), static_cast<int64_t>(segments.size()), outputs, p.data_ptr<float>(),
                  out.data_ptr<float>(), b, heads, groups, columns, value_of(limit), at::get_num_threads());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(runner, m) {
  m.def("cache_scores(Tensor queries, Tensor?[] tensors, int[] layouts, Tensor? mask, int columns, Tensor limit, "
        "float scaling) -> Tensor");
  m.def("cache_weighted(Tensor probs, Tensor?[] tensors, int[] layouts, int outputs, Tensor limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(runner, CPU, m) {
  m.impl("cache_scores", &cache_scores);
  m.impl("cache_weighted", &cache_weighted);
}
