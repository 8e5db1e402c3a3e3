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

// Several matmuls y = x W^T in one parallel region (a routed layer's experts, each over the
// rows routed to it): the threads claim the groups of every weight, where a call each would
// open a region per expert (k of them a row and layer), each ending on its slowest thread.
// Every group runs part_rows as qmatmul_into runs it, so each row's bits are those of its
// own call; calls the tile path takes (as qmatmul_into chooses it) still go one by one.
struct MatmulJob {
  const QWeight* w;
  const QAct* a;
  float* y;
  int64_t ldy;
};

void qmatmul_many(const std::vector<MatmulJob>& jobs) {
  std::vector<const MatmulJob*> rest;
  for (const MatmulJob& job : jobs) {
    TORCH_CHECK(job.a->k == job.w->k, "activation width differs from the weight's inputs");
#ifdef ADASPARK_AVX512
    if (job.a->rows >= kAmxMinRows && amx_on()) {
      qmatmul_amx(*job.w, *job.a, job.y, job.ldy);
      continue;
    }
#endif
    rest.push_back(&job);
  }
  std::vector<int64_t> start{0};  // job j's groups are [start[j], start[j + 1])
  for (const MatmulJob* job : rest) start.push_back(start.back() + job->w->groups);
  auto locate = [&](int64_t i) {
    const int64_t j = std::upper_bound(start.begin(), start.end(), i) - start.begin() - 1;
    return std::pair<int64_t, int64_t>{j, i - start[j]};
  };
  for_claimed(start.back(), [&](int64_t i, int64_t ahead, bool first) {
    const auto [j, gi] = locate(i);
    const MatmulJob& job = *rest[j];
    const QWeight& w = *job.w;
    const int64_t p = w.part_of(gi), g = gi - w.first[p];
    if (first) prefetch_group(w.parts[p], g);
    Next next;
    if (ahead >= 0) {
      const auto [ja, ga] = locate(ahead);
      next = next_of(*rest[ja]->w, ga);
    }
    part_rows(w.parts[p], *job.a, g, job.y + w.col[p], job.ldy, next);
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
