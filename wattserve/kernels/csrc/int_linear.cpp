// Integer linears on the CPU's VNNI dot-product instruction: y = x @ W.T (+ b) with W
// stored as 8-bit or 4-bit unsigned codes and x quantized to int8 on the fly.
//
//   int_linear(x, packed, scales, zeros, bits, group_size, out_features, bias)
//
// Weights: w[n, k] = scales[g, n] * (code[n, k] - C) + zeros[g, n] with g = k / group_size
// and C the middle code, 128 for 8 bits and 8 for 4 bits (int8 level: code = q + 128, one
// group per row, zero 0; int4 levels: torch's convention, code 0..15). Scales and zeros
// are bfloat16 [groups, Np], as the levels store them. The codes are packed per block
// of 16 output columns so that one 64-byte load gives 16 columns x 4 consecutive k:
//   bits 8: packed[n / 16][k / 4][n % 16][k % 4]
//   bits 4: packed[n / 16][k / 8][n % 16][k % 4], low nibble k % 8 < 4, high nibble the rest
// (wattserve/kernels/int_linear.py builds this layout and the plain-torch reference).
// Activations: each row is quantized per 32 consecutive k to int8 with its own scale
// (amax / 127), so y[t, n] = sum over 32-groups of
//   a[t, j] * (scale[g, n] * dot(code, xq) + (zero[g, n] - C * scale[g, n]) * sum(xq)),
// a = amax / 127.
// The products are exact in int32; the sums over groups are float32.
// Why: torch's CPU int8/int4 weight-only kernels widen the weights to floats and re-read
// them for every 4 activation rows, so at 16 rows they are 2-3x slower than the bf16 GEMM;
// here a tile of up to 8 rows x 16 columns stays in registers and the weights are read once
// per 8 rows, 4 (int8) or 8 (int4) products per byte lane per instruction.
// Built only where the compiler targets AVX-512 VNNI (int_linear_available() says); it
// must not allocate anything but its output and the quantized activations.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WATTSERVE_INT_LINEAR 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kActGroup = 32;  // k per activation scale
constexpr int64_t kCols = 16;      // output columns per register tile
constexpr int kMaxRows = 8;        // activation rows per register tile

bool available() {
#ifdef WATTSERVE_INT_LINEAR
  return true;
#else
  return false;
#endif
}

#ifdef WATTSERVE_INT_LINEAR

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  // round to nearest even, as torch's float -> bfloat16 conversion (NaN not expected here)
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

inline __mmask16 tail_mask(int64_t left) {
  if (left <= 0) return 0;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// One row of x [K] -> int8 codes [Kp] (zero past K), and per 32-group the scale a = amax/127
// and a * sum(codes).
template <typename T>
void quantize_row(const T* x, int64_t K, int64_t Kp, int8_t* q, float* a, float* as) {
  for (int64_t g = 0; g * kActGroup < Kp; ++g) {
    const int64_t k0 = g * kActGroup;
    const __m512 v0 = load16(x + k0, tail_mask(K - k0));
    const __m512 v1 = load16(x + k0 + 16, tail_mask(K - k0 - 16));
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    a[g] = amax / 127.f;
    as[g] = a[g] * static_cast<float>(s);
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows x 16 columns over all of K. w: this column block's packed codes; sc/zp: the
// scales and zeros of its 16 columns for group 0 (the next group is `stride` further).
template <int R, int BITS, typename T>
void tile(const int8_t* xq, int64_t Kp, const float* a, const float* as, int64_t G,
          const uint8_t* w, const at::BFloat16* sc, const at::BFloat16* zp, int64_t stride,
          int64_t per_wgroup,
          const T* bias, T* y, int64_t ldy, __mmask16 m) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 center = _mm512_set1_ps(BITS == 8 ? 128.f : 8.f);
  for (int64_t g = 0; g < G; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * kActGroup;
    if constexpr (BITS == 8) {
      const uint8_t* wg = w + g * kActGroup * kCols;  // 8 loads of 64 bytes
      for (int j = 0; j < 8; ++j) {
        const __m512i wv = _mm512_loadu_si512(wg + j * 64);
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], wv, bcast4(xg + r * Kp + j * 4));
      }
    } else {
      const uint8_t* wg = w + g * kActGroup * kCols / 2;  // 4 loads of 64 bytes
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(wg + j * 64);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          dot[r] = _mm512_dpbusd_epi32(dot[r], lo, bcast4(xg + r * Kp + j * 8));
          dot[r] = _mm512_dpbusd_epi32(dot[r], hi, bcast4(xg + r * Kp + j * 8 + 4));
        }
      }
    }
    const int64_t wgroup = g / per_wgroup;
    const __m512 s = load16(sc + wgroup * stride, 0xFFFF);
    const __m512 o = _mm512_fnmadd_ps(center, s, load16(zp + wgroup * stride, 0xFFFF));
    for (int r = 0; r < R; ++r) {
      const __m512 sa = _mm512_mul_ps(s, _mm512_set1_ps(a[r * G + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), sa, acc[r]);
      acc[r] = _mm512_fmadd_ps(o, _mm512_set1_ps(as[r * G + g]), acc[r]);
    }
  }
  const __m512 b = bias ? load16(bias, m) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store16(y + r * ldy, _mm512_add_ps(acc[r], b), m);
}

