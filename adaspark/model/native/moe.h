// A routed (mixture-of-experts) FFN, the native twin of moe.py (llama.cpp's build_moe_ffn for
// qwen3moe and lfm2moe): per row, router scores in float32, p = softmax or sigmoid of them,
// the top-k experts by p (+ a selection bias), weights p of the chosen renormalised; then per
// expert one matmul over the rows routed to it (the packed kernels of every other weight, on
// the expert's slice of the 3-D tensors: views, no copy; all experts' matmuls in one parallel
// region, qmatmul_many), and per row its experts' outputs times their weights added in rank
// order.
//
// Why a routed row is the same whatever rows share its call: its routing reads only its own
// row; the kernels give a row the same bits whatever the other rows of the call (kernels.h),
// so gathering it with other rows into an expert's matmul changes none of its bits; and its
// outputs are added in its own rank order, not in the order the experts ran. A tree row's
// logits are the chain's, at any width, with any batch neighbours.
#pragma once

#include "floats.h"
#include "layer.h"

namespace adaspark {

enum class Gate { softmax, sigmoid };

// One routed layer: router [E, dim] and selection bias [E] (float32, as the file keeps them;
// the bias may be empty), and each expert's gate|up and down.
struct Routed {
  torch::Tensor router, bias;
  std::vector<QWeight> gate_up, down;
  int64_t used = 0, ffn = 0;  // experts per row (top-k); each expert's width
  Gate gate = Gate::softmax;
  bool norm = true;  // the chosen weights divided by their sum
};

inline Gate gate_named(const std::string& name) {
  if (name == "softmax") return Gate::softmax;
  TORCH_CHECK(name == "sigmoid", "unknown expert gating ", name);
  return Gate::sigmoid;
}

// Rows [row0, row0 + rows) of a packed part as a part of their own (whole groups of 16 rows):
// narrowed views of its tensors, which stay shared.
inline QPart part_slice(const QPart& w, int64_t row0, int64_t rows) {
  TORCH_CHECK(row0 % 16 == 0 && rows % 16 == 0 && row0 >= 0 && row0 + rows <= w.n,
              "an expert's rows must be whole groups of 16 within its tensor");
  const int64_t g0 = row0 / 16, groups = rows / 16;
  auto cut = [&](const torch::Tensor& t) {  // every tensor is [groups, ...] flattened
    if (!t.numel()) return t;
    const int64_t per = t.numel() / w.groups;
    return t.narrow(0, g0 * per, groups * per);
  };
  if (!w.bits) return QPart(rows, w.k, cut(w.q));
  return QPart(w.bits, rows, w.k, cut(w.q), cut(w.d), cut(w.m), w.zero, w.halves,
               cut(w.d_super), cut(w.m_super));
}

inline const QPart& only_part(const QWeight& w) {
  TORCH_CHECK(w.parts.size() == 1, "an expert tensor is packed as one part");
  return w.parts[0];
}

// A routed layer from its packed 3-D tensors (experts' rows one after another): gate_exps and
// up_exps [E * ffn, dim], down_exps [E * dim, ffn].
inline Routed make_routed(int64_t dim, torch::Tensor router, torch::Tensor bias,
                          const QWeight& gate_exps, const QWeight& up_exps,
                          const QWeight& down_exps, int64_t used, const std::string& gating,
                          bool norm) {
  TORCH_CHECK(router.dim() == 2 && router.size(1) == dim && router.scalar_type() == torch::kFloat,
              "router must be float32 [experts, dim]");
  const int64_t E = router.size(0);
  TORCH_CHECK(!bias.numel() || (bias.numel() == E && bias.scalar_type() == torch::kFloat),
              "selection bias must be empty or float32 [experts]");
  TORCH_CHECK(used >= 1 && used <= E, "experts used must be 1..experts");
  TORCH_CHECK(gate_exps.n % E == 0 && up_exps.n == gate_exps.n && gate_exps.k == dim &&
                  up_exps.k == dim && down_exps.n == E * dim,
              "expert tensors must be [E * ffn, dim] (gate, up) and [E * dim, ffn] (down)");
  Routed m;
  m.router = router.contiguous();
  m.bias = bias.contiguous();
  m.used = used;
  m.ffn = gate_exps.n / E;
  TORCH_CHECK(down_exps.k == m.ffn, "down_exps must take the experts' ffn inputs");
  m.gate = gate_named(gating);
  m.norm = norm;
  const QPart &g = only_part(gate_exps), &u = only_part(up_exps), &d = only_part(down_exps);
  for (int64_t e = 0; e < E; ++e) {
    m.gate_up.emplace_back(std::vector<QPart>{part_slice(g, e * m.ffn, m.ffn),
                                              part_slice(u, e * m.ffn, m.ffn)});
    m.down.emplace_back(std::vector<QPart>{part_slice(d, e * dim, dim)});
  }
  return m;
}

// Scratch of a routed FFN, kept between calls.
struct MoeScratch {
  std::vector<int64_t> chosen, order, first, active, index;  // see routed_ffn
  std::vector<float> weight, ranked, gu, act, y;
  std::vector<QAct> rows, acts;  // per active expert: its rows; their activations after gate_up
};

// Per row r of h [n, dim]: chosen[r, 0..k) the top-k experts, best first (ties: the lower
// expert), and their weights. Each row's own arithmetic, in one fixed order.
inline void route_rows(const Routed& m, const float* h, int64_t n, int64_t dim, int64_t* chosen,
                       float* weight) {
  const int64_t E = m.router.size(0), k = m.used;
  const float* router = m.router.data_ptr<float>();
  const float* bias = m.bias.numel() ? m.bias.data_ptr<float>() : nullptr;
  for_rows(n, [&](int64_t r) {
    std::vector<float> p(E), select(E);
    std::vector<char> taken(E, 0);
    const float* hr = h + r * dim;
    for (int64_t e = 0; e < E; ++e) p[e] = vdot(hr, router + e * dim, dim);
    if (m.gate == Gate::softmax) {
      float top = p[0], sum = 0.0f;
      for (int64_t e = 1; e < E; ++e) top = std::max(top, p[e]);
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    } else {
      for (int64_t e = 0; e < E; ++e) p[e] = 1.0f / (1.0f + std::exp(-p[e]));
    }
    for (int64_t e = 0; e < E; ++e) select[e] = bias ? p[e] + bias[e] : p[e];
    int64_t* c = chosen + r * k;
    float* w = weight + r * k;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {  // strictly greater: the lower expert wins a tie (and
      int64_t best = -1;               // a NaN row takes the lowest free ones)
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || select[e] > select[best])) best = e;
      taken[best] = 1;
      c[j] = best;
      sum += w[j] = p[best];
    }
    if (m.norm) {
      sum = std::max(sum, 6.103515625e-5f);  // llama.cpp's floor: fp16's smallest normal
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
  });
}

