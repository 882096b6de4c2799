// logits[M, N] = hidden[M, K] @ weight[N, K]^T in fp32, for a weight packed once into groups of
// kGroupCols vocab rows: packed[g, k, c] = weight[g * kGroupCols + c, k], zero past N.
//
// The microkernel holds a tile of up to kMaxRows hidden rows x one group (kBlocks vectors of kLanes
// vocab entries) in accumulators: 8 x 3 of the 32 zmm on AVX-512, 4 x 3 of the 16 ymm on AVX2; each
// k step loads the group's kBlocks vectors once (one sequential stream through the packed weight)
// and FMAs them with each row's broadcast hidden value. Every
// output is an fp32 FMA chain over k in order, per chunk of kChunk, the chunks then added in order:
// the error of a plain fp32 dot product, like oneDNN's.
//
// The screened argmax (pegaserve_lm_head_argmax) finds each row's greedy token as the argmax of
// exactly those logits, reading an fp16 copy of the weight packed the same way: half the bytes,
// where the fp32 head streams its weight at the memory's rate. Each entry's logit from the fp16
// copy is within a proven bound of the fp32 one; the entries whose upper bound reaches the row's
// best lower bound are the candidates, and only their fp32 logits are computed, each the same
// float the full kernel gives (lm_head.py derives the bound).
//
// Plain C ABI (loaded with ctypes), so that it builds in a second with no torch headers and no ninja.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

namespace simd = pegaserve;
using simd::kLanes;
using simd::Vec;
constexpr int kBlocks = 3;
constexpr int kGroupCols = kLanes * kBlocks;
// kMaxRows * kBlocks accumulators + kBlocks weight vectors + a broadcast fit the vector registers
constexpr int kMaxRows = kLanes == 16 ? 8 : 4;
// Longer dot products are summed in chunks of kChunk, each added to the output: a shorter FMA chain
// (the error grows with its length), and the order oneDNN uses on these machines for K <= 1024.
constexpr int64_t kChunk = 512;
// The weight is read once per call, and the hardware prefetcher alone leaves the FMAs waiting on it
// (16 rows: ~10 ms instead of ~7). Each k step asks for the lines kPrefetchL1Steps ahead into L1;
// and the tiles of a group, together, ask for the group ~kPrefetchL2Bytes ahead into L2, each tile
// its own slice of it spread over its k steps, so that DRAM stays busy while the later tiles of
// a group compute on what is already in cache. Prefetches past the end of the packed weight are
// harmless hints (they never fault).
constexpr int64_t kPrefetchL1Steps = 32 * 16 / kLanes;  // 6 KiB ahead
constexpr int64_t kPrefetchL2Bytes = 96 * 1024;

// kLanes weights as fp32: the packed fp32 copy's (64-byte aligned), or the fp16 copy's (exactly).
inline Vec load_weights(const float* p) { return simd::load(p); }
inline Vec load_weights(const uint16_t* p) { return simd::load_half(p); }

// acc[0:MT, 0:kGroupCols] = a[0:MT, 0:k_size] @ w[0:k_size, 0:kGroupCols], each output one FMA chain
// over k in order; W is the packed copy's element (fp32, or fp16's 16 bits). `ahead` is this tile's
// slice of the group to prefetch, one k step of it every `ahead_every` k steps.
template <int MT, typename W>
__attribute__((always_inline)) inline void group_sums(const float* a, int64_t lda, const W* w, int64_t k_size,
                                                      const W* ahead, int64_t ahead_every, Vec (&acc)[MT][kBlocks]) {
  constexpr int64_t kPerLine = 64 / sizeof(W);  // weights per cache line
  int64_t countdown = 1;
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < kBlocks; ++j) acc[i][j] = simd::zero();

#pragma GCC unroll 2
  for (int64_t k = 0; k < k_size; ++k) {
    const W* wk = w + k * kGroupCols;
#pragma GCC unroll 3
    for (int64_t j = 0; j < kGroupCols; j += kPerLine)
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchL1Steps * kGroupCols + j), _MM_HINT_T0);
    if (--countdown == 0) {
      countdown = ahead_every;
#pragma GCC unroll 3
      for (int64_t j = 0; j < kGroupCols; j += kPerLine)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j), _MM_HINT_T1);
      ahead += kGroupCols;
    }
    const Vec w0 = load_weights(wk);
    const Vec w1 = load_weights(wk + kLanes);
    const Vec w2 = load_weights(wk + 2 * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const Vec x = simd::set1(a[i * lda + k]);
      acc[i][0] = simd::fmadd(x, w0, acc[i][0]);
      acc[i][1] = simd::fmadd(x, w1, acc[i][1]);
      acc[i][2] = simd::fmadd(x, w2, acc[i][2]);
    }
  }
}

