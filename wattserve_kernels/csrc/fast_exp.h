// exp(x) in float32 that the compiler vectorizes (an `omp simd` loop of it becomes one
// vector instruction stream), shared by the C++ CPU kernels.
//
// x = n ln2 + f ln2 with |f| <= 1/2; 2^f from its degree-6 Taylor polynomial (relative
// error below 2e-7), 2^n from the exponent bits. x is clamped to [-87, 88], where float32
// neither overflows nor goes subnormal: inputs below -87 give about 1e-38 rather than 0,
// so a caller that needs exact zeros (masked scores) writes them itself.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace wattserve {

inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * 1.44269504f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace wattserve
