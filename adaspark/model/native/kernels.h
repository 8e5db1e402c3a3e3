// Shared arithmetic of the native forward: float vectors for both builds, exp, fp16 K/V,
// quantised weights x int8 activations by rows, RMSNorm, RoPE and tree attention.
// Every function gives a row the same instruction sequence whatever the other rows are.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define ADASPARK_AVX512 1
static const char* kIsa = "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define ADASPARK_AVXVNNI 1  // 256-bit vpdpbusd (Alder Lake and later, Zen 5): the avx2 path's
static const char* kIsa = "avxvnni";  // float steps, one integer instruction a chunk
#elif defined(__AVX2__) && defined(__FMA__)
static const char* kIsa = "avx2";
#else
#error "build with AVX2 and FMA at least (build.py sets the flags)"
#endif

namespace adaspark {


constexpr int kBlock = 32;  // inputs per quantisation block

// --- float vectors: one set of names for both builds ---------------------------------------------

#ifdef ADASPARK_AVX512
using vf = __m512;
constexpr int W = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline float hmax(vf a) { return _mm512_reduce_max_ps(a); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vround(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf p, vf n) { return _mm512_scalef_ps(p, n); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline unsigned vgt_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // lane bits
inline unsigned vge_mask(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
#else
using vf = __m256;
constexpr int W = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline float hmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vround(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2n(vf p, vf n) {  // p * 2^n for n >= -126 (vexp clamps its input to keep it so)
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline unsigned vgt_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline unsigned vge_mask(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
#endif

// int32 lanes: float -> int32 rounding to nearest even (the default MXCSR mode, as
// std::nearbyint), stores as int8 (values already in -127..127), sums.
#ifdef ADASPARK_AVX512
using vi = __m512i;
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vi vround_i(vf a) { return _mm512_cvtps_epi32(a); }
inline vi vadd_i(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vsub_i(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vset1_i(int32_t x) { return _mm512_set1_epi32(x); }
inline vf vfloat(vi a) { return _mm512_cvtepi32_ps(a); }
inline int32_t vsum_i(vi a) { return _mm512_reduce_add_epi32(a); }
inline void vstore_i8(int8_t* p, vi a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a));
}
#else
using vi = __m256i;
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vi vround_i(vf a) { return _mm256_cvtps_epi32(a); }
inline vi vadd_i(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vsub_i(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vset1_i(int32_t x) { return _mm256_set1_epi32(x); }
inline vf vfloat(vi a) { return _mm256_cvtepi32_ps(a); }
inline int32_t vsum_i(vi a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
inline void vstore_i8(int8_t* p, vi a) {
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));
}
#endif

// exp by range reduction and a degree-6 polynomial (Cephes' expf), ~2 ulp; inputs below -87
// are clamped (their exp underflows softmax weights to nothing anyway).
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vpow2n(p, n);
}

// fp16 <-> fp32 for the K/V cache (IEEE round to nearest even both ways).
#ifdef ADASPARK_AVX512
inline vf vload_h(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore_h(uint16_t* p, vf a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
#else
inline vf vload_h(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore_h(uint16_t* p, vf a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// Dot of two float vectors of length n (a multiple of W), one fixed order.
inline float vdot(const float* a, const float* b, int64_t n) {
  vf acc = vzero();
  for (int64_t i = 0; i < n; i += W) acc = vfma(vload(a + i), vload(b + i), acc);
  return vsum(acc);
}

// y[r * ldy + o] = vdot(x row r, w row o) for rows [0, rows) and outputs [o0, o1), rows of
// length k: 4 x 4 pairs at a time share their loads, each pair keeping vdot's own steps (one
// accumulator, chunks in order, then vsum), so every value is bit-identical to vdot's.
inline void vdots(const float* x, int64_t rows, const float* w, int64_t o0, int64_t o1,
                  int64_t k, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    int64_t o = o0;
    for (; o + 4 <= o1; o += 4) {
      vf acc[4][4];
      for (auto& row : acc)
        for (vf& v : row) v = vzero();
      for (int64_t c = 0; c < k; c += W) {
        vf xs[4], ws[4];
        for (int i = 0; i < 4; ++i) xs[i] = vload(x + (r + i) * k + c);
        for (int j = 0; j < 4; ++j) ws[j] = vload(w + (o + j) * k + c);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) acc[i][j] = vfma(xs[i], ws[j], acc[i][j]);
      }
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) y[(r + i) * ldy + o + j] = vsum(acc[i][j]);
    }
    for (; o < o1; ++o)
      for (int i = 0; i < 4; ++i) y[(r + i) * ldy + o] = vdot(x + (r + i) * k, w + o * k, k);
  }
  for (; r < rows; ++r)
    for (int64_t o = o0; o < o1; ++o) y[r * ldy + o] = vdot(x + r * k, w + o * k, k);
}

// Index of the largest of x[0, n), the lowest among equal maxima (std::max_element's answer):
// a vector pass for the value, then the first lane that holds it.
inline int64_t argmax_first(const float* x, int64_t n) {
  if (n < W) return std::max_element(x, x + n) - x;
  vf top = vload(x);
  int64_t i = W;
  for (; i + W <= n; i += W) top = vmax(top, vload(x + i));
  float best = hmax(top);
  for (; i < n; ++i) best = std::max(best, x[i]);
  for (int64_t at = 0; at < n; ++at)
    if (x[at] == best) return at;
  return std::max_element(x, x + n) - x;  // NaNs: the value compares equal nowhere
}

// Calls f(i) for every i in [0, n) with (x[i] + a) + y[i] * s >= t, in increasing order: one
// vector compare per W values (a tail is padded), so every i takes the same float steps.
template <class F>
inline void for_each_reaching(const float* x, const float* y, float a, float s, float t,
                              int64_t n, F f) {
  const vf av = vset1(a), sv = vset1(s), tv = vset1(t);
  auto lanes = [&](const float* xs, const float* ys, int64_t i0) {
    unsigned bits = vge_mask(vadd(vadd(vload(xs), av), vmul(vload(ys), sv)), tv);
    for (; bits; bits &= bits - 1) f(i0 + __builtin_ctz(bits));
  };
  int64_t i = 0;
  for (; i + W <= n; i += W) lanes(x + i, y + i, i);
  if (i < n) {
    alignas(64) float xt[W], yt[W];
    for (int j = 0; j < W; ++j) {
      xt[j] = i + j < n ? x[i + j] : -INFINITY;
      yt[j] = i + j < n ? y[i + j] : 0.0f;
    }
    lanes(xt, yt, i);
  }
}

// The s best of x[0, n) best first, ties to the lower index (std::partial_sort's answer under
// that order): one pass keeps a heap of the s best so far, and a vector compare skips the
// lanes that cannot enter it (a later index must be strictly larger to beat an equal one).
inline void top_indices(const float* x, int64_t n, int64_t s, std::vector<int64_t>& out) {
  TORCH_CHECK(s >= 1 && s <= n, "top_indices: need 1 <= s <= n");
  auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  out.resize(s);
  std::iota(out.begin(), out.end(), 0);
  std::make_heap(out.begin(), out.end(), better);  // front: the worst kept
  auto enter = [&](int64_t i) {
    if (x[i] <= x[out.front()]) return;
    std::pop_heap(out.begin(), out.end(), better);
    out.back() = i;
    std::push_heap(out.begin(), out.end(), better);
  };
  int64_t i = s;
  for (; i < n && i % W; ++i) enter(i);
  for (; i + W <= n; i += W) {
    unsigned bits = vgt_mask(vload(x + i), vset1(x[out.front()]));
    while (bits) {
      enter(i + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; i < n; ++i) enter(i);
  std::sort_heap(out.begin(), out.end(), better);
}

// --- quantised weights and activations ----------------------------------------------------------

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// A [n, k] weight in groups of 16 outputs: per group and block of 32 inputs, the 16 outputs'
// unsigned integers u (value d*u + m) in 8 chunks of 4 inputs, each chunk 64 bytes (4 per
// output), so one vector op multiplies a chunk of 4 inputs into 16 outputs at once and the
// outputs stay in separate lanes (no horizontal sums). bits 4: chunks 2i and 2i+1 share 64
// bytes as low and high nibbles. d, m: fp16 [groups, blocks, 16] (GGUF's own fp16 scales).
// zero: where every m is -zero*d (Q8_0: 128, Q4_0: 8) a block's dot is d*dx*(sum(u*q) -
// zero*sum(q)), all in integers but one product; 0 where m is free (Q4_1): the m term in float.
struct QWeight {
  int64_t bits, n, k, nb, groups, zero;
  torch::Tensor q, d, m;
  const uint8_t* qp;  // raw pointers, read once: data_ptr() checks types on every call
  const uint16_t *dp, *mp;

  QWeight(int64_t bits_, int64_t n_, int64_t k_, torch::Tensor q_, torch::Tensor d_,
          torch::Tensor m_, int64_t zero_)
      : bits(bits_), n(n_), k(k_), zero(zero_), q(q_.contiguous()), d(d_.contiguous()),
        m(m_.contiguous()) {
    TORCH_CHECK(bits == 4 || bits == 8, "weight bits must be 4 or 8");
    TORCH_CHECK(zero == 0 || zero == 1 << (bits - 1), "zero must be 0 or the middle of u's range");
    TORCH_CHECK(k % kBlock == 0, "weight inputs must be a multiple of 32");
    nb = k / kBlock;
    groups = (n + 15) / 16;
    TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.numel() == groups * nb * block_bytes(),
                "packed weight has the wrong size");
    TORCH_CHECK(d.scalar_type() == torch::kHalf && d.numel() == groups * nb * 16,
                "scales: wrong size");
    TORCH_CHECK(m.scalar_type() == torch::kHalf && m.numel() == groups * nb * 16,
                "minimums: wrong size");
    qp = q.data_ptr<uint8_t>();
    dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  }
  int64_t block_bytes() const { return 16 * kBlock * bits / 8; }  // one block of 16 outputs
};

// Block b of group g's packed weights and scales, asked for ahead of their use: the hardware
// prefetcher alone leaves the kernels waiting on memory between groups.
inline void prefetch_block(const QWeight& w, int64_t g, int64_t b) {
  if (g >= w.groups) return;
  const char* q = reinterpret_cast<const char*>(w.qp + (g * w.nb + b) * w.block_bytes());
  for (int64_t i = 0; i < w.block_bytes(); i += 64) _mm_prefetch(q + i, _MM_HINT_T0);
  const int64_t at = (g * w.nb + b) * 16;
  _mm_prefetch(reinterpret_cast<const char*>(w.dp + at), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w.mp + at), _MM_HINT_T0);
}

// All of group g at once (the tile path, and a thread's first group); the VNNI path asks for
// the next group a block at a time instead, which keeps the requests in flight few and steady.
inline void prefetch_group(const QWeight& w, int64_t g) {
  for (int64_t b = 0; b < w.nb; ++b) prefetch_block(w, g, b);
}

// Rows of activations quantised per block of 32: q int8 [rows, k], dx [rows, nb], the integer
// sums qs = sum(q) [rows, nb] and xs = dx * qs.
struct QAct {
  int64_t rows = 0, k = 0, nb = 0;
  std::vector<int8_t> q;
  std::vector<int32_t> qs;
  std::vector<float> dx, xs;
};

// Per-row work between the matmuls, f(r) for rows [0, n): on both threads when the call has
// enough rows to pay for a parallel region. Each row runs the same code on either thread.
template <class F>
void for_rows(int64_t n, const F& f) {
  constexpr int64_t kRowsPerThread = 4;
  if (n < 2 * kRowsPerThread) {
    for (int64_t r = 0; r < n; ++r) f(r);
    return;
  }
  at::parallel_for(0, n, kRowsPerThread, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// Calls f(i, ahead, first) for every i in [0, n), each on one of torch's threads: ahead is the
// index the same thread takes next (-1 if none: what to prefetch), first whether i is the
// thread's first. The threads claim indices a few at a time from a shared counter instead of
// taking a fixed half each, so a thread slowed by another process on its core takes fewer and
// the call does not wait for it (a static split runs at the pace of the slowest core). Which
// thread computes an index changes nothing in its result. begin() / end() run once per thread.
struct Nothing {
  void operator()() const {}
};
template <class F, class Begin = Nothing, class End = Nothing>
void for_claimed(int64_t n, const F& f, const Begin& begin = {}, const End& end = {}) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const int64_t claim = std::max<int64_t>(1, (n + 8 * threads - 1) / (8 * threads));  // ~8 each
  std::atomic<int64_t> counter{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    begin();
    bool first = true;
    for (int64_t at = counter.fetch_add(claim); at < n;) {
      const int64_t next = counter.fetch_add(claim);  // claimed ahead, for the prefetch
      const int64_t stop = std::min(at + claim, n);
      for (int64_t i = at; i < stop; ++i, first = false)
        f(i, i + 1 < stop ? i + 1 : (next < n ? next : -1), first);
      at = next;
    }
    end();
  });
}

// Sizes a for rows x k activations (kept between calls: no page faults per call).
void prepare_rows(int64_t rows, int64_t k, QAct& a) {
  const int64_t nb = k / kBlock;
  a.rows = rows;
  a.k = k;
  a.nb = nb;
  a.q.resize(rows * k);
  a.dx.resize(rows * nb);
  a.qs.resize(rows * nb);
  a.xs.resize(rows * nb);
}

// Row r of a (prepared) from its k floats xr.
void quantize_row(const float* xr, int64_t r, QAct& a) {
  const int64_t nb = a.nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = xr + b * kBlock;
    vf top = vzero();
    for (int i = 0; i < kBlock; i += W) top = vmax(top, vabs(vload(xb + i)));
    const float amax = hmax(top);
    const float d = amax / 127.0f;
    const vf id = vset1(d > 0.0f ? 127.0f / amax : 0.0f);
    int8_t* qb = a.q.data() + r * a.k + b * kBlock;
    vi sum = vround_i(vzero());
    for (int i = 0; i < kBlock; i += W) {  // clamping before rounding: the same integers
      const vi q = vround_i(vmin(vmax(vmul(vload(xb + i), id), vset1(-127.0f)), vset1(127.0f)));
      vstore_i8(qb + i, q);
      sum = vadd_i(sum, q);
    }
    const int32_t total = vsum_i(sum);
    a.dx[r * nb + b] = d;
    a.qs[r * nb + b] = total;
    a.xs[r * nb + b] = d * static_cast<float>(total);
  }
}

void quantize_rows(const float* x, int64_t rows, int64_t k, QAct& a) {
  prepare_rows(rows, k, a);
  for_rows(rows, [&](int64_t r) { quantize_row(x + r * k, r, a); });
}

inline int32_t chunk_of(const int8_t* p) {  // 4 int8 inputs as one 32-bit lane value
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc + block b's contribution to row r from its integer sums s = sum(u*q) over W outputs
// whose scales are dw, mw: d*dx*(s - zero*sum(q)), or d*dx*s + m*dx*sum(q) without a zero.
// Every path (VNNI, AVX2, AMX) ends a block here, so a row's float steps are one sequence.
// centred: s already holds sum((u - zero)*q) (plain AVX2's Q8_0 dot), the same integer as
// s - zero*sum(q), so the float steps that follow are the same too.
inline vf add_block(vf acc, vi s, vf dw, vf mw, const QWeight& w, const QAct& a, int64_t r,
                    int64_t b, bool centred = false) {
  const int64_t at = r * a.nb + b;
  const vf scale = vmul(dw, vset1(a.dx[at]));
  if (centred) return vfma(vfloat(s), scale, acc);
  if (w.zero)
    return vfma(vfloat(vsub_i(s, vset1_i(static_cast<int32_t>(w.zero) * a.qs[at]))), scale, acc);
  return vfma(mw, vset1(a.xs[at]), vfma(vfloat(s), scale, acc));
}

// y[r, 16g .. 16g+15] for rows [r0, r0+R): the group's weights are unpacked once per block
// for all R rows; each (row, output) adds its blocks in order, in its own lane.
template <int R>
inline void group_rows(const QWeight& w, const QAct& a, int64_t g, int64_t r0, float* y,
                       int64_t ldy, int64_t ahead = -1) {
#ifdef ADASPARK_AVX512
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    if (ahead >= 0) prefetch_block(w, ahead, b);
    const uint8_t* qb = w.qp + (g * w.nb + b) * w.block_bytes();
    __m512i u[8];
    if (w.bits == 4) {
      for (int i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(qb + 64 * i);
        u[2 * i] = _mm512_and_si512(v, low4);
        u[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    } else {
      for (int i = 0; i < 8; ++i) u[i] = _mm512_loadu_si512(qb + 64 * i);
    }
    const int64_t at = (g * w.nb + b) * 16;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dp + at)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mp + at)));
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + i;
      const int8_t* xb = a.q.data() + r * a.k + b * kBlock;
      // two chains of four: vpdpbusd's latency is not the limit (integer sums are exact, so
      // the split changes nothing in the result)
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(chunk_of(xb + 4 * j)));
        s1 = _mm512_dpbusd_epi32(s1, u[j + 1], _mm512_set1_epi32(chunk_of(xb + 4 * j + 4)));
      }
      acc[i] = add_block(acc[i], _mm512_add_epi32(s0, s1), dw, mw, w, a, r, b);
    }
  }
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i)
    _mm512_mask_storeu_ps(y + (r0 + i) * ldy + 16 * g, static_cast<__mmask16>((1u << valid) - 1), acc[i]);
#else
  // 8 outputs a register, so two halves of the group, each over all blocks (a half's 8 chunk
  // registers loaded once for R rows). Per row and chunk of 4 inputs, the integer sums (exact,
  // so every way of forming them gives the same result):
  // - AVX-VNNI: one vpdpbusd (u unsigned, q signed, 4 products into each int32 lane);
  // - AVX2, 4 bits: vpmaddubsw pairs (|u*q + u'*q'| <= 2*15*127) summed in int16 over the 8
  //   chunks (<= 30480, no saturation), widened once a block by vpmaddwd;
  // - AVX2, 8 bits around zero 128 (Q8_0): c = u - 128 as signed bytes, |c| (<= 128, read
  //   unsigned) times q carrying c's sign (|q| <= 127) in vpmaddubsw, pairs <= 2*128*127;
  // - AVX2, 8 bits with free minimums (4-bit parts widened): u as two nibbles.
  // One pass over both halves at once (each broadcast serving 16 outputs) was faster with the
  // weights in cache and slower streaming them, as a verify does (docs/native-forward.md).
  const __m256i low4 = _mm256_set1_epi8(0x0F);
#ifndef ADASPARK_AVXVNNI
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const bool centred = w.bits == 8 && w.zero == 128;
#else
  constexpr bool centred = false;
#endif
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
      if (ahead >= 0 && half == 0) prefetch_block(w, ahead, b);
      const uint8_t* qb = w.qp + (g * w.nb + b) * w.block_bytes() + 32 * half;
      __m256i u[8];
      if (w.bits == 4) {
        for (int i = 0; i < 4; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * i));
          u[2 * i] = _mm256_and_si256(v, low4);
          u[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      } else {
        for (int i = 0; i < 8; ++i) u[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * i));
      }
      const int64_t at = (g * w.nb + b) * 16 + 8 * half;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dp + at)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mp + at)));
      __m256i s[R];
      const int8_t* xb[R];
      for (int i = 0; i < R; ++i) xb[i] = a.q.data() + (r0 + i) * a.k + b * kBlock;
      auto x_of = [&](int i, int j) { return _mm256_set1_epi32(chunk_of(xb[i] + 4 * j)); };
