// Paged attention on the CPU that reads K/V blocks in place through the block tables.
//
// One op for every step: each sequence brings n_b query tokens (1 for a decode, a chunk
// for a prefill) that sit at the end of its context of context_len_b tokens, and each
// query token attends causally to every cached position up to its own. Keys and values
// are read where they lie in the block pool (no gathered copy, no mask tensor); the
// query heads that share a KV head are handled together so each K/V row is loaded once
// for all of them; softmax is computed online (running max and sum) in float32.
//
// Shapes (all contiguous):
//   q            [T, H, D]           the step's query tokens, sequence after sequence
//   k_cache      [N, bs, KVH, D]     one layer's block pool (v_cache alike)
//   block_tables [B, NB] int64       block ids of each sequence, rows padded with any id
//   query_start  [B + 1] int64       sequence b's queries are rows query_start[b] .. [b+1]
//   context_lens [B] int64           tokens in sequence b's context, its queries included
//   returns      [T, H, D]           in q's dtype
//
// Options of the model families: sliding_window w (a query at position i sees keys j with
// i - j < w) and logit_softcap c (scores become c * tanh(scores / c) before the softmax).
// Without them the tiled and decode paths serve; with either, the row-by-row path.
//
// It must not allocate per token, and it does not write the cache (write_kv does).

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Query tokens handled by one work item: enough to reuse each K/V block from L1 across
// them, few enough that a long prefill still splits into many items for the threads.
constexpr int64_t kQueryTile = 16;

template <typename scalar_t>
inline float dot_row(const float* q, const scalar_t* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename scalar_t>
inline void axpy_row(float* acc, float p, const scalar_t* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<float>(v[i]);
}

// Below this many (key, query row) pairs in a whole call, the step runs on one thread.
constexpr int64_t kSerialKeysTimesRows = 8192;

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;  // query tokens [q_begin, q_end) of this sequence, 0-based within it
  int64_t q_end;
};

// Rows of query heads whose scores are computed together against one transposed key
// block: eight independent accumulator chains keep both FMA ports busy.
constexpr int64_t kRowGroup = 8;
constexpr int64_t kBlock = 16;  // the tiled path's block size (the engine's default)

#if defined(__AVX512F__)
// Vector helpers of the tiled and decode paths (float32 and bfloat16 caches).

template <typename scalar_t>
inline __m512 load16(const scalar_t* p);

template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// a[o] holds partial sums of key o's score; returns the vector whose lane o is their total.
inline __m512 fold16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i .. 4i+3, one partial each
    const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                 _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