// One tile: out[0:MT, 0:kGroupCols] (+)= a[0:MT, 0:k_size] @ w[0:k_size, 0:kGroupCols] (group_sums).
template <int MT>
void tile(const float* a, int64_t lda, const float* w, int64_t k_size, float* c, int64_t ldc, int64_t valid_cols,
          bool accumulate, const float* ahead, int64_t ahead_every) {
  Vec acc[MT][kBlocks];
  group_sums<MT>(a, lda, w, k_size, ahead, ahead_every, acc);

  if (valid_cols >= kGroupCols) {
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < kBlocks; ++j) {
        float* out = c + i * ldc + j * kLanes;
        simd::storeu(out, accumulate ? simd::add(simd::loadu(out), acc[i][j]) : acc[i][j]);
      }
  } else {  // the vocab tail: the padded columns are computed (zeros) but not stored
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 3
      for (int j = 0; j < kBlocks; ++j) {
        float* out = c + i * ldc + j * kLanes;
        const simd::Mask mask = simd::lane_mask(valid_cols - j * kLanes);
        const Vec sum = accumulate ? simd::add(simd::loadz(mask, out), acc[i][j]) : acc[i][j];
        simd::store_masked(out, mask, sum);
      }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool, const float*,
                        int64_t);
constexpr TileFn kTiles[9] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

void run_groups(const float* hidden, int64_t m, int64_t k, const float* packed, int64_t n, float* out,
                int64_t group_begin, int64_t group_end) {
  const int64_t group_floats = k * kGroupCols;
  const int64_t groups_ahead = std::max<int64_t>(1, kPrefetchL2Bytes / (group_floats * 4));
  const int64_t tiles_per_group = (m + kMaxRows - 1) / kMaxRows * ((k + kChunk - 1) / kChunk);
  for (int64_t g = group_begin; g < group_end; ++g) {
    const float* w = packed + g * group_floats;
    const int64_t col = g * kGroupCols;
    const float* ahead = w + groups_ahead * group_floats;
    for (int64_t row = 0; row < m; row += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m - row);
      for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
        const int64_t k_size = std::min(kChunk, k - k0);
        kTiles[rows](hidden + row * k + k0, k, w + k0 * kGroupCols, k_size, out + row * n + col, n, n - col, k0 > 0,
                     ahead, tiles_per_group);
        ahead += (k_size + tiles_per_group - 1) / tiles_per_group * kGroupCols;
      }
    }
  }
}

// Runs work(begin, end, slot) over the groups [0, num_groups), split evenly over up to num_threads
// threads of the process's OpenMP pool (torch's: the same libgomp, loaded first), slot 0 the caller's.
int64_t num_workers(int64_t num_groups, int64_t num_threads) {
  return std::max<int64_t>(1, std::min(num_threads, num_groups));
}

template <typename Work>
void split_groups(int64_t num_groups, int64_t num_threads, const Work& work) {
  const int64_t workers = num_workers(num_groups, num_threads);
  if (workers == 1) {
    work(0, num_groups, 0);
    return;
  }
#pragma omp parallel num_threads(workers)
  {
    const int64_t slot = omp_get_thread_num(), team = omp_get_num_threads();
    work(num_groups * slot / team, num_groups * (slot + 1) / team, slot);
  }
}

// --- the screened argmax -------------------------------------------------------------------------

constexpr size_t kMaxCandidates = 256;

struct Candidate {
  int64_t index;
  float upper;  // an upper bound of its fp32 logit
};

// One row's screen in one thread: the best lower bound of a logit seen so far, and the entries
// whose upper bound reached the best lower bound when they were seen (a superset of those that
// reach the final one). It fails (the caller computes the row's logits) on a NaN or on too many
// candidates.
struct Screen {
  float threshold = -INFINITY;
  bool failed = false;
  std::vector<Candidate> candidates;