#ifdef ADASPARK_AVXVNNI
      for (int i = 0; i < R; ++i) {  // two chains, as on the avx512 path
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
          s0 = _mm256_dpbusd_avx_epi32(s0, u[j], x_of(i, j));
          s1 = _mm256_dpbusd_avx_epi32(s1, u[j + 1], x_of(i, j + 1));
        }
        s[i] = _mm256_add_epi32(s0, s1);
      }
#else
      if (w.bits == 4) {
        for (int i = 0; i < R; ++i) s[i] = _mm256_maddubs_epi16(u[0], x_of(i, 0));
        for (int j = 1; j < 8; ++j)
          for (int i = 0; i < R; ++i)
            s[i] = _mm256_add_epi16(s[i], _mm256_maddubs_epi16(u[j], x_of(i, j)));
        for (int i = 0; i < R; ++i) s[i] = _mm256_madd_epi16(s[i], ones);
      } else if (centred) {
        for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          const __m256i c = _mm256_xor_si256(u[j], flip);  // the signed c = u - 128
          const __m256i mag = _mm256_abs_epi8(c);          // -128 gives 0x80: 128 unsigned
          for (int i = 0; i < R; ++i) {
            const __m256i sq = _mm256_sign_epi8(x_of(i, j), c);
            s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sq), ones));
          }
        }
      } else {
        for (int i = 0; i < R; ++i) s[i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {  // u = 16*hi + lo, each part in 0..15: no saturation
          const __m256i lo = _mm256_and_si256(u[j], low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(u[j], 4), low4);
          for (int i = 0; i < R; ++i) {
            const __m256i sl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x_of(i, j)), ones);
            const __m256i sh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x_of(i, j)), ones);
            s[i] = _mm256_add_epi32(s[i], _mm256_add_epi32(sl, _mm256_slli_epi32(sh, 4)));
          }
        }
      }