// One row's online-softmax step over a block: s holds its 16 scores, valid the keys it
// may see (the causal bound, the context's end: other lanes may hold anything and are set,
// not computed with); folds them into the running max m and sum l and adds the value rows
// (vb, token_stride apart) into acc_row, rescaled by the change of max.
template <typename scalar_t, int D>
inline void row_update(__m512 s, __mmask16 valid, int64_t n, float& m, float& l, float* acc_row,
                       const scalar_t* vb, int64_t token_stride) {
  constexpr int C = D / 16;  // vectors per head row
  s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
  const float mx = std::max(m, _mm512_reduce_max_ps(s));
  const __m512 e =
      _mm512_maskz_mov_ps(valid, wattserve::exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
  alignas(64) float p[kBlock];
  _mm512_store_ps(p, e);
  // The first block: m is -inf, and there is nothing to rescale.
  const float corr =
      m == -std::numeric_limits<float>::infinity() ? 0.f : wattserve::exp_approx(m - mx);
  l = l * corr + _mm512_reduce_add_ps(e);
  m = mx;
  __m512 out[C];
  const __m512 cv = _mm512_set1_ps(corr);
  for (int c = 0; c < C; ++c) out[c] = _mm512_mul_ps(_mm512_loadu_ps(acc_row + 16 * c), cv);
  for (int64_t o = 0; o < n; ++o) {
    const scalar_t* vr = vb + o * token_stride;
    const __m512 po = _mm512_set1_ps(p[o]);
    for (int c = 0; c < C; ++c) out[c] = _mm512_fmadd_ps(po, load16(vr + 16 * c), out[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_row + 16 * c, out[c]);
}

template <typename scalar_t>
constexpr bool kVectorTypes =
    std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
#endif  // __AVX512F__

// The tiled path: per key block, the block's keys are transposed once into kt[D][16] so
// that a row's 16 scores are one vector accumulated over D, exponentials are computed 16
// at a time, and each value row is added into every row's output accumulator while it sits
// in L1. Rows are the work item's (query token, query head) pairs, rows_padded of them in
// qf (a multiple of kRowGroup, the padding rows zero); row r is at position
// first_row_pos + r / G.
template <typename scalar_t, int64_t D>
void tiled_item(const float* qf, int64_t rows_padded, int64_t rows, int64_t G,
                int64_t first_row_pos, const scalar_t* kp, const scalar_t* vp,
                const int64_t* table, int64_t token_stride, int64_t block_stride,
                int64_t kv_head, float* acc, float* m, float* l, float* kt) {
  const int64_t last_pos = first_row_pos + (rows - 1) / G;
  alignas(64) float s[kRowGroup][kBlock];
  for (int64_t j = 0; j * kBlock <= last_pos; ++j) {
    const int64_t base = j * kBlock;
    const int64_t nk = std::min(kBlock, last_pos - base + 1);
    const scalar_t* kb = kp + table[j] * block_stride + kv_head * D;
    const scalar_t* vb = vp + table[j] * block_stride + kv_head * D;
    for (int64_t o = 0; o < kBlock; ++o) {
      const scalar_t* kr = kb + o * token_stride;
      for (int64_t d = 0; d < D; ++d) kt[d * kBlock + o] = o < nk ? static_cast<float>(kr[d]) : 0.f;
    }
    // Rows whose position is before this block see none of its keys.
    const int64_t first_row = std::max<int64_t>(0, (base - first_row_pos) * G);
    for (int64_t g0 = (first_row / kRowGroup) * kRowGroup; g0 < rows_padded; g0 += kRowGroup) {
      for (int64_t r = 0; r < kRowGroup; ++r)
#pragma omp simd
        for (int64_t o = 0; o < kBlock; ++o) s[r][o] = 0.f;
      const float* qg = qf + g0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const float* kd = kt + d * kBlock;
        for (int64_t r = 0; r < kRowGroup; ++r) {
          const float qv = qg[r * D + d];
#pragma omp simd
          for (int64_t o = 0; o < kBlock; ++o) s[r][o] += qv * kd[o];
        }
      }
      for (int64_t r = 0; r < kRowGroup && g0 + r < rows; ++r) {
        const int64_t row = g0 + r;
        const int64_t n = std::min(kBlock, first_row_pos + row / G - base + 1);  // causal
        if (n <= 0) continue;
#if defined(__AVX512F__)
        if constexpr (kVectorTypes<scalar_t>) {
          row_update<scalar_t, D>(_mm512_load_ps(s[r]), static_cast<__mmask16>((1u << n) - 1u),
                                  n, m[row], l[row], acc + row * D, vb, token_stride);
          continue;
        }
#endif
        float mx = m[row];
        for (int64_t o = 0; o < n; ++o) mx = std::max(mx, s[r][o]);
        alignas(64) float p[kBlock];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t o = 0; o < kBlock; ++o) {
          const float e = wattserve::exp_approx(s[r][o] - mx);
          p[o] = o < n ? e : 0.f;
          sum += p[o];
        }
        // The first block: m is -inf, and there is nothing to rescale.
        const float corr = m[row] == -std::numeric_limits<float>::infinity()
                               ? 0.f
                               : wattserve::exp_approx(m[row] - mx);
        float a[D];
        float* ar = acc + row * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] = ar[i] * corr;
        for (int64_t o = 0; o < n; ++o) {
          const scalar_t* vr = vb + o * token_stride;
          const float po = p[o];
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += po * static_cast<float>(vr[i]);
        }
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) ar[i] = a[i];
        m[row] = mx;
        l[row] = l[row] * corr + sum;
      }
    }
  }
}

#if defined(__AVX512F__)
// The decode path (one query token per item, the engine's 16-token blocks, head dim 64 or
// 128, up to 8 query heads per KV head). Decode attention reads each K/V row once for a
// handful of query rows, so it is bound by memory, not arithmetic: each row's 16 scores
// come from 16 dot products folded into one vector by a shuffle tree (no transposed copy
// of the block, no padding rows), and the next block's rows are prefetched while this one
// is computed (a block table scatters blocks across the pool, which defeats the hardware
// prefetcher at every block edge).
constexpr int kDecodeMaxG = 8;

