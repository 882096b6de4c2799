// The vector vocabulary of the engine's CPU kernels (csrc/*.cpp), for the instruction set they are
// built for (pegaserve/engine/cpu_kernels.py picks the flags): AVX-512 F/BW/VL (16 fp32 lanes, mask
// registers) or AVX2 + FMA + F16C (8 lanes, masks as all-ones lanes). The kernels are written once in these
// words; on AVX-512 each word is the one intrinsic the kernels used before this layer existed.
//
// Exactness does not depend on the width: a kernel's lanes are independent FMA chains in a fixed
// order, and what it sums across lanes (`reduce_add`) is summed in a fixed tree per width, so a
// result is the same bits on every run of one machine, whatever else is in the batch.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pegaserve {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
using Vec = __m512;
using IVec = __m512i;
using Mask = __mmask16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline Vec loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_store_ps(p, v); }
inline void storeu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
// kLanes IEEE half-precision values (their 16 bits, any alignment) as the fp32 values they are, exactly.
inline Vec load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }

// The first `valid` of the lanes.
inline Mask lane_mask(int64_t valid) {
  if (valid >= kLanes) return 0xFFFF;
  if (valid <= 0) return 0;
  return static_cast<Mask>((1u << valid) - 1u);
}
inline Mask both(Mask a, Mask b) { return a & b; }
inline Mask either(Mask a, Mask b) { return a | b; }
inline bool any(Mask m) { return m != 0; }
inline int count(Mask m) { return __builtin_popcount(m); }
inline uint32_t lane_bits(Mask m) { return m; }  // bit i: lane i
inline Mask less(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Mask greater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask at_least(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Mask equal(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline Vec select(Mask m, Vec if_not, Vec if_set) { return _mm512_mask_mov_ps(if_not, m, if_set); }
inline Vec load_or(Mask m, const float* p, Vec fill) { return _mm512_mask_loadu_ps(fill, m, p); }  // never faults off `m`
inline Vec loadz(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void store_masked(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
// Writes the lanes in `m`, in order, from `out` on; answers how many.
inline int compress_store(float* out, Mask m, Vec v) {
  _mm512_mask_compressstoreu_ps(out, m, v);
  return count(m);
}

inline IVec iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline IVec set1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec add_i(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec min_i(IVec a, IVec b) { return _mm512_min_epi32(a, b); }
inline IVec truncate(Vec v) { return _mm512_cvttps_epi32(v); }
inline Mask equal_i(IVec a, IVec b) { return _mm512_cmpeq_epi32_mask(a, b); }
inline IVec select_i(Mask m, IVec if_not, IVec if_set) { return _mm512_mask_mov_epi32(if_not, m, if_set); }
inline int32_t reduce_min_i(IVec v) { return _mm512_reduce_min_epi32(v); }
inline void store_i(int32_t* p, IVec v) { _mm512_store_si512(p, v); }  // 64-byte aligned

// p * 2^n for n integral.
inline Vec scale_by_exponent(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }
inline Vec round_nearest(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8;
using Vec = __m256;
using IVec = __m256i;
using Mask = __m256;  // a lane is in when all its bits are set (the sign bit is what blends read)

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
inline Vec loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_store_ps(p, v); }
inline void storeu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec load_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float reduce_add(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline Mask lane_mask(int64_t valid) {
  const int32_t n = valid >= kLanes ? kLanes : (valid <= 0 ? 0 : static_cast<int32_t>(valid));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline Mask both(Mask a, Mask b) { return _mm256_and_ps(a, b); }
inline Mask either(Mask a, Mask b) { return _mm256_or_ps(a, b); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline int count(Mask m) { return __builtin_popcount(_mm256_movemask_ps(m)); }
inline uint32_t lane_bits(Mask m) { return static_cast<uint32_t>(_mm256_movemask_ps(m)); }
inline Mask less(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline Mask greater(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask at_least(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline Mask equal(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }
inline Vec select(Mask m, Vec if_not, Vec if_set) { return _mm256_blendv_ps(if_not, if_set, m); }
inline Vec loadz(Mask m, const float* p) { return _mm256_maskload_ps(p, _mm256_castps_si256(m)); }  // never faults off `m`
inline Vec load_or(Mask m, const float* p, Vec fill) { return select(m, fill, loadz(m, p)); }
inline void store_masked(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, _mm256_castps_si256(m), v); }
inline int compress_store(float* out, Mask m, Vec v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  int n = 0;
  for (int bits = _mm256_movemask_ps(m); bits; bits &= bits - 1) out[n++] = lanes[__builtin_ctz(bits)];
  return n;
}

inline IVec iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline IVec set1_i(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec add_i(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec min_i(IVec a, IVec b) { return _mm256_min_epi32(a, b); }
inline IVec truncate(Vec v) { return _mm256_cvttps_epi32(v); }
inline Mask equal_i(IVec a, IVec b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
inline IVec select_i(Mask m, IVec if_not, IVec if_set) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_not), _mm256_castsi256_ps(if_set), m));
}
inline int32_t reduce_min_i(IVec v) {
  __m128i s = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_min_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_min_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}
inline void store_i(int32_t* p, IVec v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }  // 32-byte aligned

// p * 2^n for n integral, as scalef has it for p in [1/2, 2] (overflow to inf, underflow to 0 past
// +-252): two exact powers of two from their exponent bits, 2^floor(n/2) then the rest, the product
// rounded once but in the deepest underflow.
inline Vec scale_by_exponent(Vec p, Vec n) {
  const __m256i whole = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, set1(-252.0f)), set1(252.0f)));
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const auto power = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, power(half)), power(_mm256_sub_epi32(whole, half)));
}
inline Vec round_nearest(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

#else
#error "the kernels need AVX-512 F/BW/VL or AVX2 with FMA (pegaserve/engine/cpu_kernels.py picks the flags)"
#endif

// 2^x for x in [-126, 0] (callers clamp below): 2^n * p(f), n = round(x), |f| <= 1/2, p the degree-7
// Taylor polynomial of e^(f ln 2); within ~2 ulp of exp2 there.
inline Vec exp2(Vec x) {
  const Vec n = round_nearest(x);
  const Vec f = sub(x, n);
  Vec p = set1(1.5252733804059840e-05f);
  p = fmadd(p, f, set1(1.5403530393381609e-04f));
  p = fmadd(p, f, set1(1.3333558146428443e-03f));
  p = fmadd(p, f, set1(9.6181291076284772e-03f));
  p = fmadd(p, f, set1(5.5504108664821580e-02f));
  p = fmadd(p, f, set1(2.4022650695910071e-01f));
  p = fmadd(p, f, set1(6.9314718055994531e-01f));
  p = fmadd(p, f, set1(1.0f));
  return scale_by_exponent(p, n);
}

}  // namespace pegaserve