#endif
      for (int i = 0; i < R; ++i) acc[i] = add_block(acc[i], s[i], dw, mw, w, a, r0 + i, b, centred);
    }
    const int64_t valid = std::min<int64_t>(8, w.n - 16 * g - 8 * half);
    for (int i = 0; i < R && valid > 0; ++i) {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, acc[i]);
      std::memcpy(y + (r0 + i) * ldy + 16 * g + 8 * half, tmp, valid * 4);
    }
  }
#endif
}

#ifdef ADASPARK_AVX512
// --- AMX tiles (Sapphire Rapids and later, where the OS grants the tile state) ------------------
//
// One tile multiply (tdpbsud: int8 activations x uint8 weights, int32 sums) does a block of 32
// inputs for up to 16 rows x 16 outputs. The weights' packed layout is already the B tile's
// (8 chunks of 4 inputs x 16 outputs, 64 bytes each), loaded straight from the weight: a tile
// load of bytes just stored waits for the stores to retire, which costs more than the multiply
// (so 8-bit blocks are never rewritten first); 4-bit chunks are split into bytes in L1. The
// integer sums equal vpdpbusd's and the float steps per (row, 16 outputs) are group_rows' own,
// so a row comes out bit-identical on either path: which path a call takes (by its row count)
// cannot change a row.

