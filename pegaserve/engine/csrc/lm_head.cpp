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
// Plain C ABI (loaded with ctypes), so that it builds in a second with no torch headers and no ninja.

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
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

// One tile: out[0:MT, 0:kGroupCols] (+)= a[0:MT, 0:k_size] @ w[0:k_size, 0:kGroupCols]. `ahead` is
// this tile's slice of the group to prefetch, one k step of it every `ahead_every` k steps.
template <int MT>
void tile(const float* a, int64_t lda, const float* w, int64_t k_size, float* c, int64_t ldc, int64_t valid_cols,
          bool accumulate, const float* ahead, int64_t ahead_every) {
  Vec acc[MT][kBlocks];
  int64_t countdown = 1;
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 3
    for (int j = 0; j < kBlocks; ++j) acc[i][j] = simd::zero();

#pragma GCC unroll 2
  for (int64_t k = 0; k < k_size; ++k) {
    const float* wk = w + k * kGroupCols;
#pragma GCC unroll 3
    for (int j = 0; j < kBlocks; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchL1Steps * kGroupCols + j * kLanes), _MM_HINT_T0);
    if (--countdown == 0) {
      countdown = ahead_every;
#pragma GCC unroll 3
      for (int j = 0; j < kBlocks; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + j * kLanes), _MM_HINT_T1);
      ahead += kGroupCols;
    }
    const Vec w0 = simd::load(wk);
    const Vec w1 = simd::load(wk + kLanes);
    const Vec w2 = simd::load(wk + 2 * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const Vec x = simd::set1(a[i * lda + k]);
      acc[i][0] = simd::fmadd(x, w0, acc[i][0]);
      acc[i][1] = simd::fmadd(x, w1, acc[i][1]);
      acc[i][2] = simd::fmadd(x, w2, acc[i][2]);
    }
  }

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

}  // namespace

extern "C" {

int pegaserve_lm_head_group_cols() { return kGroupCols; }

// hidden: [m, k] row-major; packed: [ceil(n / group_cols), k, group_cols], 64-byte aligned (group_cols:
// 48 on AVX-512, 24 on AVX2);
// out: [m, n] row-major; k > 0. Groups are split evenly over num_threads threads (the caller's included).
void pegaserve_lm_head(const float* hidden, int64_t m, int64_t k, const float* packed, int64_t n, float* out,
                       int64_t num_threads) {
  const int64_t num_groups = (n + kGroupCols - 1) / kGroupCols;
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, num_groups));
  if (workers == 1) {
    run_groups(hidden, m, k, packed, n, out, 0, num_groups);
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  int64_t started = 1;
  try {
    for (; started < workers; ++started)
      threads.emplace_back(run_groups, hidden, m, k, packed, n, out, num_groups * started / workers,
                           num_groups * (started + 1) / workers);
  } catch (const std::system_error&) {  // no thread to be had: this one does their share
  }
  run_groups(hidden, m, k, packed, n, out, 0, num_groups / workers);
  run_groups(hidden, m, k, packed, n, out, num_groups * started / workers, num_groups);
  for (auto& thread : threads) thread.join();
}

}  // extern "C"