// Row r of a (quantised activations) into row j of out (prepared), as quantize_row made it.
inline void copy_row(const QAct& a, int64_t r, QAct& out, int64_t j) {
  const int64_t k = a.k, nb = a.nb;
  std::memcpy(out.q.data() + j * k, a.q.data() + r * k, k);
  std::memcpy(out.x.data() + j * k, a.x.data() + r * k, k * sizeof(float));
  std::memcpy(out.dx.data() + j * nb, a.dx.data() + r * nb, nb * sizeof(float));
  std::memcpy(out.xs.data() + j * nb, a.xs.data() + r * nb, nb * sizeof(float));
  std::memcpy(out.qs.data() + j * nb, a.qs.data() + r * nb, nb * sizeof(int32_t));
  std::memcpy(out.qh.data() + j * nb, a.qh.data() + r * nb, nb * sizeof(int32_t));
}

// y [n, dim] = the routed FFN of rows h [n, dim] (float32, normed), quantised in a.
// The n * k slots (row, rank) are sorted by expert (order; expert e's at first[e] ..
// first[e + 1], rows ascending); each active expert's rows are gathered, and all experts'
// gate_up, then all their downs, run as one qmatmul_many each; position i of `order` keeps
// its gate_up output at gu[i], its down output at y[i]. Then each slot's output times its
// weight goes to ranked[slot], and each row adds its slots in rank order.
inline void routed_ffn(const Routed& m, const QAct& a, const float* h, int64_t n, int64_t dim,
                       float* y, MoeScratch& s) {
  const int64_t E = m.router.size(0), k = m.used, f = m.ffn, total = n * k;
  s.chosen.resize(total);
  s.weight.resize(total);
  route_rows(m, h, n, dim, s.chosen.data(), s.weight.data());
  s.first.assign(E + 1, 0);
  for (int64_t i = 0; i < total; ++i) ++s.first[s.chosen[i] + 1];
  for (int64_t e = 0; e < E; ++e) s.first[e + 1] += s.first[e];
  s.order.resize(total);
  std::vector<int64_t> at(s.first.begin(), s.first.end() - 1);
  for (int64_t i = 0; i < total; ++i) s.order[at[s.chosen[i]]++] = i;
  s.active.clear();
  s.index.assign(E, -1);
  for (int64_t e = 0; e < E; ++e)
    if (s.first[e + 1] > s.first[e]) {
      s.index[e] = static_cast<int64_t>(s.active.size());
      s.active.push_back(e);
    }
  const size_t A = s.active.size();
  if (s.rows.size() < A) s.rows.resize(A), s.acts.resize(A);
  for (size_t i = 0; i < A; ++i) {
    const int64_t e = s.active[i], count = s.first[e + 1] - s.first[e];
    prepare_rows(count, dim, s.rows[i]);
    prepare_rows(count, f, s.acts[i]);
  }
  // the expert of order position i, and its row there
  auto slot_at = [&](int64_t i, int64_t& expert, int64_t& j) {
    expert = s.chosen[s.order[i]];
    j = i - s.first[expert];
  };
  for_rows(total, [&](int64_t i) {
    int64_t e, j;
    slot_at(i, e, j);
    copy_row(a, s.order[i] / k, s.rows[s.index[e]], j);
  });
  s.gu.resize(total * 2 * f);
  s.act.resize(total * f);
  s.y.resize(total * dim);
  s.ranked.resize(total * dim);
  std::vector<MatmulJob> jobs(A);
  for (size_t i = 0; i < A; ++i) {
    const int64_t e = s.active[i];
    jobs[i] = MatmulJob{&m.gate_up[e], &s.rows[i], s.gu.data() + s.first[e] * 2 * f, 2 * f};
  }
  qmatmul_many(jobs);
  for_rows(total, [&](int64_t i) {
    int64_t e, j;
    slot_at(i, e, j);
    const float* g = s.gu.data() + i * 2 * f;
    silu_mul_row(g, g + f, s.act.data() + i * f, f);
    quantize_row(s.act.data() + i * f, j, s.acts[s.index[e]]);
  });
  for (size_t i = 0; i < A; ++i) {
    const int64_t e = s.active[i];
    jobs[i] = MatmulJob{&m.down[e], &s.acts[i], s.y.data() + s.first[e] * dim, dim};
  }
  qmatmul_many(jobs);
  for_rows(total, [&](int64_t i) {  // an expert's output times its weight, into its slot
    const int64_t slot = s.order[i];
    const vf w = vset1(s.weight[slot]);
    const float* src = s.y.data() + i * dim;
    float* dst = s.ranked.data() + slot * dim;
    for (int64_t c = 0; c < dim; c += W) vstore(dst + c, vmul(vload(src + c), w));
  });
  for_rows(n, [&](int64_t r) {  // rank order: the best expert's output first
    const float* src = s.ranked.data() + r * k * dim;
    std::memcpy(y + r * dim, src, dim * sizeof(float));
    for (int64_t j = 1; j < k; ++j) add_into(y + r * dim, src + j * dim, dim);
  });
}

}  // namespace adaspark
