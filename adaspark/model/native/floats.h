// Float32 dot products in one fixed order (the LM head's exact recompute, the drafter's fc),
// argmax and top-k over float rows.
#pragma once

#include "simd.h"

namespace adaspark {

// Weights as stored: float32, or fp16 where every weight is one (the drafter's fc: half the
// bytes read); both load as the same float32 values.
inline vf load_weights(const float* p) { return vload(p); }
inline vf load_weights(const uint16_t* p) { return vload_h(p); }

// Dot of a float vector and a row of weights of length n (a multiple of W), one fixed order.
template <class Wt>
inline float vdot(const float* a, const Wt* b, int64_t n) {
  vf acc = vzero();
  for (int64_t i = 0; i < n; i += W) acc = vfma(vload(a + i), load_weights(b + i), acc);
  return vsum(acc);
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

}  // namespace adaspark