template <int BITS, typename T>
void rows_tile(int rows, const int8_t* xq, int64_t Kp, const float* a, const float* as,
               int64_t G, const uint8_t* w, const at::BFloat16* sc, const at::BFloat16* zp,
               int64_t stride,
               int64_t per_wgroup, const T* bias, T* y, int64_t ldy, __mmask16 m) {
#define WATTSERVE_TILE(R) \
  tile<R, BITS, T>(xq, Kp, a, as, G, w, sc, zp, stride, per_wgroup, bias, y, ldy, m)
  switch (rows) {
    case 1: WATTSERVE_TILE(1); break;
    case 2: WATTSERVE_TILE(2); break;
    case 3: WATTSERVE_TILE(3); break;
    case 4: WATTSERVE_TILE(4); break;
    case 5: WATTSERVE_TILE(5); break;
    case 6: WATTSERVE_TILE(6); break;
    case 7: WATTSERVE_TILE(7); break;
    default: WATTSERVE_TILE(8); break;
  }
#undef WATTSERVE_TILE
}

template <int BITS, typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
         const at::Tensor& zeros, int64_t group_size, const c10::optional<at::Tensor>& bias,
         at::Tensor& y) {
  const int64_t T_ = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t Np = scales.size(1);
  const int64_t Kp = packed.numel() * (8 / BITS) / Np;
  const int64_t G = Kp / kActGroup;
  auto xq = at::empty({T_, Kp}, x.options().dtype(at::kChar));
  auto a = at::empty({T_, G}, x.options().dtype(at::kFloat));
  auto as = at::empty({T_, G}, x.options().dtype(at::kFloat));
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* ap = a.data_ptr<float>();
  float* asp = as.data_ptr<float>();
  at::parallel_for(0, T_, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, K)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t)
                       quantize_row(xp + t * K, K, Kp, qp + t * Kp, ap + t * G, asp + t * G);
                   });
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::BFloat16* sp = scales.data_ptr<at::BFloat16>();
  const at::BFloat16* zp = zeros.data_ptr<at::BFloat16>();
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const int64_t block_bytes = Kp * kCols * BITS / 8;
  const int64_t per_wgroup = group_size / kActGroup;
  const int64_t blocks = Np / kCols;
  // Small calls are split finely so both threads get work; each task is >= ~2k products.
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, T_ * Kp / 4));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb) {
      const int64_t n0 = cb * kCols;
      if (n0 >= N) break;
      const __mmask16 m = tail_mask(N - n0);
      for (int64_t t0 = 0; t0 < T_; t0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, T_ - t0));
        rows_tile<BITS, T>(rows, qp + t0 * Kp, Kp, ap + t0 * G, asp + t0 * G, G,
                           wp + cb * block_bytes, sp + n0, zp + n0, Np, per_wgroup,
                           bp ? bp + n0 : nullptr, yp + t0 * N + n0, N, m);
      }
    }
  });
}

#endif  // WATTSERVE_INT_LINEAR

at::Tensor int_linear_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t bits, int64_t group_size,
                          int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "int_linear: this build has no AVX-512 VNNI");
  TORCH_CHECK(bits == 8 || bits == 4, "int_linear: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int_linear: x must be a contiguous [T, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int_linear: packed codes must be contiguous uint8");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kBFloat16 &&
                  scales.is_contiguous() && zeros.sizes() == scales.sizes() &&
                  zeros.scalar_type() == at::kBFloat16 && zeros.is_contiguous(),
              "int_linear: scales and zeros must be contiguous bfloat16 [groups, Np]");
  const int64_t Np = scales.size(1);
  TORCH_CHECK(Np % kCols == 0 && out_features <= Np && out_features > 0,
              "int_linear: padded out-features must be a multiple of 16 and >= out_features");
  const int64_t Kp = packed.numel() * (8 / bits) / Np;
  TORCH_CHECK(Kp * Np * bits / 8 == packed.numel() && Kp % kActGroup == 0 && x.size(1) <= Kp,
              "int_linear: packed size does not match [Np, Kp] with Kp a multiple of 32 >= K");
  TORCH_CHECK(group_size % kActGroup == 0 && Kp % group_size == 0 &&
                  scales.size(0) == Kp / group_size,
              "int_linear: group size must divide K into scales.size(0) groups of 32k");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "int_linear: bias must be [out_features] of x's dtype");
  auto y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
#ifdef WATTSERVE_INT_LINEAR
  if (x.scalar_type() == at::kFloat) {
    if (bits == 8) run<8, float>(x, packed, scales, zeros, group_size, bias, y);
    else run<4, float>(x, packed, scales, zeros, group_size, bias, y);
  } else {
    if (bits == 8) run<8, at::BFloat16>(x, packed, scales, zeros, group_size, bias, y);
    else run<4, at::BFloat16>(x, packed, scales, zeros, group_size, bias, y);
  }
#endif
  return y;
}

bool int_linear_available_cpu() { return available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(wattserve, m) {
  m.def(
      "int_linear(Tensor x, Tensor packed, Tensor scales, Tensor zeros, int bits, "
      "int group_size, int out_features, Tensor? bias) -> Tensor");
  m.def("int_linear_available() -> bool", &int_linear_available_cpu);
}

TORCH_LIBRARY_IMPL(wattserve, CPU, m) { m.impl("int_linear", &int_linear_cpu); }
