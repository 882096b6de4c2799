// Passes over a step's logits, one row at a time: what the sampler (pegaserve/engine/sampler.py)
// reads from a ~150k-wide row, in one sweep each instead of a chain of torch ops that each stream
// the row (or a scratch copy of it) again. Each row is reduced alone, in a fixed order, so a row's
// results are the same bits whatever else is in the batch.
//
//   max_argmax:   each row's max and the first index holding it (NaN counts as the max, as torch's
//                 argmax has it).
//   cell_masses:  each row's sum of 2^max(e, floor) per cell of `cell` columns, where
//                 e = (logit - shift) * scale, and e = floor for logits below the row's `lower`.
//   top_p_bound:  each row's lowest logit kept by top-p over those weights: a histogram of the mass
//                 by exponent finds the bucket where the running mass reaches p; only that bucket's
//                 logits are sorted.
//
// Plain C ABI (loaded with ctypes), built like lm_head.cpp (pegaserve/engine/cpu_kernels.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "simd.h"

namespace {

using pegaserve::exp2_ps;
using pegaserve::kLanes;
using pegaserve::lane_mask;

double exp2_scalar(float x) { return std::exp2(static_cast<double>(x)); }

const float* row_of(const float* x, int64_t ld, const int64_t* row_ids, int64_t r) {
  return x + (row_ids ? row_ids[r] : r) * ld;
}

// The exponents of 16 logits: (v - shift) * scale, the floor for those below `lower`, clamped to the floor.
__m512 exponents(__m512 v, __m512 shift, __m512 scale, __m512 lower, bool bounded, __m512 floor) {
  __m512 e = _mm512_mul_ps(_mm512_sub_ps(v, shift), scale);
  if (bounded) e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(v, lower, _CMP_LT_OQ), floor);
  return _mm512_max_ps(e, floor);  // a NaN exponent becomes the floor
}

// The bucket of each of 16 exponents (at or below 0; the floor and below: the last bucket).
__m512i buckets_of(__m512 e, __m512 to_bucket, __m512i last) {
  return _mm512_min_epi32(_mm512_cvttps_epi32(_mm512_mul_ps(e, to_bucket)), last);
}

}  // namespace

extern "C" {


void pegaserve_max_argmax(const float* x, int64_t ld, int64_t vocab, const int64_t* row_ids, int64_t n, float* max_out,
                          int64_t* argmax_out) {
  const __m512i step = _mm512_set1_epi32(kLanes);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_setzero_si512();
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (int64_t c = 0; c < vocab; c += kLanes) {
      const __mmask16 valid = lane_mask(vocab - c);
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, row + c);
      nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
      const __mmask16 better = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: each lane keeps its first
      best = _mm512_mask_mov_ps(best, better, v);
      best_at = _mm512_mask_mov_epi32(best_at, better, at);
      at = _mm512_add_epi32(at, step);
    }
    if (nan) {  // rare: find the first NaN
      int64_t c = 0;
      while (!std::isnan(row[c])) ++c;
      max_out[r] = row[c];
      argmax_out[r] = c;
      continue;
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    // the lowest index among lanes holding the max (an all -inf row: every lane, index 0)
    const __m512i candidates = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), holders, best_at);
    max_out[r] = top;
    argmax_out[r] = holders ? _mm512_reduce_min_epi32(candidates) : 0;
  }
}

void pegaserve_cell_masses(const float* x, int64_t ld, int64_t vocab, const int64_t* row_ids, int64_t n,
                           const float* shift, const float* scale, const float* lower, float floor, int64_t cell,
                           float* out) {
  const int64_t num_cells = (vocab + cell - 1) / cell;
  const __m512 floor_v = _mm512_set1_ps(floor);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    const __m512 shift_v = _mm512_set1_ps(shift[r]), scale_v = _mm512_set1_ps(scale[r]);
    const __m512 lower_v = _mm512_set1_ps(lower ? lower[r] : -INFINITY);
    for (int64_t k = 0; k < num_cells; ++k) {
      const int64_t first = k * cell, last = std::min(vocab, first + cell);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = first; c < last; c += kLanes) {
        const __mmask16 valid = lane_mask(last - c);
        const __m512 v = _mm512_maskz_loadu_ps(valid, row + c);
        const __m512 w = exp2_ps(exponents(v, shift_v, scale_v, lower_v, lower != nullptr, floor_v));
        sum = _mm512_mask_add_ps(sum, valid, sum, w);
      }
      out[r * num_cells + k] = _mm512_reduce_add_ps(sum);
    }
  }
}

