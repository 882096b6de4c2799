// Attention of a few queries per request (decode tokens, speculative drafts) over the paged KV cache,
// read in place: no gathered copy of each context, no padding to the longest one.
//
// q: [num_tokens, H, D]; kv: one layer, [2, num_blocks, block_size, KVH, D] (K then V); request r's
// queries are tokens query_starts[r] .. + query_lens[r], and its query j sees the keys at positions
// 0 .. context_lens[r] - query_lens[r] + j (causal). Head h reads KV head h / (H / KVH) (GQA).
// out: [num_tokens, H, D].
//
// Per (query, head): an online softmax over the keys, kLanes at a time (16 on AVX-512, 8 on AVX2):
// their scores, the running max, the weights 2^((s - max) log2 e), and the weighted sum of V, all in
// fp32; the result is divided by the sum of weights at the end. D must be a multiple of 16, at most 256.
//
// Plain C ABI (loaded with ctypes), built like lm_head.cpp (pegaserve/engine/cpu_kernels.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "simd.h"

namespace {

namespace simd = pegaserve;
using simd::kLanes;
using simd::Vec;

constexpr int kMaxVectors = 256 / kLanes;  // D <= 256
constexpr float kLog2E = 1.4426950408889634f;

struct Layout {
  const float* k;  // the layer's K: [num_blocks, block_size, KVH, D]
  const float* v;
  int64_t block_size, token_stride;  // token_stride = KVH * D
};

template <int V>  // V = D / kLanes vectors per head
void attend(const float* q, const Layout& kv, const int64_t* table, int64_t num_keys, float scale, float* out) {
  Vec qv[V], acc[V];
  for (int i = 0; i < V; ++i) {
    qv[i] = simd::mul(simd::loadu(q + i * kLanes), simd::set1(scale * kLog2E));  // scores in log2 units
    acc[i] = simd::zero();
  }
  float running_max = -INFINITY, total = 0.0f;
  alignas(64) float scores[kLanes];
  for (int64_t first = 0; first < num_keys; first += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, num_keys - first);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t pos = first + t;
      const float* key = kv.k + (table[pos / kv.block_size] * kv.block_size + pos % kv.block_size) * kv.token_stride;
      Vec dot = simd::mul(qv[0], simd::loadu(key));
      for (int i = 1; i < V; ++i) dot = simd::fmadd(qv[i], simd::loadu(key + i * kLanes), dot);
      scores[t] = simd::reduce_add(dot);
    }
    const simd::Mask valid = simd::lane_mask(count);
    const Vec s = simd::load_or(valid, scores, simd::set1(-INFINITY));
    const float new_max = std::max(running_max, simd::reduce_max(s));
    const float correction = running_max == -INFINITY ? 0.0f : std::exp2(running_max - new_max);
    const Vec shifted = simd::max(simd::sub(s, simd::set1(new_max)), simd::set1(-126.0f));
    const Vec w = simd::select(valid, simd::zero(), simd::exp2(shifted));
    simd::store(scores, w);
    total = total * correction + simd::reduce_add(w);
    const Vec c = simd::set1(correction);
    for (int i = 0; i < V; ++i) acc[i] = simd::mul(acc[i], c);
    for (int64_t t = 0; t < count; ++t) {
      const int64_t pos = first + t;
      const float* value = kv.v + (table[pos / kv.block_size] * kv.block_size + pos % kv.block_size) * kv.token_stride;
      const Vec weight = simd::set1(scores[t]);
      for (int i = 0; i < V; ++i) acc[i] = simd::fmadd(weight, simd::loadu(value + i * kLanes), acc[i]);
    }
    running_max = new_max;
  }
  const Vec inverse = simd::set1(1.0f / total);
  for (int i = 0; i < V; ++i) simd::storeu(out + i * kLanes, simd::mul(acc[i], inverse));
}

using AttendFn = void (*)(const float*, const Layout&, const int64_t*, int64_t, float, float*);

template <int... Vs>
constexpr AttendFn attend_for(int vectors, std::integer_sequence<int, Vs...>) {
  AttendFn found = nullptr;
  ((found = (Vs + 1 == vectors ? &attend<Vs + 1> : found)), ...);
  return found;
}

}  // namespace

extern "C" {

int pegaserve_paged_attention_max_head_dim() { return kMaxVectors * kLanes; }

void pegaserve_paged_attention(const float* q, const float* kv, int64_t num_blocks, int64_t block_size,
                               int64_t num_kv_heads, int64_t head_dim, int64_t num_heads, const int64_t* block_tables,
                               int64_t max_blocks, const int64_t* context_lens, const int64_t* query_starts,
                               const int64_t* query_lens, int64_t num_requests, float scale, float* out) {
  const AttendFn fn = attend_for(static_cast<int>(head_dim / kLanes), std::make_integer_sequence<int, kMaxVectors>{});
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t group = num_heads / num_kv_heads;
  for (int64_t r = 0; r < num_requests; ++r) {
    const int64_t* table = block_tables + r * max_blocks;
    for (int64_t j = 0; j < query_lens[r]; ++j) {
      const int64_t token = query_starts[r] + j;
      const int64_t num_keys = context_lens[r] - query_lens[r] + j + 1;
      for (int64_t h = 0; h < num_heads; ++h) {
        const int64_t kv_head = h / group;
        const Layout layout{kv + kv_head * head_dim, kv + num_blocks * block_size * token_stride + kv_head * head_dim,
                            block_size, token_stride};
        const int64_t at = (token * num_heads + h) * head_dim;
        fn(q + at, layout, table, num_keys, scale, out + at);
      }
    }
  }
}

}  // extern "C"
