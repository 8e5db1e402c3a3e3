// Per-row work between the matmuls: RMSNorm, residual adds, RoPE, SiLU / GELU gates.
#pragma once

#include "simd.h"

namespace adaspark {

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

// RoPE on adjacent pairs (x0, x1) of one head vector, cos/sin of its position.
inline void rope_pairs(float* v, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = v[2 * i], x1 = v[2 * i + 1];
    v[2 * i] = x0 * cs[i] - x1 * sn[i];
    v[2 * i + 1] = x1 * cs[i] + x0 * sn[i];
  }
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

// One row: o = gelu_tanh(g) * u. 0.5 g (1 + tanh(z)) = g / (1 + exp(-2z)), z = sqrt(2/pi)
// (g + 0.044715 g^3): silu's arithmetic on 2z (exp clamps its input, so no inf / inf).
inline void gelu_tanh_mul_row(const float* g, const float* u, float* o, int64_t ffn) {
  constexpr float c = 1.5957691216057308f, c3 = c * 0.044715f;  // 2 sqrt(2/pi), its cube term
  int64_t i = 0;
  for (; i + W <= ffn; i += W) {
    const vf gv = vload(g + i);
    const vf z2 = vmul(gv, vfma(vmul(gv, gv), vset1(c3), vset1(c)));
    const vf e = vexp(vmul(z2, vset1(-1.0f)));
    vstore(o + i, vmul(vmul(gv, vload(u + i)), reciprocal(vadd(vset1(1.0f), e))));
  }
  for (; i < ffn; ++i) {
    const float z2 = g[i] * (c + c3 * g[i] * g[i]);
    o[i] = g[i] / (1.0f + std::exp(std::min(-z2, 88.0f))) * u[i];
  }
}

}  // namespace adaspark