// Whether this process may use AMX: the CPU has AMX-TILE and AMX-INT8, ADASPARK_AMX is not
// "off", and Linux grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1))
      return false;
    const char* env = std::getenv("ADASPARK_AMX");
    if (env && std::strcmp(env, "off") == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// Rows at least this many go through the tiles: below, vpdpbusd is as fast; from 5 rows it
// takes two passes over each group (4 + 1 rows) where one row tile takes them all.
constexpr int64_t kAmxMinRows = 5;

// Whether calls use the tiles: amx_usable() unless turned off (tests and benchmarks compare).
inline bool& amx_on() {
  static bool on = amx_usable();
  return on;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums [R rows x 16 outputs] int32 of four blocks; 4/5: activations [R x 32
// bytes]; 6/7: weights [8 x 64 bytes]. Four blocks in flight: the tile registers are not
// renamed, so fewer would leave each multiply and store waiting on the one before.
inline void amx_configure(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(R);
    cfg.colsb[t] = kBlock;
    cfg.rows[t + 2] = 8;
    cfg.colsb[t + 2] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Group g's B tiles, one per block (512 bytes each): the packed weight itself for 8 bits; for
// 4 bits every block's nibbles split into bytes in `bytes` [nb * 512] first, all before the
// first tile load reads them (a tile load waits for the stores before it to retire).
inline const uint8_t* weight_tiles(const QWeight& w, int64_t g, uint8_t* bytes) {
  const uint8_t* qg = w.qp + g * w.nb * w.block_bytes();
  if (w.bits == 8) return qg;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t i = 0; i < 4 * w.nb; ++i) {
    const __m512i v = _mm512_loadu_si512(qg + 64 * i);
    _mm512_store_si512(bytes + 128 * i, _mm512_and_si512(v, low4));
    _mm512_store_si512(bytes + 128 * i + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
  return bytes;
}

// acc[i] += block b's contribution to row r0+i, from its integer sums (group_rows' steps).
template <int R>
inline void scale_block(const QWeight& w, const QAct& a, int64_t g, int64_t b, int64_t r0,
                        const int32_t* sums, __m512* acc) {
  const int64_t at = (g * w.nb + b) * 16;
  const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dp + at)));
  const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mp + at)));
  for (int i = 0; i < R; ++i)
    acc[i] = add_block(acc[i], _mm512_load_si512(sums + 16 * i), dw, mw, w, a, r0 + i, b);
}

