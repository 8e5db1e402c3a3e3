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

// y[r, 16g .. 16g+15] for rows [r0, r0+R) of a dense part: each (row, output) is one lane,
// two float32 fma chains over its inputs (even, odd) and then their sum, so its arithmetic is
// the same on every build (16 lanes a register, or 8 in two passes) and whatever the other
// rows are.
template <int R, class Load>
inline void dense_rows_with(const QPart& w, const QAct& a, int64_t g, int64_t r0, float* y,
                            int64_t ldy, Next ahead, Load load) {
  for (int half = 0; half < 16 / W; ++half) {
    vf even[R], odd[R];
    for (int i = 0; i < R; ++i) even[i] = odd[i] = vzero();
    const int64_t base = g * w.k * 16 + W * half;
    const float* x = a.x.data() + r0 * a.k;
    for (int64_t j = 0; j < w.k; j += 2) {
      if (ahead.w && half == 0 && j % kBlock == 0) prefetch_block(*ahead.w, ahead.g, j / kBlock);
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
