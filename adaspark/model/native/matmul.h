// The quantised matmul: which path a call takes.
#pragma once

#include "amx.h"
#include "qdot.h"

namespace adaspark {

// y [rows, w.n] (row stride ldy) = x W^T for activations already quantised.
void qmatmul_into(const QWeight& w, const QAct& a, float* y, int64_t ldy) {
  TORCH_CHECK(a.k == w.k, "activation width differs from the weight's inputs");
#ifdef ADASPARK_AVX512
  if (a.rows >= kAmxMinRows && amx_on()) return qmatmul_amx(w, a, y, ldy);
#endif
  for_claimed(w.groups, [&](int64_t i, int64_t ahead, bool first) {
    const int64_t p = w.part_of(i), g = i - w.first[p];
    if (first) prefetch_group(w.parts[p], g);
    part_rows(w.parts[p], a, g, y + w.col[p], ldy, next_of(w, ahead));
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

}  // namespace adaspark