// Block b's integer sums into tile C: activations through tile A, weights through tile B.
#define ADASPARK_AMX_BLOCK(C, A, B, b)            \
  do {                                            \
    _tile_zero(C);                                \
    _tile_loadd(A, x + (b) * kBlock, a.k);        \
    _tile_loadd(B, tiles + (b) * 512, 64);        \
    _tile_dpbsud(C, A, B);                        \
  } while (0)

// y[r, 16g .. 16g+15] for rows [r0, r0+R), R <= 16, tiles configured for R rows, the group's
// B tiles from weight_tiles. Blocks are added to each accumulator in order, as in group_rows.
template <int R>
void group_rows_amx(const QWeight& w, const QAct& a, int64_t g, const uint8_t* tiles,
                    int64_t r0, float* y, int64_t ldy) {
  alignas(64) int32_t sums[4][16 * 16];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x = a.q.data() + r0 * a.k;
  int64_t b = 0;
  for (; b + 4 <= w.nb; b += 4) {
    ADASPARK_AMX_BLOCK(0, 4, 6, b);
    ADASPARK_AMX_BLOCK(1, 5, 7, b + 1);
    ADASPARK_AMX_BLOCK(2, 4, 6, b + 2);
    ADASPARK_AMX_BLOCK(3, 5, 7, b + 3);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int j = 0; j < 4; ++j) scale_block<R>(w, a, g, b + j, r0, sums[j], acc);
  }
  const int64_t left = w.nb - b;
  if (left > 0) ADASPARK_AMX_BLOCK(0, 4, 6, b);
  if (left > 1) ADASPARK_AMX_BLOCK(1, 5, 7, b + 1);
  if (left > 2) ADASPARK_AMX_BLOCK(2, 4, 6, b + 2);
  if (left > 0) _tile_stored(0, sums[0], 64);
  if (left > 1) _tile_stored(1, sums[1], 64);
  if (left > 2) _tile_stored(2, sums[2], 64);
  for (int j = 0; j < left; ++j) scale_block<R>(w, a, g, b + j, r0, sums[j], acc);
  const int64_t valid = std::min<int64_t>(16, w.n - 16 * g);
  for (int i = 0; i < R; ++i)
    _mm512_mask_storeu_ps(y + (r0 + i) * ldy + 16 * g, static_cast<__mmask16>((1u << valid) - 1), acc[i]);
}
#undef ADASPARK_AMX_BLOCK

template <int... Rs>
void amx_rows_dispatch(int64_t R, const QWeight& w, const QAct& a, int64_t g,
                       const uint8_t* tiles, int64_t r0, float* y, int64_t ldy,
                       std::integer_sequence<int, Rs...>) {
  ((R == Rs + 1 ? (group_rows_amx<Rs + 1>(w, a, g, tiles, r0, y, ldy), 0) : 0), ...);
}

