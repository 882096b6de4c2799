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

namespace simd = pegaserve;
using simd::IVec;
using simd::kLanes;
using simd::Mask;
using simd::Vec;

double exp2_scalar(float x) { return std::exp2(static_cast<double>(x)); }

const float* row_of(const float* x, int64_t ld, const int64_t* row_ids, int64_t r) {
  return x + (row_ids ? row_ids[r] : r) * ld;
}

// The exponents of kLanes logits: (v - shift) * scale, the floor for those below `lower`, clamped to the floor.
Vec exponents(Vec v, Vec shift, Vec scale, Vec lower, bool bounded, Vec floor) {
  Vec e = simd::mul(simd::sub(v, shift), scale);
  if (bounded) e = simd::select(simd::less(v, lower), e, floor);
  return simd::max(e, floor);  // a NaN exponent becomes the floor
}

// Passes keep kChains independent accumulators, each over every kChains-th vector of a block: one
// chain's compare or add waits on its last, and several let the loads and the math run ahead.
constexpr int kChains = 4;
constexpr int64_t kBlock = kChains * kLanes;
static_assert(kChains == 4, "pegaserve_cell_masses adds its chains in a tree of four");

// The bucket of each of kLanes exponents (at or below 0; the floor and below: the last bucket).
IVec buckets_of(Vec e, Vec to_bucket, IVec last) { return simd::min_i(simd::truncate(simd::mul(e, to_bucket)), last); }

}  // namespace

extern "C" {


void pegaserve_max_argmax(const float* x, int64_t ld, int64_t vocab, const int64_t* row_ids, int64_t n, float* max_out,
                          int64_t* argmax_out) {
  const int64_t blocked = vocab - vocab % kBlock;
  const IVec block_step = simd::set1_i(kBlock), step = simd::set1_i(kLanes);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    Vec best[kChains];
    IVec best_at[kChains], at[kChains];
    for (int k = 0; k < kChains; ++k) {
      best[k] = simd::set1(-INFINITY);
      best_at[k] = simd::set1_i(0);
      at[k] = simd::add_i(simd::iota(), simd::set1_i(k * kLanes));
    }
    Mask nan = simd::lane_mask(0);
    for (int64_t c = 0; c < blocked; c += kBlock) {
      for (int k = 0; k < kChains; ++k) {
        const Vec v = simd::loadu(row + c + k * kLanes);
        nan = simd::either(nan, simd::is_nan(v));
        const Mask better = simd::greater(v, best[k]);  // strict: each lane keeps its first
        best[k] = simd::select(better, best[k], v);
        best_at[k] = simd::select_i(better, best_at[k], at[k]);
        at[k] = simd::add_i(at[k], block_step);
      }
    }
    IVec tail_at = simd::add_i(simd::iota(), simd::set1_i(static_cast<int32_t>(blocked)));
    for (int64_t c = blocked; c < vocab; c += kLanes) {  // the tail, on the first chain (its indices are all later)
      const Mask valid = simd::lane_mask(vocab - c);
      const Vec v = simd::load_or(valid, row + c, simd::set1(-INFINITY));
      nan = simd::either(nan, simd::both(valid, simd::is_nan(v)));
      const Mask better = simd::greater(v, best[0]);
      best[0] = simd::select(better, best[0], v);
      best_at[0] = simd::select_i(better, best_at[0], tail_at);
      tail_at = simd::add_i(tail_at, step);
    }
    if (simd::any(nan)) {  // rare: find the first NaN
      int64_t c = 0;
      while (!std::isnan(row[c])) ++c;
      max_out[r] = row[c];
      argmax_out[r] = c;
      continue;
    }
    float top = -INFINITY;
    for (int k = 0; k < kChains; ++k) top = std::max(top, simd::reduce_max(best[k]));
    // the lowest index among lanes holding the max (an all -inf row: every lane, index 0)
    int32_t first = INT32_MAX;
    for (int k = 0; k < kChains; ++k) {
      const Mask holders = simd::equal(best[k], simd::set1(top));
      first = std::min(first, simd::reduce_min_i(simd::select_i(holders, simd::set1_i(INT32_MAX), best_at[k])));
    }
    max_out[r] = top;
    argmax_out[r] = first;
  }
}

