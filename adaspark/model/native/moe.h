// A routed (mixture-of-experts) FFN, the native twin of moe.py (llama.cpp's build_moe_ffn for
// qwen3moe and lfm2moe): per row, router scores in float32, p = softmax or sigmoid of them,
// the top-k experts by p (+ a selection bias), weights p of the chosen renormalised; then per
// expert one matmul over the rows routed to it (the packed kernels of every other weight, on
// the expert's slice of the 3-D tensors: views, no copy), and per row its experts' outputs
// times their weights added in rank order.
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
  std::vector<int64_t> chosen, order, first;  // [n, k]; slots by expert; each expert's first
  std::vector<float> weight, ranked, gu, act, y;
  QAct rows;  // the rows routed to one expert, gathered
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

// Rows `ids` of a (quantised activations) into out, as quantize_row made them.
inline void gather_rows(const QAct& a, const int64_t* ids, int64_t m, QAct& out) {
  prepare_rows(m, a.k, out);
  const int64_t k = a.k, nb = a.nb;
  for_rows(m, [&](int64_t j) {
    const int64_t r = ids[j];
    std::memcpy(out.q.data() + j * k, a.q.data() + r * k, k);
    std::memcpy(out.x.data() + j * k, a.x.data() + r * k, k * sizeof(float));
    std::memcpy(out.dx.data() + j * nb, a.dx.data() + r * nb, nb * sizeof(float));
    std::memcpy(out.xs.data() + j * nb, a.xs.data() + r * nb, nb * sizeof(float));
    std::memcpy(out.qs.data() + j * nb, a.qs.data() + r * nb, nb * sizeof(int32_t));
    std::memcpy(out.qh.data() + j * nb, a.qh.data() + r * nb, nb * sizeof(int32_t));
  });
}

// y [n, dim] = the routed FFN of rows h [n, dim] (float32, normed), quantised in a.
inline void routed_ffn(const Routed& m, const QAct& a, const float* h, int64_t n, int64_t dim,
                       float* y, MoeScratch& s) {
  const int64_t E = m.router.size(0), k = m.used, f = m.ffn;
  s.chosen.resize(n * k);
  s.weight.resize(n * k);
  s.ranked.resize(n * k * dim);
  route_rows(m, h, n, dim, s.chosen.data(), s.weight.data());
  // the slots (row, rank) of each expert, rows ascending: a counting sort by expert
  s.first.assign(E + 1, 0);
  for (int64_t i = 0; i < n * k; ++i) ++s.first[s.chosen[i] + 1];
  for (int64_t e = 0; e < E; ++e) s.first[e + 1] += s.first[e];
  s.order.resize(n * k);
  std::vector<int64_t> at(s.first.begin(), s.first.end() - 1), ids;
  for (int64_t i = 0; i < n * k; ++i) s.order[at[s.chosen[i]]++] = i;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t m_e = s.first[e + 1] - s.first[e];
    if (!m_e) continue;
    const int64_t* slots = s.order.data() + s.first[e];
    ids.resize(m_e);
    for (int64_t j = 0; j < m_e; ++j) ids[j] = slots[j] / k;
    gather_rows(a, ids.data(), m_e, s.rows);
    s.gu.resize(m_e * 2 * f);
    s.act.resize(m_e * f);
    s.y.resize(m_e * dim);
    gated_ffn(m.gate_up[e], m.down[e], s.rows, s.y.data(), m_e, dim, f, s.gu.data(),
              s.act.data(), Act::silu);
    for_rows(m_e, [&](int64_t j) {  // out_e times its weight, into the row's rank slot
      const vf w = vset1(s.weight[slots[j]]);
      float* dst = s.ranked.data() + slots[j] * dim;
      for (int64_t i = 0; i < dim; i += W) vstore(dst + i, vmul(vload(s.y.data() + j * dim + i), w));
    });
  }
  for_rows(n, [&](int64_t r) {  // rank order: the best expert's output first
    const float* src = s.ranked.data() + r * k * dim;
    std::memcpy(y + r * dim, src, dim * sizeof(float));
    for (int64_t j = 1; j < k; ++j) add_into(y + r * dim, src + j * dim, dim);
  });
}

}  // namespace adaspark
