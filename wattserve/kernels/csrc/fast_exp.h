// exp(x) in float32 that the compiler vectorizes (an `omp simd` loop of it becomes one
// vector instruction stream), shared by the C++ CPU kernels.
//
// x = n ln2 + f ln2 with |f| <= 1/2; 2^f from its degree-6 Taylor polynomial (relative
// error below 2e-7), 2^n from the exponent bits. x is clamped to [-87, 88], where float32
// neither overflows nor goes subnormal: inputs below -87 give about 1e-38 rather than 0,
// so a caller that needs exact zeros (masked scores) writes them itself. exp16 is the
// same in AVX-512 vectors, for kernels that write their vector code by hand.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace wattserve {

// 2^f on |f| <= 1/2: Taylor coefficients, highest degree first.
constexpr float kExp2Poly[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                2.4022651e-1f, 6.9314718e-1f, 1.f};
constexpr float kLog2e = 1.44269504f;

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * kLog2e;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// exp_approx, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2e));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

}  // namespace wattserve
