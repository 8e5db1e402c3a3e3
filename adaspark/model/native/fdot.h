// Dense (F16, BF16, F32) weights times float32 activations: the GGUF's own values, no
// quantisation on either side.
#pragma once

#include "qweight.h"

namespace adaspark {

struct LoadF32 {
  const float* p;
  vf operator()(int64_t at) const { return vload(p + at); }
};
struct LoadF16 {
  const uint16_t* p;
  vf operator()(int64_t at) const { return vload_h(p + at); }
};
struct LoadBF16 {
  const uint16_t* p;
  vf operator()(int64_t at) const { return vload_bf16(p + at); }
};

// Where group g of part w (dense or integer: its packed codes) lies, `bytes` long from `at`;
// none: at == nullptr, bytes 0 (past a thread's last group).
struct GroupSpan {
  const char* at = nullptr;
  int64_t bytes = 0;
};

inline GroupSpan group_span(const QPart& w, int64_t g) {
  if (g < 0 || g >= w.groups) return {};
  const int64_t bytes = w.nb * w.block_bytes();
  return {reinterpret_cast<const char*>(w.qp) + g * bytes, bytes};
}

// A dense matmul at a few rows streams its weights once with little arithmetic per byte, so it
// runs at the pace memory feeds one core. Its loop keeps too few cache-line misses in flight on
// its own (two fma chains a row pace it), and asking for the next group's blocks into L1 a
// whole group ahead evicts them before their use: so every line is asked for into L2 (T1) a
// fixed distance ahead of the loads, across the end of this group into the thread's next one
// (benchmarks/read_rate.cpp, two threads over 270 MB: the loop's arithmetic alone reads at ~80%
// of a plain read's rate, with this prefetch above it; benchmarks/dense_rate.py: the F16 model's
// matrices at one row 1.3x faster).
constexpr int64_t kDenseAhead = 8192;  // bytes

inline void prefetch_dense(const GroupSpan& cur, const GroupSpan& next, int64_t at) {
  if (at < cur.bytes) return _mm_prefetch(cur.at + at, _MM_HINT_T1);
  at -= cur.bytes;
  if (at < next.bytes) _mm_prefetch(next.at + at, _MM_HINT_T1);
}

// y[r, 16g .. 16g+15] for rows [r0, r0+R) of a dense part: each (row, output) is one lane,
// two float32 fma chains over its inputs (even, odd) and then their sum, so its arithmetic is
// the same on every build (16 lanes a register, or 8 in two passes) and whatever the other
// rows are. The group's first pass (rows from 0) streams the prefetch.
template <int R, class Load>
inline void dense_rows_with(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                            int64_t ldy, Next ahead, Load load) {
  const GroupSpan cur = group_span(w, g);
  const GroupSpan next = ahead.w ? group_span(*ahead.w, ahead.g) : GroupSpan{};
  const int64_t step = 2 * 16 * static_cast<int64_t>(w.q.element_size());  // bytes per j pair
  for (int half = 0; half < 16 / W; ++half) {
    vf even[R], odd[R];
    for (int i = 0; i < R; ++i) even[i] = odd[i] = vzero();
    const int64_t base = g * w.k * 16 + W * half;
    const float* x = a.x.data() + r0 * a.k;
    const bool stream = r0 == 0 && half == 0;  // the group's first pass
    for (int64_t j = 0; j < w.k; j += 2) {
      for (int64_t b = 0; stream && b < step; b += 64)
        prefetch_dense(cur, next, j / 2 * step + kDenseAhead + b);
      const vf w0 = load(base + j * 16), w1 = load(base + (j + 1) * 16);
      for (int i = 0; i < R; ++i) {
        even[i] = vfma(vset1(x[i * a.k + j]), w0, even[i]);
        odd[i] = vfma(vset1(x[i * a.k + j + 1]), w1, odd[i]);
      }
    }
    const int64_t valid = std::min<int64_t>(W, w.n - 16 * g - W * half);
    for (int i = 0; i < R && valid > 0; ++i)
      vstore_first(y + (r0 + i) * ldy + 16 * g + W * half, vadd(even[i], odd[i]), valid);
  }
}

template <int R>
inline void dense_rows(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                       int64_t ldy, Next ahead) {
  const auto* h = reinterpret_cast<const uint16_t*>(w.qp);
  switch (w.dense) {
    case torch::kHalf: return dense_rows_with<R>(w, a, g, r0, y, ldy, ahead, LoadF16{h});
    case torch::kBFloat16: return dense_rows_with<R>(w, a, g, r0, y, ldy, ahead, LoadBF16{h});
    default:
      return dense_rows_with<R>(w, a, g, r0, y, ldy, ahead,
                                LoadF32{reinterpret_cast<const float*>(w.qp)});
  }
}

}  // namespace adaspark