  void keep(int64_t index, float upper) {
    if (candidates.size() >= kMaxCandidates) {
      const float t = threshold;
      const auto below = [t](const Candidate& c) { return c.upper < t; };
      candidates.erase(std::remove_if(candidates.begin(), candidates.end(), below), candidates.end());
      if (candidates.size() >= kMaxCandidates / 2) {
        failed = true;
        return;
      }
    }
    candidates.push_back({index, upper});
  }
};

// One pass over the fp16 copy: what its tiles read, and what they write: `screen_tile` a screen
// per row (the argmax), `upper_tile` every entry's upper bound (the draws).
struct HalfPass {
  const float* hidden;  // [m, k]
  int64_t m, k, n;
  const uint16_t* packed;
  const float* bounds;  // [groups * kGroupCols]
  const float* errors;  // [m]
  Screen* screens;      // [m]: this thread's
  float* upper;         // [m, n]
  float* maxima;        // [m]: this thread's largest upper bound of each row, NaN once one is NaN
  // The draws' cell masses, this thread's share: per row and cell of `cell` entries, the largest
  // upper bound seen, and per lane the sum of 2^max((upper - that) * scale, floor).
  const float* scales;  // [m]
  float floor;
  int64_t cell, num_cells;
  float* cell_max;   // [m, num_cells]
  float* cell_sums;  // [m, num_cells, kLanes]

  // Rows [row, row + MT) x group g of the fp16 logits, into acc (group_sums over the packed copy).
  template <int MT>
  void sums(int64_t row, int64_t g, const uint16_t* ahead, int64_t ahead_every, Vec (&acc)[MT][kBlocks]) const {
    group_sums<MT>(hidden + row * k, k, packed + g * k * kGroupCols, k, ahead, ahead_every, acc);
  }
};

// Rows [row, row + MT) x group g: each entry's bounds, fp16 logit -/+ error[row] * bound[entry],
// into the rows' screens.
template <int MT>
void screen_tile(const HalfPass& pass, int64_t row, int64_t g, const uint16_t* ahead, int64_t ahead_every) {
  Vec acc[MT][kBlocks];
  pass.sums<MT>(row, g, ahead, ahead_every, acc);
  const int64_t col = g * kGroupCols;
  const Vec none = simd::set1(-INFINITY);
  simd::Mask valid[kBlocks];
  Vec bound[kBlocks];
#pragma GCC unroll 3
  for (int j = 0; j < kBlocks; ++j) {
    valid[j] = simd::lane_mask(pass.n - col - j * kLanes);
    bound[j] = simd::load(pass.bounds + col + j * kLanes);
  }
  for (int i = 0; i < MT; ++i) {
    Screen& screen = pass.screens[row + i];
    if (screen.failed) continue;
    const Vec error = simd::set1(pass.errors[row + i]);
    Vec upper[kBlocks];
    Vec best_lower = none;
#pragma GCC unroll 3
    for (int j = 0; j < kBlocks; ++j) {
      if (simd::any(simd::both(valid[j], simd::is_nan(acc[i][j])))) screen.failed = true;
      upper[j] = simd::fmadd(error, bound[j], acc[i][j]);
      best_lower = simd::max(best_lower, simd::select(valid[j], none, simd::fnmadd(error, bound[j], acc[i][j])));
    }
    screen.threshold = std::max(screen.threshold, simd::reduce_max(best_lower));
    const Vec threshold = simd::set1(screen.threshold);
    for (int j = 0; j < kBlocks; ++j) {
      uint32_t bits = simd::lane_bits(simd::both(valid[j], simd::at_least(upper[j], threshold)));
      if (!bits) continue;
      alignas(64) float lanes[kLanes];
      simd::store(lanes, upper[j]);
      for (; bits; bits &= bits - 1) screen.keep(col + j * kLanes + __builtin_ctz(bits), lanes[__builtin_ctz(bits)]);
    }
  }
}