void pegaserve_cell_masses(const float* x, int64_t ld, int64_t vocab, const int64_t* row_ids, int64_t n,
                           const float* shift, const float* scale, const float* lower, float floor, int64_t cell,
                           float* out) {
  const int64_t num_cells = (vocab + cell - 1) / cell;
  const Vec floor_v = simd::set1(floor);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    const Vec shift_v = simd::set1(shift[r]), scale_v = simd::set1(scale[r]);
    const Vec lower_v = simd::set1(lower ? lower[r] : -INFINITY);
    for (int64_t k = 0; k < num_cells; ++k) {
      const int64_t first = k * cell, last = std::min(vocab, first + cell);
      const int64_t blocked = first + (last - first) / kBlock * kBlock;
      Vec sums[kChains];
      for (Vec& sum : sums) sum = simd::zero();
      for (int64_t c = first; c < blocked; c += kBlock) {
        for (int j = 0; j < kChains; ++j) {
          const Vec v = simd::loadu(row + c + j * kLanes);
          sums[j] = simd::add(sums[j], simd::exp2(exponents(v, shift_v, scale_v, lower_v, lower != nullptr, floor_v)));
        }
      }
      for (int64_t c = blocked; c < last; c += kLanes) {  // the short last cell's tail, on the first chain
        const Mask valid = simd::lane_mask(last - c);
        const Vec v = simd::loadz(valid, row + c);
        const Vec w = simd::exp2(exponents(v, shift_v, scale_v, lower_v, lower != nullptr, floor_v));
        sums[0] = simd::select(valid, sums[0], simd::add(sums[0], w));
      }
      out[r * num_cells + k] = simd::reduce_add(simd::add(simd::add(sums[0], sums[1]), simd::add(sums[2], sums[3])));
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
  const Vec floor_v = simd::set1(floor);
  const Vec to_bucket = simd::set1(static_cast<float>(num_buckets) / floor);
  const IVec last_bucket = simd::set1_i(static_cast<int32_t>(num_buckets - 1));
  std::vector<float> mass(kCopies * num_buckets);
  std::vector<float> found(vocab + kLanes);
  alignas(64) int32_t b_lanes[kBlock];
  alignas(64) float w_lanes[kBlock];
  const int64_t blocked = vocab - vocab % kBlock;
  for (int64_t r = 0; r < n; ++r) {
    const float* row = row_of(x, ld, row_ids, r);
    const Vec shift_v = simd::set1(shift[r]), scale_v = simd::set1(scale[r]);
    const float row_lower = lower ? lower[r] : -INFINITY;
    const Vec lower_v = simd::set1(row_lower);
    std::fill(mass.begin(), mass.end(), 0.0f);
    // a block's buckets and weights at once (its vectors' math overlaps), then added in column order
    // (column c to copy c % kCopies, as a vector at a time did)
    for (int64_t c = 0; c < blocked; c += kBlock) {
      for (int j = 0; j < kChains; ++j) {
        const Vec e = exponents(simd::loadu(row + c + j * kLanes), shift_v, scale_v, lower_v, lower != nullptr,
                                floor_v);
        simd::store_i(b_lanes + j * kLanes, buckets_of(e, to_bucket, last_bucket));
        simd::store(w_lanes + j * kLanes, simd::exp2(e));
      }
      for (int64_t i = 0; i < kBlock; ++i) mass[(i % kCopies) * num_buckets + b_lanes[i]] += w_lanes[i];
    }
    for (int64_t c = blocked; c < vocab; c += kLanes) {
      const int64_t valid = std::min<int64_t>(kLanes, vocab - c);
      const Vec e = exponents(simd::loadz(simd::lane_mask(valid), row + c), shift_v, scale_v, lower_v,
                              lower != nullptr, floor_v);
      simd::store_i(b_lanes, buckets_of(e, to_bucket, last_bucket));
      simd::store(w_lanes, simd::exp2(e));
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
    const IVec wanted = simd::set1_i(static_cast<int32_t>(boundary));
    int64_t num_found = 0;
    for (int64_t c = 0; c < vocab; c += kLanes) {
      const Mask valid = simd::lane_mask(vocab - c);
      const Vec v = simd::loadz(valid, row + c);
      const Vec e = exponents(v, shift_v, scale_v, lower_v, lower != nullptr, floor_v);
      const Mask in = simd::both(valid, simd::equal_i(buckets_of(e, to_bucket, last_bucket), wanted));
      num_found += simd::compress_store(found.data() + num_found, in, v);
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
