// Row-wise elementwise steps of a Llama layer fused into one pass each, on the CPU.
//
//   rms_norm(x, w, eps)                 y = x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm(h, d, w, eps)          h += d (in place), then y = rms_norm(h, w, eps)
//   silu_mul(gu)                        gu = [gate | up] per row -> silu(gate) * up
//   rope_write_kv(qkv, cos, sin, kc, vc, slots, H, KVH)
//                                       per token row [q | k | v] of the fused projection:
//                                       q and k rotated (rotate-half convention), k and v
//                                       stored at the token's cache slot, q returned
//                                       contiguous as [T, H, D]
//   greedy_rows(logits)                 per float32 row: the first index of its largest
//                                       value, or -1 when the row holds a NaN or +inf or
//                                       nothing finite (torch's max(dim=-1) tracks the
//                                       index in every comparison and ran ~14x slower
//                                       than amax over a 49,152-token vocabulary here)
//
// Each row is read once and written once, in float32 arithmetic (bf16 rows are widened
// and the result rounded once), where the unfused torch calls make a pass and a tensor
// per operation: a single-stream decode step spends more in those calls' overhead than in
// their arithmetic. Rows are split over threads only when a call is large enough.
// It must not allocate anything but its output.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Elements below which a call runs on the calling thread alone.
constexpr int64_t kSerialElements = 32768;

int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, row_elements));
}

template <typename T>
inline void rms_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = static_cast<T>(static_cast<float>(x[i]) * inv * static_cast<float>(w[i]));
}

template <typename T>
inline void add_row(T* h, const T* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    h[i] = static_cast<T>(static_cast<float>(h[i]) + static_cast<float>(d[i]));
}

template <typename T>
inline void silu_mul_row(const T* g, const T* u, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gv = static_cast<float>(g[i]);
    y[i] = static_cast<T>(gv / (1.f + wattserve::exp_approx(-gv)) * static_cast<float>(u[i]));
  }
}

// y = x rotated by (cos, sin) of one position: the first and second halves of the head
// dimension are the pair's two coordinates.
template <typename T>
inline void rotate_head(const T* x, const T* c, const T* s, T* y, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    const float cv = static_cast<float>(c[i]), sv = static_cast<float>(s[i]);
    y[i] = static_cast<T>(x1 * cv - x2 * sv);
    y[i + half] = static_cast<T>(x2 * cv + x1 * sv);
  }
}

// (The loops live in the functions above: a pragma cannot stand inside the dispatch
// macros' arguments.)
void check_rows(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [T, n]");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              op, ": weight must be [n] of x's dtype");
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        rms_row(xp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
    });
  });
  return y;
}

at::Tensor add_rms_norm_cpu(at::Tensor& h, const at::Tensor& d, const at::Tensor& w,
                            double eps) {
  check_rows(h, w, "add_rms_norm");
  TORCH_CHECK(d.sizes() == h.sizes() && d.is_contiguous() && d.scalar_type() == h.scalar_type(),
              "add_rms_norm: the addend must match the residual");
  auto y = at::empty_like(h);
  const int64_t T = h.size(0), n = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, h.scalar_type(), "add_rms_norm", [&] {
    scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_row(hp + r * n, dp + r * n, n);
        rms_row(hp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return y;
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [T, 2 * n]");
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  auto y = at::empty({T, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * 2 * n;
        silu_mul_row(g, g + n, yp + r * n, n);
      }
    });
  });
  return y;
}

at::Tensor rope_write_kv_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                             int64_t H, int64_t KVH) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == KVH,
              "rope_write_kv: caches must be contiguous [N, bs, KVH, D]");
  const int64_t D = k_cache.size(3), half = D / 2, T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (H + 2 * KVH) * D &&
                  qkv.scalar_type() == k_cache.scalar_type(),
              "rope_write_kv: qkv must be a contiguous [T, (H + 2 KVH) D] of the cache's dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * half &&
                  sin.numel() == T * half && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "rope_write_kv: cos and sin must hold [T, D/2] of qkv's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong,
              "rope_write_kv: one int64 slot per token");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  auto sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "rope_write_kv: slot ", sp[t], " out of range");
  auto q = at::empty({T, H, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv", [&] {
    const scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* snp = sin.data_ptr<scalar_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t width = (H + 2 * KVH) * D;
    at::parallel_for(0, T, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xp + t * width;
        const scalar_t* c = cp + t * half;
        const scalar_t* sn = snp + t * half;
        for (int64_t h = 0; h < H; ++h) rotate_head(row + h * D, c, sn, qp + (t * H + h) * D, half);
        scalar_t* kd = kp + sp[t] * KVH * D;
        for (int64_t h = 0; h < KVH; ++h) rotate_head(row + (H + h) * D, c, sn, kd + h * D, half);
        std::memcpy(vp + sp[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(scalar_t));
      }
    });
  });
  return q;
}

// The row's first argmax, -1 for a NaN, a +inf or no finite value. Two passes: the
// maximum (and whether a NaN was seen), then the first position holding it (the row is
// in cache by then).
int64_t greedy_row(const float* x, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; k + 16 <= V; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  best = _mm512_reduce_max_ps(vmax);
  nan = unordered != 0;
#endif
  for (; k < V; ++k) {
    const float v = x[k];
    if (std::isnan(v)) nan = true;
    else if (v > best) best = v;
  }
  if (nan || !std::isfinite(best)) return -1;
  k = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; k + 16 <= V; k += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + k), target, _CMP_EQ_OQ);
    if (hit) return k + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; k < V; ++k)
    if (x[k] == best) return k;
  return -1;  // not reached: best is one of the row's values
}

at::Tensor greedy_rows_cpu(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "greedy_rows: logits must be a contiguous float32 [N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, row_grain(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = greedy_row(xp + r * V, V);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wattserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor addend, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, int num_heads, int num_kv_heads) -> Tensor");
  m.def("greedy_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(wattserve, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("rope_write_kv", &rope_write_kv_cpu);
  m.impl("greedy_rows", &greedy_rows_cpu);
}