// Rows [row, row + MT) x group g: each entry's upper bound, fp16 logit + error[row] * bound[entry]
// (NaN throughout a row whose error is NaN), the rows' maxima so far, and their cells' masses so
// far (a vector of kLanes entries lies in one cell: cells are whole vectors).
template <int MT>
void upper_tile(const HalfPass& pass, int64_t row, int64_t g, const uint16_t* ahead, int64_t ahead_every) {
  Vec acc[MT][kBlocks];
  pass.sums<MT>(row, g, ahead, ahead_every, acc);
  const int64_t col = g * kGroupCols;
  const Vec none = simd::set1(-INFINITY);
  for (int i = 0; i < MT; ++i) {
    const Vec error = simd::set1(pass.errors[row + i]);
    float* out = pass.upper + (row + i) * pass.n + col;
    Vec upper[kBlocks];
    Vec best = none;
    bool nan = false;
#pragma GCC unroll 3
    for (int j = 0; j < kBlocks; ++j) {
      upper[j] = simd::fmadd(error, simd::load(pass.bounds + col + j * kLanes), acc[i][j]);
      const simd::Mask valid = simd::lane_mask(pass.n - col - j * kLanes);
      nan |= simd::any(simd::both(valid, simd::is_nan(upper[j])));
      best = simd::max(best, simd::select(valid, none, upper[j]));
      if (pass.n - col >= kGroupCols) {
        simd::storeu(out + j * kLanes, upper[j]);
      } else {  // the vocab tail
        simd::store_masked(out + j * kLanes, valid, upper[j]);
      }
    }
    const float group_max = simd::reduce_max(best);
    float& maximum = pass.maxima[row + i];
    maximum = nan || std::isnan(maximum) ? NAN : std::max(maximum, group_max);
    if (std::isnan(maximum)) continue;
    // Adds vectors [j_begin, j_end) of the group, all in one cell, whose largest is `largest`.
    const auto add_to_cell = [&](int j_begin, int j_end, float largest) {
      const int64_t at = (row + i) * pass.num_cells + (col + j_begin * kLanes) / pass.cell;
      float& cell_max = pass.cell_max[at];
      float* sums = pass.cell_sums + at * kLanes;
      Vec sum = simd::loadu(sums);
      if (largest > cell_max) {  // the sums so far, rescaled to the new largest
        sum = simd::mul(sum, simd::set1(std::exp2((cell_max - largest) * pass.scales[row + i])));
        cell_max = largest;
      }
      const Vec scale = simd::set1(pass.scales[row + i]), shift = simd::set1(cell_max);
      for (int j = j_begin; j < j_end; ++j) {
        const Vec exponent = simd::max(simd::mul(simd::sub(upper[j], shift), scale), simd::set1(pass.floor));
        sum = simd::select(simd::lane_mask(pass.n - col - j * kLanes), sum, simd::add(sum, simd::exp2(exponent)));
      }
      simd::storeu(sums, sum);
    };
    const int num_vectors = static_cast<int>(std::min<int64_t>(kBlocks, (pass.n - col + kLanes - 1) / kLanes));
    if (col / pass.cell == (col + num_vectors * kLanes - 1) / pass.cell) {
      add_to_cell(0, num_vectors, group_max);  // most groups lie in one cell
    } else {
      for (int j = 0; j < num_vectors; ++j) {
        const simd::Mask valid = simd::lane_mask(pass.n - col - j * kLanes);
        add_to_cell(j, j + 1, simd::reduce_max(simd::select(valid, none, upper[j])));
      }
    }
  }
}

using HalfTileFn = void (*)(const HalfPass&, int64_t, int64_t, const uint16_t*, int64_t);
constexpr HalfTileFn kScreenTiles[9] = {nullptr,        screen_tile<1>, screen_tile<2>, screen_tile<3>,
                                        screen_tile<4>, screen_tile<5>, screen_tile<6>, screen_tile<7>,
                                        screen_tile<8>};
constexpr HalfTileFn kUpperTiles[9] = {nullptr,       upper_tile<1>, upper_tile<2>, upper_tile<3>, upper_tile<4>,
                                       upper_tile<5>, upper_tile<6>, upper_tile<7>, upper_tile<8>};

void half_groups(const HalfPass& pass, const HalfTileFn* tiles, int64_t group_begin, int64_t group_end) {
  const int64_t group_halves = pass.k * kGroupCols;
  const int64_t groups_ahead = std::max<int64_t>(1, kPrefetchL2Bytes / (group_halves * 2));
  const int64_t tiles_per_group = (pass.m + kMaxRows - 1) / kMaxRows;
  for (int64_t g = group_begin; g < group_end; ++g) {
    const uint16_t* ahead = pass.packed + (g + groups_ahead) * group_halves;
    for (int64_t row = 0; row < pass.m; row += kMaxRows) {
      tiles[std::min<int64_t>(kMaxRows, pass.m - row)](pass, row, g, ahead, tiles_per_group);
      ahead += (pass.k + tiles_per_group - 1) / tiles_per_group * kGroupCols;
    }
  }
}