// One decode item: G query rows (qf, scaled, G x D) against ctx keys of one KV head.
// Like tiled_item, it takes acc (G x D), m and l as the caller set them (zero, -inf,
// zero) and leaves the unnormalized outputs in acc and the softmax sums in l.
template <typename scalar_t, int D>
void decode_item(const float* qf, int G, int64_t ctx, const scalar_t* kp, const scalar_t* vp,
                 const int64_t* table, int64_t token_stride, int64_t block_stride,
                 int64_t kv_head, float* acc, float* m, float* l) {
  constexpr int C = D / 16;  // vectors per head row
  constexpr int kLine = 64 / sizeof(scalar_t);  // elements per cache line
  const int64_t nblocks = (ctx + kBlock - 1) / kBlock;
  for (int64_t j = 0; j < nblocks; ++j) {
    const int64_t nk = std::min<int64_t>(kBlock, ctx - j * kBlock);
    const scalar_t* kb = kp + table[j] * block_stride + kv_head * D;
    const scalar_t* vb = vp + table[j] * block_stride + kv_head * D;
    if (j + 1 < nblocks) {
      const scalar_t* kn = kp + table[j + 1] * block_stride + kv_head * D;
      const scalar_t* vn = vp + table[j + 1] * block_stride + kv_head * D;
      for (int64_t o = 0; o < kBlock; ++o)
        for (int c = 0; c < D; c += kLine) {
          _mm_prefetch(reinterpret_cast<const char*>(kn + o * token_stride + c), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vn + o * token_stride + c), _MM_HINT_T0);
        }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1u);
    for (int r = 0; r < G; ++r) {
      __m512 q[C];
      for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qf + r * D + 16 * c);
      __m512 a[kBlock];
      for (int64_t o = 0; o < kBlock; ++o) {
        const scalar_t* kr = kb + o * token_stride;
        __m512 s = _mm512_mul_ps(q[0], load16(kr));
        for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[c], load16(kr + 16 * c), s);
        a[o] = s;
      }
      row_update<scalar_t, D>(fold16(a), valid, nk, m[r], l[r], acc + r * D, vb, token_stride);
    }
  }
}
#endif  // __AVX512F__