// Every row through the tiles: ceil(rows / 16) row tiles of R = ceil(rows / tiles) rows, the
// last one ending at the last row (rows two tiles share come out the same from both).
void qmatmul_amx(const QWeight& w, const QAct& a, float* y, int64_t ldy) {
  const int64_t count = (a.rows + 15) / 16, R = (a.rows + count - 1) / count;
  thread_local std::vector<uint8_t> raw;  // the group's 4-bit blocks as bytes, 64-aligned
  auto group = [&](int64_t g, int64_t ahead, bool first) {
    if (first) prefetch_group(w, g);
    if (ahead >= 0) prefetch_group(w, ahead);
    uint8_t* bytes = raw.data() + (-reinterpret_cast<uintptr_t>(raw.data()) & 63);
    const uint8_t* tiles = weight_tiles(w, g, bytes);
    for (int64_t t = 0; t < count; ++t)
      amx_rows_dispatch(R, w, a, g, tiles, std::min(t * R, a.rows - R), y, ldy,
                        std::make_integer_sequence<int, 16>{});
  };
  for_claimed(w.groups, group, [&] {
    amx_configure(R);  // tile state is per thread
    raw.resize(w.nb * 512 + 64);
  }, [] { _tile_release(); });
}
#endif

// y [rows, w.n] (row stride ldy) = x W^T for activations already quantised.
void qmatmul_into(const QWeight& w, const QAct& a, float* y, int64_t ldy) {
  TORCH_CHECK(a.k == w.k, "activation width differs from the weight's inputs");
  constexpr int R = 4;
#ifdef ADASPARK_AVX512
  if (a.rows >= kAmxMinRows && amx_on()) return qmatmul_amx(w, a, y, ldy);
#endif
  for_claimed(w.groups, [&](int64_t g, int64_t ahead, bool first) {
    if (first) prefetch_group(w, g);
    int64_t r = 0;  // the first pass over this group asks for the thread's next
    for (; r + R <= a.rows; r += R, ahead = -1) group_rows<R>(w, a, g, r, y, ldy, ahead);
    switch (a.rows - r) {
      case 3: group_rows<3>(w, a, g, r, y, ldy, ahead); break;
      case 2: group_rows<2>(w, a, g, r, y, ldy, ahead); break;
      case 1: group_rows<1>(w, a, g, r, y, ldy, ahead); break;
      default: break;
    }
  });
}

torch::Tensor qmatmul(const QWeight& w, torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k && x.scalar_type() == torch::kFloat,
              "x must be float32 [rows, ", w.k, "]");
  x = x.contiguous();
  QAct a;
  quantize_rows(x.data_ptr<float>(), x.size(0), w.k, a);
  auto y = torch::empty({x.size(0), w.n}, torch::kFloat);
  qmatmul_into(w, a, y.data_ptr<float>(), w.n);
  return y;
}

// Doubles, W/2 lanes: half a float vector widened, fma, the lanes summed by a fixed tree.
#ifdef ADASPARK_AVX512
using vd = __m512d;
inline vd vd_zero() { return _mm512_setzero_pd(); }
inline vd vd_widen(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline vd vd_fma(vd a, vd b, vd c) { return _mm512_fmadd_pd(a, b, c); }
inline double vd_sum(vd a) { return _mm512_reduce_add_pd(a); }
#else
using vd = __m256d;
inline vd vd_zero() { return _mm256_setzero_pd(); }
inline vd vd_widen(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline vd vd_fma(vd a, vd b, vd c) { return _mm256_fmadd_pd(a, b, c); }
inline double vd_sum(vd a) {
  const __m128d t = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}
#endif

// Sum of squares of n floats (a multiple of W) in double, in one fixed order.
inline double sum_squares(const float* x, int64_t n) {
  vd lo = vd_zero(), hi = vd_zero();
  for (int64_t i = 0; i < n; i += W) {
    const vd a = vd_widen(x + i), b = vd_widen(x + i + W / 2);
    lo = vd_fma(a, a, lo);
    hi = vd_fma(b, b, hi);
  }
  return vd_sum(lo) + vd_sum(hi);
}

inline void rms_norm_row(const float* xr, const float* w, float* out, int64_t dim, float eps) {
  const vf scale = vset1(static_cast<float>(1.0 / std::sqrt(sum_squares(xr, dim) / dim + eps)));
  for (int64_t i = 0; i < dim; i += W) vstore(out + i, vmul(vmul(vload(xr + i), scale), vload(w + i)));
}

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t dim,
                   float eps) {
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * dim, w, out + r * dim, dim, eps);
}

// x += y over n floats (n a multiple of W).
inline void add_into(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += W) vstore(x + i, vadd(vload(x + i), vload(y + i)));
}

// Attention geometry: query heads share kv heads in groups (GQA).
struct Heads {
  int64_t heads, kv_heads, hd;
};

// K and V rows (float, kv_heads * hd each) into their fp16 cache slot `slot` of one layer.
inline void store_kv(const Heads& hs, const float* k, const float* v, uint16_t* kl, uint16_t* vl,
                     int64_t slot, int64_t capacity) {
  for (int64_t g = 0; g < hs.kv_heads; ++g) {
    uint16_t* kd = kl + (g * capacity + slot) * hs.hd;
    uint16_t* vd = vl + (g * capacity + slot) * hs.hd;
    for (int64_t i = 0; i < hs.hd; i += W) {
      vstore_h(kd + i, vload(k + g * hs.hd + i));
      vstore_h(vd + i, vload(v + g * hs.hd + i));
    }
  }
}

// RoPE on adjacent pairs (x0, x1) of one head vector, cos/sin of its position.
inline void rope_pairs(float* v, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * cs[i] - x1 * sn[i];
    v[2 * i + 1] = x1 * cs[i] + x0 * sn[i];
  }
}