// The logit pegaserve_lm_head computes for one (row, entry): an FMA chain over k in order per chunk
// of kChunk, the chunks added in order; the same float, bit for bit.
float exact_logit(const float* x, const float* w, int64_t k) {
  float out = 0.0f;
  for (int64_t k0 = 0; k0 < k; k0 += kChunk) {
    float acc = 0.0f;
    const int64_t k_end = std::min(k, k0 + kChunk);
    for (int64_t i = k0; i < k_end; ++i) acc = std::fma(x[i], w[i], acc);
    out = k0 == 0 ? acc : out + acc;
  }
  return out;
}

// A row's error scale: its L2 norm, rounded up with room for the double sum's own rounding; NaN
// where the row is too small or not finite for the bound (lm_head.py).
float error_scale(const float* x, int64_t k) {
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(x[i]) * x[i];
  const double norm = std::sqrt(sum);
  if (!std::isfinite(norm) || norm < 0x1p-30) return NAN;
  const double scaled = norm * (1.0 + 0x1p-20);
  float up = static_cast<float>(scaled);
  if (static_cast<double>(up) < scaled) up = std::nextafter(up, INFINITY);
  return std::isfinite(up) ? up : NAN;
}

// The row's token from its screens (one per thread): the first of the candidates with the best
// fp32 logit; -1 where a screen failed.
int64_t settle(const float* x, int64_t k, const float* weight, const Screen* screens, int64_t num_screens,
               int64_t stride) {
  float threshold = -INFINITY;
  for (int64_t s = 0; s < num_screens; ++s) {
    if (screens[s * stride].failed) return -1;
    threshold = std::max(threshold, screens[s * stride].threshold);
  }
  if (!std::isfinite(threshold)) return -1;
  std::vector<int64_t> candidates;
  for (int64_t s = 0; s < num_screens; ++s)
    for (const Candidate& c : screens[s * stride].candidates)
      if (c.upper >= threshold) candidates.push_back(c.index);
  std::sort(candidates.begin(), candidates.end());
  int64_t best = -1;
  float best_logit = 0.0f;
  for (const int64_t index : candidates) {
    const float logit = exact_logit(x, weight + index * k, k);
    if (std::isnan(logit)) return -1;
    if (best < 0 || logit > best_logit) {  // strict: the first of equal logits
      best = index;
      best_logit = logit;
    }
  }
  return best;
}

}  // namespace

