// Float32 linear y = x W^T (+ b) on AVX-512 for the token counts of decode steps.
//
// Weights come packed in panels of 32 output columns, each contiguous over the input
// features: packed[p][k][c] = W[32 p + c][k] ([Np / 32, K, 32], zero columns past N). A
// panel is read from memory once and walked by every tile of up to 12 rows, which holds
// its 12 x 32 outputs in 24 vector registers: each step over k loads two weight vectors
// and broadcasts one activation a row into 24 fused multiply-adds. Threads split the
// panels. The matmul library's packed kernel reaches about half the FMA peak at 16-64
// rows on this CPU kind; this layout keeps both FMA ports busy there.
//
// Shapes: x [M, K] float32 contiguous; packed as above; bias [N] or none; returns [M, N].
// It must not allocate beyond its output, and it does not pack (the Python side does).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // output columns per packed panel
constexpr int kRows = 12;       // rows per register tile

#if defined(__AVX512F__)
inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}

// Rows [0, MR) of x against one panel w ([K][32]) into y's columns [col0, col0 + 32) that
// are below N. pf: this tile's share of the next panel (nullptr: none), pf_lines cache
// lines of it, fetched while this tile computes: each panel streams from memory behind the
// arithmetic of every tile of the panel before it, not just the first.
template <int MR>
void tile(const float* x, int64_t K, const float* w, const float* pf, int64_t pf_lines,
          const float* bias, float* y, int64_t N, int64_t col0) {
  // One accumulator pair per row, the in-features summed in order: a row's result has
  // the same bits whatever tile (so whatever batch) it is computed in.
  const __mmask16 m0 = first_lanes(N - col0), m1 = first_lanes(N - col0 - 16);
  __m512 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  int64_t line = 0;  // the next line of pf to fetch: line * K <= k * pf_lines
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr)
      for (; line * K <= k * pf_lines && line < pf_lines; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(pf + line * 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(w + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(w + k * kPanel + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      c0[r] = _mm512_fmadd_ps(xb, w0, c0[r]);
      c1[r] = _mm512_fmadd_ps(xb, w1, c1[r]);
    }
  }
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + col0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + col0 + 16) : _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * N + col0, m0, _mm512_add_ps(b0, c0[r]));
    _mm512_mask_storeu_ps(y + r * N + col0 + 16, m1, _mm512_add_ps(b1, c1[r]));
  }
}

// One row (a single-stream decode) against S adjacent panels at once: S weight streams
// per thread keep more memory reads in flight than one, and no software prefetch is
// issued (the streams are sequential; measured here, fetching the next panel ahead cost
// the one-row case 10-50 %). Each column's sum runs over k in the same order as tile's,
// so the bits are the same as the tiled path's.
template <int S>
void row_panels(const float* x, int64_t K, const float* w, const float* bias, float* y,
                int64_t N, int64_t col0) {
  __m512 c0[S], c1[S];
  for (int s = 0; s < S; ++s) c0[s] = c1[s] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 xb = _mm512_set1_ps(x[k]);
    for (int s = 0; s < S; ++s) {
      const float* ws = w + s * K * kPanel + k * kPanel;
      c0[s] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(ws), c0[s]);
      c1[s] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(ws + 16), c1[s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    const int64_t c = col0 + s * kPanel;
    const __mmask16 m0 = first_lanes(N - c), m1 = first_lanes(N - c - 16);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias + c) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + c + 16) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y + c, m0, _mm512_add_ps(b0, c0[s]));
    _mm512_mask_storeu_ps(y + c + 16, m1, _mm512_add_ps(b1, c1[s]));
  }
}

// tile<rows> for a row count known only at run time (1 .. MR).
template <int MR>
void tile_n(int rows, const float* x, int64_t K, const float* w, const float* pf,
            int64_t pf_lines, const float* bias, float* y, int64_t N, int64_t col0) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR>(x, K, w, pf, pf_lines, bias, y, N, col0);
    tile_n<MR - 1>(rows, x, K, w, pf, pf_lines, bias, y, N, col0);
  }
}
#endif  // __AVX512F__

bool dense_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor dense_linear_cpu(const at::Tensor& x, const at::Tensor& packed,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(dense_linear_available(), "dense_linear: built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "dense_linear: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kPanel,
              "dense_linear: packed must be a contiguous float32 [Np / 32, K, 32]");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "dense_linear: x has ", K, " features, the weights ",
              packed.size(1));
  TORCH_CHECK(out_features > 0 && out_features <= panels * kPanel &&
                  out_features > (panels - 1) * kPanel,
              "dense_linear: out_features does not match the packed panels");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "dense_linear: bias must be a contiguous float32 [out_features]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, out_features}, x.options());
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t N = out_features;
  if (M == 1) {
    constexpr int kStreams = 4;  // panels a thread reads at once
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      int64_t p = begin;
      for (; p + kStreams <= end; p += kStreams)
        row_panels<kStreams>(xp, K, wp + p * K * kPanel, bp, yp, N, p * kPanel);
      for (; p < end; ++p) row_panels<1>(xp, K, wp + p * K * kPanel, bp, yp, N, p * kPanel);
    });
    return y;
  }
  // Rows split into equal tiles of at most kRows (27 rows: 9 + 9 + 9, not 12 + 12 + 3).
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t per_tile = tiles > 0 ? (M + tiles - 1) / tiles : 0;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* w = wp + p * K * kPanel;
      const int64_t col0 = p * kPanel;
      // The next panel of this thread, fetched in equal shares by this panel's tiles.
      const float* next = p + 1 < end ? w + K * kPanel : nullptr;
      const int64_t lines = K * kPanel / 16;  // 64-byte lines of a panel
      for (int64_t t = 0, r = 0; r < M; ++t, r += per_tile) {
        const int rows = static_cast<int>(std::min(per_tile, M - r));
        const int64_t share = lines / tiles;
        const float* pf = next ? next + t * share * 16 : nullptr;
        tile_n<kRows>(rows, xp + r * K, K, w, pf, share, bp, yp + r * N, N, col0);
      }
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wattserve, m) {
  m.def("dense_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("dense_linear_available() -> bool", &dense_linear_available);
}

TORCH_LIBRARY_IMPL(wattserve, CPU, m) { m.impl("dense_linear", &dense_linear_cpu); }