// W dot products at once: p[j] holds slot j's lane-wise partial sums; lane j of the result is
// their total, by one fixed tree per slot (pairs inside each 128-bit lane, then across lanes)
// whatever the other slots are.
#ifdef ADASPARK_AVX512
inline vf sum_lanes(const vf* p) {
  vf a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]),
                         _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)  // 128-bit lanes (0,1) and (2,3) of each b
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#else
inline vf sum_lanes(const vf* p) {
  vf a[4], b[2];
  for (int j = 0; j < 4; ++j)
    a[j] = _mm256_add_ps(_mm256_unpacklo_ps(p[2 * j], p[2 * j + 1]),
                         _mm256_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d x = _mm256_castps_pd(a[2 * j]), y = _mm256_castps_pd(a[2 * j + 1]);
    b[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                       _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif

// Softmax attention over each query's visible slots: the committed ones, then its row's
// ancestors in the call in row order (parents precede children, so the i-th visible slot holds
// position i). A task takes one kv head and kQueries of the queries that share it (row-major
// over (row, head in the group)), so each committed K/V slot is converted from fp16 once for
// them all. Scores come W slots at a time (sum_lanes); every query sums its dots, exps and
// weighted values in one fixed order per slot, so a row's result is the same in any call:
// tree, chain, step or prefill. C: head_dim / W, a constant so accumulators stay in registers.
constexpr int kQueries = 4;

// Whether attend() takes this head_dim: 2, 4, 8 or 16 vectors.
inline bool attend_takes(int64_t hd) {
  const int64_t c = hd / W;
  return hd % W == 0 && (c == 2 || c == 4 || c == 8 || c == 16);
}

//
// A call may hold the rows of several sequences, each over its own cache (Segment); a row
// sees only its own sequence, so it comes out the same batched or alone.
struct Segment {
  const uint16_t *kl, *vl;  // this layer's K and V of the sequence's cache
  int64_t start, capacity;  // committed slots, slots in all
  int64_t row0, n;          // its rows of the call: [row0, row0 + n)
  const bool* anc;          // anc[r * anc_stride + t]: its row r sees its row t
  int64_t anc_stride;
};

template <int C>
void attend_c(const Heads& hs, const float* q_rows, int64_t q_stride,
              const std::vector<Segment>& segs, float* out) {
  const int64_t heads = hs.heads, hd = hs.hd, group = hs.heads / hs.kv_heads;
  std::vector<int64_t> first(segs.size() + 1, 0);  // a segment's tasks: kv heads x query blocks
  int64_t most = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    first[i + 1] = first[i] + hs.kv_heads * ((segs[i].n * group + kQueries - 1) / kQueries);
    most = std::max(most, round_up(segs[i].start + segs[i].n, W));
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, first.back(), 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scores;
    scores.resize(kQueries * most);
    alignas(64) float keys[W][C * W];  // W slots' keys in float32
    for (int64_t t = t0; t < t1; ++t) {
      const size_t si = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      const Segment& sg = segs[si];
      const int64_t start = sg.start, n = sg.n, nq = n * group;
      const int64_t blocks = (nq + kQueries - 1) / kQueries, stride = round_up(start + n, W);
      const int64_t g = (t - first[si]) / blocks, q0 = (t - first[si]) % blocks * kQueries;
      const int64_t qn = std::min<int64_t>(kQueries, nq - q0);
      const uint16_t* kg = sg.kl + g * sg.capacity * hd;
      const uint16_t* vg = sg.vl + g * sg.capacity * hd;
      int64_t row[kQueries], head[kQueries], m[kQueries];
      vf q[kQueries][C], acc[kQueries][C];
      for (int i = 0; i < kQueries; ++i) {  // a short block repeats its last query, unused
        const int64_t qi = q0 + std::min<int64_t>(i, qn - 1);
        row[i] = qi / group;
        head[i] = g * group + qi % group;
        const float* qp = q_rows + (sg.row0 + row[i]) * q_stride + head[i] * hd;
        for (int c = 0; c < C; ++c) q[i][c] = vload(qp + c * W);
      }
      // scores of W visible slots [s0, s0 + count) whose keys are in `keys`, for query i
      auto score = [&](int i, int64_t s0) {
        vf p[W];
        for (int j = 0; j < W; ++j) {
          vf d = vmul(q[i][0], vload(keys[j]));
          for (int c = 1; c < C; ++c) d = vfma(q[i][c], vload(keys[j] + c * W), d);
          p[j] = d;
        }
        vstore(scores.data() + i * stride + s0, vmul(sum_lanes(p), vset1(scale)));
      };
      auto load_keys = [&](const uint16_t* const* ks, int64_t count) {
        for (int j = 0; j < W; ++j)
          for (int c = 0; c < C; ++c)
            vstore(keys[j] + c * W, j < count ? vload_h(ks[j] + c * W) : vzero());
      };
      const uint16_t* ks[W];
      // whole groups of committed slots, shared by the queries; a partial last group is
      // scored per query below, together with the row's ancestors that follow it
      for (int64_t s0 = 0; s0 + W <= start; s0 += W) {
        for (int j = 0; j < W; ++j) ks[j] = kg + (s0 + j) * hd;
        load_keys(ks, W);
        for (int i = 0; i < kQueries; ++i) score(i, s0);
      }
      for (int i = 0; i < kQueries; ++i) {  // the row's ancestors, then its softmax
        float* sc = scores.data() + i * stride;
        int64_t s0 = start / W * W, count = start - s0;
        for (int j = 0; j < count; ++j) ks[j] = kg + (s0 + j) * hd;
        m[i] = start;
        for (int64_t j = 0; j < n; ++j) {
          if (!sg.anc[row[i] * sg.anc_stride + j]) continue;
          ks[count++] = kg + (start + j) * hd;
          ++m[i];
          if (count == W) {
            load_keys(ks, count);
            score(i, s0);
            s0 += W;
            count = 0;
          }
        }
        if (count) {
          load_keys(ks, count);
          score(i, s0);
        }
        vf top = vset1(-INFINITY);
        for (int64_t s = 0; s + W <= m[i]; s += W) top = vmax(top, vload(sc + s));
        float mx = hmax(top);
        for (int64_t s = m[i] / W * W; s < m[i]; ++s) mx = std::max(mx, sc[s]);
        const int64_t padded = round_up(m[i], W);
        for (int64_t s = m[i]; s < padded; ++s) sc[s] = -INFINITY;
        const vf shift = vset1(mx);
        for (int64_t s = 0; s < padded; s += W)  // exp(-inf - mx) clamps to ~0 ...
          vstore(sc + s, vexp(vsub(vload(sc + s), shift)));
        for (int64_t s = m[i]; s < padded; ++s) sc[s] = 0.0f;  // ... and the padding adds nothing
        vf lanes = vzero();
        for (int64_t s = 0; s < padded; s += W) lanes = vadd(lanes, vload(sc + s));
        q[i][0] = vset1(1.0f / vsum(lanes));  // the query is spent: keep 1/sum in its place
        for (int c = 0; c < C; ++c) acc[i][c] = vzero();
      }
      for (int64_t s = 0; s < start; ++s) {  // committed values: one V conversion for all
        vf v[C];
        for (int c = 0; c < C; ++c) v[c] = vload_h(vg + s * hd + c * W);
        for (int i = 0; i < kQueries; ++i) {
          const vf w = vset1(scores[i * stride + s]);
          for (int c = 0; c < C; ++c) acc[i][c] = vfma(w, v[c], acc[i][c]);
        }
      }
      for (int i = 0; i < qn; ++i) {
        const float* sc = scores.data() + i * stride;
        int64_t s = start;
        for (int64_t j = 0; j < n; ++j) {
          if (!sg.anc[row[i] * sg.anc_stride + j]) continue;
          const uint16_t* vj = vg + (start + j) * hd;
          const vf w = vset1(sc[s++]);
          for (int c = 0; c < C; ++c) acc[i][c] = vfma(w, vload_h(vj + c * W), acc[i][c]);
        }
        float* o = out + (sg.row0 + row[i]) * heads * hd + head[i] * hd;
        for (int c = 0; c < C; ++c) vstore(o + c * W, vmul(acc[i][c], q[i][0]));
      }
    }
  });
}

void attend(const Heads& hs, const float* q_rows, int64_t q_stride,
            const std::vector<Segment>& segs, float* out) {
  switch (hs.hd / W) {
    case 2: return attend_c<2>(hs, q_rows, q_stride, segs, out);
    case 4: return attend_c<4>(hs, q_rows, q_stride, segs, out);
    case 8: return attend_c<8>(hs, q_rows, q_stride, segs, out);
    case 16: return attend_c<16>(hs, q_rows, q_stride, segs, out);
    default: TORCH_CHECK(false, "head_dim must be 2, 4, 8 or 16 vectors");
  }
}

// One sequence's n rows over one cache, anc [n, n].
void attend(const Heads& hs, const float* q_rows, int64_t q_stride, const uint16_t* kl,
            const uint16_t* vl, int64_t start, int64_t capacity, const bool* anc, int64_t n,
            float* out) {
  attend(hs, q_rows, q_stride, {Segment{kl, vl, start, capacity, 0, n, anc, n}}, out);
}

inline vf reciprocal(vf a) {
#ifdef ADASPARK_AVX512
  return _mm512_div_ps(vset1(1.0f), a);
#else
  return _mm256_div_ps(vset1(1.0f), a);
#endif
}

// act = silu(gate) * up, gate and up side by side in each row of gu.
// One row: o = silu(g) * u.
inline void silu_mul_row(const float* g, const float* u, float* o, int64_t ffn) {
  int64_t i = 0;
  for (; i + W <= ffn; i += W) {
    const vf gv = vload(g + i);
    const vf e = vexp(vmul(gv, vset1(-1.0f)));
    vstore(o + i, vmul(vmul(gv, vload(u + i)), reciprocal(vadd(vset1(1.0f), e))));
  }
  for (; i < ffn; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// The rest of a pre-norm block after attention, on rows x [n, dim]: x += o(attn), then
// x += down(silu(gate(h)) * up(h)) with h = rms_norm(x) (ly: the target's or the drafter's
// layer). h, y, gu, act: scratch of n * dim, n * dim, n * 2 * ffn and n * ffn floats.
template <class L>
void attn_out_and_ffn(const L& ly, float* x, const float* attn, int64_t n, int64_t dim,
                      int64_t qw, int64_t ffn, float eps, QAct& a, float* h, float* y, float* gu,
                      float* act) {
  const float* norm = ly.ffn_norm.template data_ptr<float>();
  quantize_rows(attn, n, qw, a);
  qmatmul_into(ly.o, a, y, dim);
  prepare_rows(n, dim, a);
  for_rows(n, [&](int64_t r) {
    add_into(x + r * dim, y + r * dim, dim);
    rms_norm_row(x + r * dim, norm, h + r * dim, dim, eps);
    quantize_row(h + r * dim, r, a);
  });
  qmatmul_into(ly.gate_up, a, gu, 2 * ffn);
  prepare_rows(n, ffn, a);
  for_rows(n, [&](int64_t r) {
    silu_mul_row(gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, act + r * ffn, ffn);
    quantize_row(act + r * ffn, r, a);
  });
  qmatmul_into(ly.down, a, y, dim);
  for_rows(n, [&](int64_t r) { add_into(x + r * dim, y + r * dim, dim); });
}

}  // namespace adaspark