// top_p: per row, in (0, 1); buckets: slices of the exponent from 0 down to the floor (the last also
// holds everything below). Rows whose mass reaches p only in the last bucket keep all: their bound
// is `lower` (or -inf).
void pegaserve_top_p_bound(const float* x, int64_t ld, int64_t vocab, const int64_t* row_ids, int64_t n,
                           const float* shift, const float* scale, const float* lower, float floor,
                           const double* top_p, int64_t num_buckets, float* bound_out) {
  constexpr int kCopies = 4;  // interleaved histograms: consecutive adds to one bucket do not wait on each other
  const __m512 floor_v = _mm512_set1_ps(floor);
  const __m512 to_bucket = _mm512_set1_ps(static_cast<float>(num_buckets) / floor);
  const __m512i last_bucket = _mm512_set1_epi32(static_cast<int32_t>(num_buckets - 1));
  std::vector<float> mass(kCopies * num_buckets);
  std::vector<float> found(vocab + kLanes);
  alignas(64) int32_t b_lanes[kLanes];
  alignas(64) float w_lanes[kLanes];
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    const __m512 shift_v = _mm512_set1_ps(shift[r]), scale_v = _mm512_set1_ps(scale[r]);
    const float row_lower = lower ? lower[r] : -INFINITY;
    const __m512 lower_v = _mm512_set1_ps(row_lower);
    std::fill(mass.begin(), mass.end(), 0.0f);
    for (int64_t c = 0; c < vocab; c += kLanes) {
      const int64_t valid = std::min<int64_t>(kLanes, vocab - c);
      const __m512 e = exponents(_mm512_maskz_loadu_ps(lane_mask(valid), row + c), shift_v, scale_v, lower_v,
                                 lower != nullptr, floor_v);
      _mm512_store_si512(b_lanes, buckets_of(e, to_bucket, last_bucket));
      _mm512_store_ps(w_lanes, exp2_ps(e));
      for (int64_t i = 0; i < valid; ++i) mass[(i % kCopies) * num_buckets + b_lanes[i]] += w_lanes[i];
    }
    std::vector<double> cumulative(num_buckets);
    double total = 0.0;
    for (int64_t b = 0; b < num_buckets; ++b) {
      for (int copy = 0; copy < kCopies; ++copy) total += mass[copy * num_buckets + b];
      cumulative[b] = total;
    }
    const double target = top_p[r] * total;
    const int64_t boundary = std::min<int64_t>(
        num_buckets - 1, std::lower_bound(cumulative.begin(), cumulative.end(), target) - cumulative.begin());
    if (boundary == num_buckets - 1) {
      bound_out[r] = row_lower;
      continue;
    }
    double before = boundary > 0 ? cumulative[boundary - 1] : 0.0;
    // the boundary bucket's logits (those below `lower` are all in the last bucket, never this one)
    const __m512i wanted = _mm512_set1_epi32(static_cast<int32_t>(boundary));
    int64_t num_found = 0;
    for (int64_t c = 0; c < vocab; c += kLanes) {
      const __mmask16 valid = lane_mask(vocab - c);
      const __m512 v = _mm512_maskz_loadu_ps(valid, row + c);
      const __m512 e = exponents(v, shift_v, scale_v, lower_v, lower != nullptr, floor_v);
      const __mmask16 in = _mm512_mask_cmpeq_epi32_mask(valid, buckets_of(e, to_bucket, last_bucket), wanted);
      _mm512_mask_compressstoreu_ps(found.data() + num_found, in, v);
      num_found += __builtin_popcount(in);
    }
    std::sort(found.begin(), found.begin() + num_found, std::greater<float>());
    float bound = num_found ? found[num_found - 1] : row_lower;
    for (int64_t i = 0; i < num_found && before < target; ++i) {  // the fewest best tokens whose mass reaches p
      bound = found[i];
      const float e = (found[i] - shift[r]) * scale[r];
      before += e <= floor ? 0.0 : exp2_scalar(e);
    }
    bound_out[r] = std::max(bound, row_lower);
  }
}

}  // extern "C"