extern "C" {

int pegaserve_lm_head_group_cols() { return kGroupCols; }

// hidden: [m, k] row-major; packed: [ceil(n / group_cols), k, group_cols], 64-byte aligned (group_cols:
// 48 on AVX-512, 24 on AVX2);
// out: [m, n] row-major; k > 0. Groups are split evenly over num_threads threads (the caller's included).
void pegaserve_lm_head(const float* hidden, int64_t m, int64_t k, const float* packed, int64_t n, float* out,
                       int64_t num_threads) {
  const int64_t num_groups = (n + kGroupCols - 1) / kGroupCols;
  split_groups(num_groups, num_threads, [&](int64_t begin, int64_t end, int64_t) {
    run_groups(hidden, m, k, packed, n, out, begin, end);
  });
}

// Each row's argmax of the logits pegaserve_lm_head computes (the first of equal maxima), or -1
// where the screen cannot settle it. packed_half: the weight rounded to fp16 (its 16 bits), packed
// as pegaserve_lm_head's; bounds: [ceil(n / group_cols) * group_cols] fp32, 64-byte aligned, each
// entry's error bound per unit of a row's norm (lm_head.py); weight: the fp32 weight [n, k], row-major.
void pegaserve_lm_head_argmax(const float* hidden, int64_t m, int64_t k, const uint16_t* packed_half,
                              const float* bounds, const float* weight, int64_t n, int64_t* argmax_out,
                              int64_t num_threads) {
  const int64_t num_groups = (n + kGroupCols - 1) / kGroupCols;
  const int64_t workers = num_workers(num_groups, num_threads);
  std::vector<float> errors(m);
  std::vector<Screen> screens(workers * m);  // [slot][row]
  for (int64_t r = 0; r < m; ++r) {
    errors[r] = error_scale(hidden + r * k, k);
    if (std::isnan(errors[r])) screens[r].failed = true;
  }
  split_groups(num_groups, num_threads, [&](int64_t begin, int64_t end, int64_t slot) {
    HalfPass pass{};
    pass.hidden = hidden, pass.m = m, pass.k = k, pass.n = n, pass.packed = packed_half, pass.bounds = bounds;
    pass.errors = errors.data(), pass.screens = screens.data() + slot * m;
    half_groups(pass, kScreenTiles, begin, end);
  });
  for (int64_t r = 0; r < m; ++r) argmax_out[r] = settle(hidden + r * k, k, weight, screens.data() + r, workers, m);
}

// upper_out[m, n]: an upper bound of each fp32 logit pegaserve_lm_head computes, from the same fp16
// copy and bounds as pegaserve_lm_head_argmax, NaN throughout a row the bound cannot cover;
// max_out[m]: each row's largest (NaN where the row has a NaN); masses_out[m, ceil(n / cell)]: per
// cell of `cell` entries (a multiple of the vector width), the sum of 2^max((upper - max) * scale,
// floor), scale[m] per row, as vocab_passes.cpp's cell_masses finds them from upper_out (each
// exponent against its cell's largest, the cell then rescaled: the same sums but for rounding, and for
// entries more than the floor below the row's largest, which weigh less than the floor here).
void pegaserve_lm_head_upper(const float* hidden, int64_t m, int64_t k, const uint16_t* packed_half,
                             const float* bounds, int64_t n, const float* scales, float floor, int64_t cell,
                             float* upper_out, float* max_out, float* masses_out, int64_t num_threads) {
  const int64_t num_groups = (n + kGroupCols - 1) / kGroupCols;
  const int64_t workers = num_workers(num_groups, num_threads);
  const int64_t num_cells = (n + cell - 1) / cell;
  std::vector<float> errors(m);
  for (int64_t r = 0; r < m; ++r) errors[r] = error_scale(hidden + r * k, k);
  std::vector<float> maxima(workers * m, -INFINITY);                 // [slot][row]
  std::vector<float> cell_max(workers * m * num_cells, -INFINITY);   // [slot][row][cell]
  std::vector<float> cell_sums(workers * m * num_cells * kLanes, 0.0f);
  split_groups(num_groups, num_threads, [&](int64_t begin, int64_t end, int64_t slot) {
    const int64_t cells_at = slot * m * num_cells;
    const HalfPass pass{hidden, m, k, n, packed_half, bounds, errors.data(), nullptr, upper_out,
                        maxima.data() + slot * m, scales, floor, cell, num_cells, cell_max.data() + cells_at,
                        cell_sums.data() + cells_at * kLanes};
    half_groups(pass, kUpperTiles, begin, end);
  });
  for (int64_t r = 0; r < m; ++r) {
    float row_max = maxima[r];
    for (int64_t slot = 1; slot < workers; ++slot) {
      const float found = maxima[slot * m + r];
      row_max = std::isnan(row_max) || std::isnan(found) ? NAN : std::max(row_max, found);
    }
    max_out[r] = row_max;
    for (int64_t c = 0; c < num_cells; ++c) {
      double mass = std::isfinite(row_max) ? 0.0 : NAN;
      for (int64_t slot = 0; slot < workers && std::isfinite(row_max); ++slot) {
        const int64_t at = (slot * m + r) * num_cells + c;
        if (cell_max[at] == -INFINITY) continue;  // no entry of the cell in this thread's share
        float lanes = 0.0f;
        for (int lane = 0; lane < kLanes; ++lane) lanes += cell_sums[at * kLanes + lane];
        mass += lanes * std::exp2(static_cast<double>((cell_max[at] - row_max) * scales[r]));
      }
      masses_out[r * num_cells + c] = static_cast<float>(mass);
    }
  }
}

// out[r] = the fp32 logit pegaserve_lm_head computes for row r of hidden and entry columns[r].
void pegaserve_lm_head_logits_at(const float* hidden, int64_t m, int64_t k, const float* weight,
                                 const int64_t* columns, float* out) {
  for (int64_t r = 0; r < m; ++r) out[r] = exact_logit(hidden + r * k, weight + columns[r] * k, k);
}

}  // extern "C"
