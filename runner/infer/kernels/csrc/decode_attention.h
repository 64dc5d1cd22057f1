// The kernel's interface (decode_attention.cpp implements it, attention_ops.cpp calls it as two torch ops).
#pragma once
#include <cstdint>

enum Format { F32 = 0, F16 = 1, BF16 = 2, Q8_0 = 3, Q4_0 = 4, NF4 = 5, Q4_1 = 6, KIVI_VALUE = 7, KIVI_KEY = 8 };

struct Store {          // one side (K or V) of a layer: cpu_attention.Side
  int64_t format;
  int64_t dim;          // values a column holds (head_dim)
  int64_t bits;         // KIVI: 2, 3 or 4
  int64_t group;        // KIVI values: channels per block; KIVI keys: columns per group
  int64_t plane;        // KIVI values at 2 and 4 bits: bytes of a plane group (quant.plane_bytes)
  int64_t padded;       // KIVI values: channels coded, whole blocks
  int64_t chunk;        // KIVI outliers: columns per chunk (g)
  int64_t count;        // KIVI outliers per chunk (k; 0: none)
  int64_t index_bytes;  // 2 or 4: int16 or int32 outlier indices
  const uint8_t* codes; int64_t codes_bh;        // bytes from one (row, head) to the next
  const uint8_t* scales; int64_t scales_bh;      // fp16
  const uint8_t* mins; int64_t mins_bh;          // fp16, KIVI
  const uint8_t* outliers; int64_t outliers_bh;  // fp16 [chunks, k], KIVI
  const uint8_t* index; int64_t index_bh;        // [chunks, k] ascending, into a chunk's columns × dim, KIVI
  const float* levels;  // nf4's 16 levels; KIVI: 2^bits levels (0, 1, 2, ... when uniform)
  // Derived by attention_ops.cpp from the layout, so that no column divides: an integer division costs as much as
  // decoding a few values (measured: one per 8 values made the KIVI value pass 17 % slower).
  int64_t blocks;       // KIVI values: blocks per column (padded / group)
  int64_t group_shift;  // log2(group) when a power of 2, else -1
  int64_t chunk_shift;  // log2(chunk) when a power of 2, else -1
  int64_t uniform;      // KIVI: levels are 0, 1, 2, ... (a code converts to its level, no lookup)
};

struct Segment {        // cpu_attention.Segment
  Store store;
  int64_t start, start_plus_limit, stop, stop_plus_limit;  // columns [start (+ limit), stop (+ limit)) of the call
  int64_t base, modulo;  // column t is the store's column (t − base), mod `modulo` when it is not 0 (a ring)
  int64_t query, output;  // which query rows it is taken against (scores) / which output it adds to (weighted)
};

// scores [B·H,G,S]: -inf, then each segment's columns; queries [Q,B·H,G,D], a segment reading set `query`.
void runner_scores(const Segment* segments, int64_t count, const float* queries, const uint8_t* mask,
                   int64_t mask_stride, float* scores, int64_t B, int64_t H, int64_t G, int64_t S, int64_t limit,
                   float scaling, int threads);

// out [O,B·H,G,Dv]: each output the sum of its segments' Σ p·V.
void runner_weighted(const Segment* segments, int64_t count, int64_t outputs, const float* probs, float* out,
                     int64_t B, int64_t H, int64_t G, int64_t S, int64_t limit, int threads);