// An item's normalized outputs into out: row i * G + h is query token i's head h.
template <typename scalar_t>
void write_rows(const WorkItem& it, scalar_t* op, const int64_t* qs, int64_t H, int64_t G,
                int64_t D, const float* acc, const float* l) {
  for (int64_t i = 0; i < it.q_end - it.q_begin; ++i) {
    scalar_t* dst = op + ((qs[it.seq] + it.q_begin + i) * H + it.kv_head * G) * D;
    for (int64_t h = 0; h < G; ++h) {
      const int64_t r = i * G + h;
      const float inv = 1.f / l[r];
      for (int64_t k = 0; k < D; ++k) dst[h * D + k] = static_cast<scalar_t>(acc[r * D + k] * inv);
    }
  }
}

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& query_start,
         const at::Tensor& context_lens, double scale, int64_t window, float softcap,
         at::Tensor& out) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH;  // query heads per KV head
  const int64_t B = context_lens.size(0), NB = block_tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t token_stride = KVH * D;  // between two tokens of a block
  const int64_t block_stride = bs * KVH * D;
  // The tiled path serves the engine's block size and the common head sizes without a
  // window or soft-cap; everything else takes the row-by-row path.
  const bool plain = window <= 0 && softcap <= 0.f;
  const bool tiled = plain && bs == kBlock && (D == 64 || D == 128);

  std::vector<WorkItem> work;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qs[b + 1] - qs[b];
    for (int64_t g = 0; g < KVH; ++g)
      for (int64_t t0 = 0; t0 < nq; t0 += kQueryTile)
        work.push_back({b, g, t0, std::min(nq, t0 + kQueryTile)});
  }

  // A step too small to pay for waking the other threads (one decode at a short context)
  // runs on this one: grain = all items.
  int64_t keys_x_rows = 0;
  for (const WorkItem& it : work) keys_x_rows += cl[it.seq] * (it.q_end - it.q_begin) * G;
  const int64_t items = static_cast<int64_t>(work.size());
  const int64_t grain = keys_x_rows < kSerialKeysTimesRows ? std::max<int64_t>(items, 1) : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    const int64_t rows_max = kQueryTile * G;
    const int64_t rows_cap = (rows_max + kRowGroup - 1) / kRowGroup * kRowGroup;
    std::vector<float> qf(rows_cap * D), acc(rows_cap * D), m(rows_cap), l(rows_cap);
    std::vector<float> s(bs), kt(tiled ? D * kBlock : 0);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem& it = work[w];
      const int64_t nq = qs[it.seq + 1] - qs[it.seq];
      const int64_t first_pos = cl[it.seq] - nq;  // position of the sequence's first query
      const int64_t rows = (it.q_end - it.q_begin) * G;
      for (int64_t i = 0; i < it.q_end - it.q_begin; ++i) {
        const scalar_t* src = qp + ((qs[it.seq] + it.q_begin + i) * H + it.kv_head * G) * D;
        for (int64_t j = 0; j < G * D; ++j)
          qf[i * G * D + j] = static_cast<float>(src[j]) * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t last_pos = first_pos + it.q_end - 1;
      const int64_t* table = bt + it.seq * NB;
#if defined(__AVX512F__)
      if constexpr (kVectorTypes<scalar_t>) {
        if (tiled && nq == 1 && G <= kDecodeMaxG) {
          if (D == 64)
            decode_item<scalar_t, 64>(qf.data(), G, cl[it.seq], kp, vp, table, token_stride,
                                      block_stride, it.kv_head, acc.data(), m.data(), l.data());
          else
            decode_item<scalar_t, 128>(qf.data(), G, cl[it.seq], kp, vp, table, token_stride,
                                       block_stride, it.kv_head, acc.data(), m.data(),
                                       l.data());
          write_rows(it, op, qs, H, G, D, acc.data(), l.data());
          continue;
        }
      }
#endif
      if (tiled) {
        const int64_t rows_padded = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
        std::fill(qf.begin() + rows * D, qf.begin() + rows_padded * D, 0.f);
        const int64_t row_pos = first_pos + it.q_begin;
        if (D == 64)
          tiled_item<scalar_t, 64>(qf.data(), rows_padded, rows, G, row_pos, kp, vp, table,
                                   token_stride, block_stride, it.kv_head, acc.data(), m.data(),
                                   l.data(), kt.data());
        else
          tiled_item<scalar_t, 128>(qf.data(), rows_padded, rows, G, row_pos, kp, vp, table,
                                    token_stride, block_stride, it.kv_head, acc.data(), m.data(),
                                    l.data(), kt.data());
      } else {
        // With a window, blocks wholly before the item's first row's window are skipped.
        const int64_t first_key =
            window > 0 ? std::max<int64_t>(0, first_pos + it.q_begin - window + 1) : 0;
        for (int64_t j = first_key / bs; j * bs <= last_pos; ++j) {
          const int64_t base = j * bs;
          const scalar_t* kb = kp + table[j] * block_stride + it.kv_head * D;
          const scalar_t* vb = vp + table[j] * block_stride + it.kv_head * D;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = first_pos + it.q_begin + r / G;
            const int64_t n = std::min(bs, pos - base + 1);  // causal: keys up to pos
            // the window: keys j with pos - j < window
            const int64_t o0 = window > 0 ? std::max<int64_t>(0, pos - window + 1 - base) : 0;
            if (n <= o0) continue;
            const float* qr = qf.data() + r * D;
            float mx = m[r];
            for (int64_t o = o0; o < n; ++o) {
              float so = dot_row(qr, kb + o * token_stride, D);
              if (softcap > 0.f) so = softcap * std::tanh(so / softcap);
              s[o] = so;
              mx = std::max(mx, so);
            }
            float* ar = acc.data() + r * D;
            const float corr = std::exp(m[r] - mx);  // exp(-inf) = 0 on the first block
            float sum = l[r] * corr;
            if (corr != 1.f) {
#pragma omp simd
              for (int64_t i = 0; i < D; ++i) ar[i] *= corr;
            }
            for (int64_t o = o0; o < n; ++o) {
              const float p = std::exp(s[o] - mx);
              sum += p;
              axpy_row(ar, p, vb + o * token_stride, D);
            }
            m[r] = mx;
            l[r] = sum;
          }
        }
      }
      write_rows(it, op, qs, H, G, D, acc.data(), l.data());
    }
  });
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& query_start, const at::Tensor& context_lens,
                               double scale, std::optional<int64_t> sliding_window,
                               std::optional<double> logit_softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [T, H, D], caches [N, bs, KVH, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_attention: q and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "paged_attention: dtype mismatch");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_attention: head_dim differs or H is not a multiple of KVH");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong,
              "paged_attention: block_tables, query_start, context_lens must be int64");
  TORCH_CHECK(query_start.size(0) == context_lens.size(0) + 1 &&
                  block_tables.size(0) == context_lens.size(0),
              "paged_attention: one block table and one context length per sequence");
  auto bt = block_tables.contiguous();
  auto qs = query_start.contiguous();
  auto cl = context_lens.contiguous();
  TORCH_CHECK(!sliding_window || *sliding_window >= 1,
              "paged_attention: sliding_window must be >= 1");
  TORCH_CHECK(!logit_softcap || *logit_softcap > 0.0,
              "paged_attention: logit_softcap must be > 0");
  const int64_t window = sliding_window.value_or(0);
  const float softcap = static_cast<float>(logit_softcap.value_or(0.0));
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    run<scalar_t>(q, k_cache, v_cache, bt, qs, cl, scale, window, softcap, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(wattserve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor context_lens, float scale, *, int? sliding_window=None, "
      "float? logit_softcap=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(wattserve, CPU, m) { m.impl("paged_attention", &paged_attention_cpu); }
