// AVX-512 helpers shared by the engine's CPU kernels (csrc/*.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pegaserve {

constexpr int kLanes = 16;

// The first `valid` of 16 lanes.
inline __mmask16 lane_mask(int64_t valid) {
  if (valid >= kLanes) return 0xFFFF;
  if (valid <= 0) return 0;
  return static_cast<__mmask16>((1u << valid) - 1u);
}

// 2^x for x in [-126, 0] (callers clamp below): 2^n * p(f), n = round(x), |f| <= 1/2, p the degree-7
// Taylor polynomial of e^(f ln 2); within ~2 ulp of exp2 there.
inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381609e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace pegaserve
