// The DSpark block drafter (adaspark/drafter/model.py) as two native calls: append the
// features of newly committed tokens to its fp16 K/V cache, and draft one block.
//
// Its weights are the checkpoint's float32 ones quantised to Q8_0 (drafter/native.py), so the
// backbone runs on the target's integer kernels; a draft only proposes, the target decides,
// so this changes which tokens are proposed, never which are emitted. The Markov head and the
// confidence head stay float32 (they are small and run along the picks).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <optional>

#include "kernels.h"

namespace adaspark {

// Wall time of each phase of append() and draft(), summed until taken (benchmarks/
// draft_profile.py): one clock read a phase, some 20 ns each against a draft's ~1 ms.
class PhaseClock {
 public:
  enum Phase : int {
    fc, context_norm, context_kv, context_store,                        // append
    block_norm, qkv, block_rope, attention, o, ffn_norm, gate_up, gate,  // draft: backbone
    down, out_norm, head, shortlist, markov, topk, confidence, count     // draft: heads
  };
  void start() { last_ = Clock::now(); }
  void mark(Phase p) {
    const auto now = Clock::now();
    ns_[p] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count();
    last_ = now;
  }
  // {phase: ms} since the last take, and the clock back to zero.
  std::map<std::string, double> take() {
    static const char* names[count] = {
        "fc", "context_norm", "context_kv", "context_store", "block_norm", "qkv", "block_rope",
        "attention", "o", "ffn_norm", "gate_up", "gate", "down", "out_norm", "head",
        "shortlist", "markov", "topk", "confidence"};
    std::map<std::string, double> out;
    for (int p = 0; p < count; ++p) out[names[p]] = ns_[p] * 1e-6;
    ns_.fill(0);
    return out;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point last_;
  std::array<int64_t, count> ns_{};
};

struct DraftLayer {
  torch::Tensor attn_norm, ffn_norm;
  QWeight qkv, kv, o, gate_up, down;  // kv: the k|v rows of qkv alone, for context features
  torch::Tensor q_norm, k_norm;       // per-head RMSNorm weights [head_dim] before RoPE, or empty
  float qk_eps;                       // their epsilon (drafter/native.py rescales q/k rows)
};

// fc's dots, y[r * ldy + o] = vdot(x row r, w row o) for rows [0, rows) and outputs [o0, o1):
// tiles of up to 4 rows x kFcTile outputs share their loads, so fc's weights are read once per
// 4 rows (a 3-row append by whole rows read all of fc three times); AVX2's 16 registers hold a
// 4 x 3 tile's sums and loads, AVX-512's 32 a 4 x 4 (a 4 x 4 spilled on AVX2: 1.5x slower).
// Each value keeps vdot's steps (one accumulator, chunks in order, then vsum), whatever the tile.
#ifdef ADASPARK_AVX512
constexpr int kFcTile = 4;
#else
constexpr int kFcTile = 3;
#endif
template <int R, class Wt>
inline void dot_tiles(const float* x, const Wt* w, int64_t o0, int64_t o1, int64_t k,
                      float* y, int64_t ldy) {
  constexpr int T = kFcTile;
  int64_t o = o0;
  for (; o + T <= o1; o += T) {
    vf acc[R][T];
    for (auto& row : acc)
      for (vf& v : row) v = vzero();
    for (int64_t c = 0; c < k; c += W) {
      vf ws[T];
      for (int j = 0; j < T; ++j) ws[j] = load_weights(w + (o + j) * k + c);
      for (int i = 0; i < R; ++i) {
        const vf xs = vload(x + i * k + c);
        for (int j = 0; j < T; ++j) acc[i][j] = vfma(xs, ws[j], acc[i][j]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < T; ++j) y[i * ldy + o + j] = vsum(acc[i][j]);
  }
  for (; o < o1; ++o)
    for (int i = 0; i < R; ++i) y[i * ldy + o] = vdot(x + i * k, w + o * k, k);
}

// Many rows (a prompt's catch-up) go in blocks of kFcRows rows x kFcOutputs outputs, whose
// rows and weights stay in L2 while their tiles run; a 4-row tile over all of a thread's
// outputs read its 2 MB of float32 weights from L3 every time. The tiles, and so every value,
// are the same.
constexpr int64_t kFcRows = 64, kFcOutputs = 48;  // 48: whole tiles of 3 or 4
template <class Wt>
inline void fc_dots(const float* x, int64_t rows, const Wt* w, int64_t o0, int64_t o1,
                    int64_t k, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < rows; r0 += kFcRows)
    for (int64_t b0 = o0; b0 < o1; b0 += kFcOutputs) {
      const int64_t b1 = std::min(b0 + kFcOutputs, o1), r1 = std::min(r0 + kFcRows, rows);
      for (int64_t r = r0; r < r1; r += 4) {
        const float* xr = x + r * k;
        float* yr = y + r * ldy;
        switch (std::min<int64_t>(4, r1 - r)) {
          case 4: dot_tiles<4>(xr, w, b0, b1, k, yr, ldy); break;
          case 3: dot_tiles<3>(xr, w, b0, b1, k, yr, ldy); break;
          case 2: dot_tiles<2>(xr, w, b0, b1, k, yr, ldy); break;
          default: dot_tiles<1>(xr, w, b0, b1, k, yr, ldy); break;
        }
      }
    }
}

// The s best of x[0, n) best first, ties to the lower index: top_indices' answer, by a bound
// first. The values are split into m >= s disjoint sets (lane j of W-vectors q*g .. q*g+g-1)
// and t is the s-th largest of their maxima: at least s values are >= t, so the s best are
// all >= t, and only the values >= t (a few times s) are ranked, not a heap over all n.
// maxima, cand: scratch kept by the caller.
inline void shortlist_of(const float* x, int64_t n, int64_t s, std::vector<int64_t>& out,
                         std::vector<float>& maxima, std::vector<int64_t>& cand) {
  const int64_t g = std::max<int64_t>(1, n / (4 * s));  // vectors a group: about 4s sets
  const int64_t groups = n / (g * W);
  if (groups * W < s) return top_indices(x, n, s, out);
  maxima.resize(groups * W);
  for (int64_t q = 0; q < groups; ++q) {
    const float* xq = x + q * g * W;
    vf top = vload(xq);
    for (int64_t v = 1; v < g; ++v) top = vmax(top, vload(xq + v * W));
    vstore(maxima.data() + q * W, top);
  }
  std::nth_element(maxima.begin(), maxima.begin() + (s - 1), maxima.end(), std::greater<>());
  const float t = maxima[s - 1];
  cand.clear();
  const vf tv = vset1(t);
  int64_t i = 0;
  for (; i + W <= n; i += W)
    for (unsigned bits = vge_mask(vload(x + i), tv); bits; bits &= bits - 1)
      cand.push_back(i + __builtin_ctz(bits));
  for (; i < n; ++i)
    if (x[i] >= t) cand.push_back(i);
  if (static_cast<int64_t>(cand.size()) < s) return top_indices(x, n, s, out);  // NaNs
  auto better = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::partial_sort(cand.begin(), cand.begin() + s, cand.end(), better);
  out.assign(cand.begin(), cand.begin() + s);
}

// out[j] = w_{idx[j]} . e (rows of r weights, r a multiple of 2W, float32 or fp16 as stored:
// the same values): two accumulators of W lanes a row, fused multiply-adds, 4 rows side by
// side (the rows are gathered candidates: their loads, not the arithmetic, set the pace). Not
// a plain loop's float steps: the caps that choose the rows allow any order's rounding (an
// r-term dot: r 2^-24 of |w_j| |e|).
template <class Wt>
inline void fused_dots(const Wt* w, const int64_t* idx, int64_t rows, const float* e, int64_t r,
                       float* out) {
  int64_t j0 = 0;
  for (; j0 + 4 <= rows; j0 += 4) {
    const Wt* a[4];
    for (int k = 0; k < 4; ++k) a[k] = w + idx[j0 + k] * r;
    vf acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = vzero();
    for (int64_t i = 0; i < r; i += 2 * W) {
      const vf e0 = vload(e + i), e1 = vload(e + i + W);
      for (int k = 0; k < 4; ++k) {
        acc[2 * k] = vfma(load_weights(a[k] + i), e0, acc[2 * k]);
        acc[2 * k + 1] = vfma(load_weights(a[k] + i + W), e1, acc[2 * k + 1]);
      }
    }
    for (int k = 0; k < 4; ++k) out[j0 + k] = vsum(vadd(acc[2 * k], acc[2 * k + 1]));
  }
  for (; j0 < rows; ++j0) {
    const Wt* a = w + idx[j0] * r;
    vf acc0 = vzero(), acc1 = vzero();
    for (int64_t i = 0; i < r; i += 2 * W) {
      acc0 = vfma(load_weights(a + i), vload(e + i), acc0);
      acc1 = vfma(load_weights(a + i + W), vload(e + i + W), acc1);
    }
    out[j0] = vsum(vadd(acc0, acc1));
  }
}

class Drafter {
 public:
  // cos/sin [positions, head_dim/2]; fc float32 or float16 [dim, taps*dim]; head [V_d <- dim];
  // w1 [V_d+1, r]; w2 [V_d, r]; confidence [dim + r] and its bias; temperature [block].
  Drafter(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t ffn,
          int64_t block, double eps, torch::Tensor rope_cos, torch::Tensor rope_sin,
          torch::Tensor fc, torch::Tensor ctx_norm, torch::Tensor mask_embedding,
          torch::Tensor out_norm, QWeight head, torch::Tensor w1, torch::Tensor w2,
          torch::Tensor confidence,
          double confidence_bias, torch::Tensor temperature)
      : dim_(dim), hs_{n_heads, n_kv_heads, head_dim}, ffn_(ffn), block_(block),
        eps_(static_cast<float>(eps)), cos_(rope_cos.contiguous()), sin_(rope_sin.contiguous()),
        fc_(fc.contiguous()), ctx_norm_(ctx_norm.contiguous()), mask_(mask_embedding.contiguous()),
        out_norm_(out_norm.contiguous()), head_(std::move(head)), w1_(w1.contiguous()),
        w2_(w2.to(torch::kFloat).contiguous()),
        w2h_(w2.scalar_type() == torch::kHalf ? w2.contiguous() : torch::Tensor()),
        conf_(confidence.contiguous()),
        conf_bias_(static_cast<float>(confidence_bias)), temp_(temperature.contiguous()) {
    TORCH_CHECK(attend_takes(head_dim) && dim % W == 0,
                "head_dim must be 2, 4, 8 or 16 times ", W, " and dim a multiple of ", W);
    TORCH_CHECK(n_heads % n_kv_heads == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(w1_.dim() == 2 && w2_.dim() == 2 && w1_.size(1) == w2_.size(1) &&
                    w2_.size(0) == head_.n && w1_.size(0) >= 1,
                "Markov weights must be w1 [keys, r], w2 [V_d, r]");
    // the largest |W2 row|: caps any candidate's Markov bias (markov()'s exact shortlist)
    const float* w2p = w2_.data_ptr<float>();
    for (int64_t j = 0; j < w2_.size(0); ++j) {
      double s2 = 0.0;
      for (int64_t i = 0; i < w2_.size(1); ++i) s2 += double(w2p[j * w2_.size(1) + i]) * w2p[j * w2_.size(1) + i];
      w2_max_ = std::max(w2_max_, std::sqrt(s2));
    }
    TORCH_CHECK(conf_.numel() == dim_ + w1_.size(1) && temp_.numel() == block_,
                "confidence [dim + r], temperature [block]");
    TORCH_CHECK((fc_.scalar_type() == torch::kFloat || fc_.scalar_type() == torch::kHalf) &&
                    fc_.dim() == 2 && fc_.size(0) == dim_ && fc_.size(1) % W == 0,
                "fc must be float32 or float16 [dim, taps*dim]");
  }

  // q_norm / k_norm: per-head RMSNorm weights [head_dim] applied before RoPE, or empty;
  // qk_eps their epsilon (negative: the model's).
  void add_layer(torch::Tensor attn_norm, torch::Tensor ffn_norm, QWeight qkv, QWeight kv,
                 QWeight o, QWeight gate_up, QWeight down, torch::Tensor q_norm,
                 torch::Tensor k_norm, double qk_eps) {
    for (const auto* t : {&q_norm, &k_norm})
      TORCH_CHECK(t->numel() == 0 || (t->numel() == hs_.hd && t->scalar_type() == torch::kFloat),
                  "q/k norms must be float32 [head_dim] or empty");
    layers_.push_back(DraftLayer{attn_norm.contiguous(), ffn_norm.contiguous(), std::move(qkv),
                                 std::move(kv), std::move(o), std::move(gate_up),
                                 std::move(down), q_norm.contiguous(), k_norm.contiguous(),
                                 qk_eps < 0 ? eps_ : static_cast<float>(qk_eps)});
  }

  // The Markov exactness bound's precomputation (runtime.markov_bound): basis [r, K] of W2's
  // top right singular directions, proj [K, V_d] = (W2 basis)^T, res [V_d] |W2 row - its part
  // in the basis| and norms [V_d] |W2 row|, both rounded up. Without it a shortlist that the
  // plain Cauchy-Schwarz cap cannot prove falls back to every candidate.
  void set_markov_bound(torch::Tensor basis, torch::Tensor proj, torch::Tensor res,
                        torch::Tensor norms) {
    const int64_t r = w1_.size(1), K = basis.dim() == 2 ? basis.size(1) : 0, V = head_.n;
    TORCH_CHECK(basis.scalar_type() == torch::kFloat && basis.size(0) == r && K >= 1 && K <= 64,
                "basis must be float32 [r, K], K in 1..64");
    TORCH_CHECK(proj.scalar_type() == torch::kFloat && proj.dim() == 2 && proj.size(0) == K &&
                    proj.size(1) == V && res.numel() == V && norms.numel() == V &&
                    res.scalar_type() == torch::kFloat && norms.scalar_type() == torch::kFloat,
                "proj [K, V_d], res and norms [V_d], float32");
    mb_basis_ = basis.contiguous();
    mb_proj_ = proj.contiguous();
    mb_res_ = res.contiguous();
    mb_norm_ = norms.contiguous();
    mb_k_ = K;
  }

  // The Markov table (runtime.markov_table): per W1 row p a chain can look up (its table row
  // row_of[p], -1: none), high [rows, M] int32, the candidates of its bias vector's M largest
  // entries, and tau [rows] the next largest (rounded up). With it a row's candidates are the
  // shortlist, its previous pick's high set and those whose backbone logit reaches the
  // threshold below (runtime.table_threshold), or every candidate where the table has no row;
  // markov_bound's caps are not used.
  void set_markov_table(torch::Tensor high, torch::Tensor tau, torch::Tensor row_of) {
    const int64_t keys = w1_.size(0), V = head_.n;
    TORCH_CHECK(high.scalar_type() == torch::kInt && high.dim() == 2 && high.size(1) >= 1 &&
                    tau.scalar_type() == torch::kFloat && tau.numel() == high.size(0) &&
                    row_of.scalar_type() == torch::kInt && row_of.numel() == keys,
                "high must be int32 [rows, M], tau float32 [rows] and row_of int32 [keys]");
    const int32_t* h = high.data_ptr<int32_t>();
    for (int64_t i = 0; i < high.numel(); ++i)
      TORCH_CHECK(h[i] >= 0 && h[i] < V, "a high-set candidate is out of the draft vocabulary");
    const int32_t* ro = row_of.data_ptr<int32_t>();
    for (int64_t i = 0; i < keys; ++i)
      TORCH_CHECK(ro[i] >= -1 && ro[i] < high.size(0), "a table row is out of range");
    mt_high_ = high.contiguous();
    mt_tau_ = tau.contiguous();
    mt_row_of_ = row_of.contiguous();
    mt_m_ = high.size(1);
  }

  // The Markov head's W1 rows when it is keyed by target id (the peers' form): pick_keys [V_d]
  // the row of each draft index (its target id), and draft_token() keys the anchor by its id.
  void set_markov_keys(torch::Tensor pick_keys) {
    TORCH_CHECK(pick_keys.numel() == head_.n, "pick_keys must have V_d entries");
    pick_keys_ = pick_keys.to(torch::kLong).contiguous();
    const int64_t* k = pick_keys_.data_ptr<int64_t>();
    for (int64_t j = 0; j < head_.n; ++j)
      TORCH_CHECK(k[j] >= 0 && k[j] < w1_.size(0), "a pick's W1 row is out of range");
  }

  // taps [n, taps*dim] of tokens at positions start..start+n-1: their context features'
  // K/V into cache slots start..start+n-1 of every layer.
  void append(torch::Tensor cache_k, torch::Tensor cache_v, torch::Tensor taps, int64_t start) {
    TORCH_CHECK(taps.dim() == 2 && taps.size(1) == fc_.size(1) &&
                    taps.scalar_type() == torch::kFloat,
                "taps must be float32 [n, taps*dim]");
    const int64_t n = taps.size(0);
    const int64_t capacity = check_cache(cache_k, cache_v, start, n);
    if (n == 0) return;
    clock_.start();
    taps = taps.contiguous();
    const int64_t kvw = hs_.kv_heads * hs_.hd, half = hs_.hd / 2;
    std::vector<float> feats(n * dim_), kv(n * 2 * kvw);
    // fc's arithmetic in float32: the target's residual streams have outlier channels that
    // would coarsen an int8 block's step for all its other inputs
    const float* tp = taps.data_ptr<float>();
    const int64_t k = fc_.size(1);
    auto fc_over = [&](const auto* fw) {
      at::parallel_for(0, dim_, 16, [&](int64_t o0, int64_t o1) {
        fc_dots(tp, n, fw, o0, o1, k, feats.data(), dim_);
      });
    };
    if (fc_.scalar_type() == torch::kHalf)
      fc_over(reinterpret_cast<const uint16_t*>(fc_.data_ptr<at::Half>()));
    else
      fc_over(fc_.data_ptr<float>());
    clock_.mark(PhaseClock::fc);
    rms_norm_rows(feats.data(), ctx_norm_.data_ptr<float>(), feats.data(), n, dim_, eps_);
    quantize_rows(feats.data(), n, dim_, act_);
    clock_.mark(PhaseClock::context_norm);
    for (size_t li = 0; li < layers_.size(); ++li) {
      qmatmul_into(layers_[li].kv, act_, kv.data(), 2 * kvw);
      clock_.mark(PhaseClock::context_kv);
      auto [kl, vl] = layer_cache(cache_k, cache_v, li, capacity);
      for (int64_t r = 0; r < n; ++r) {
        float* row = kv.data() + r * 2 * kvw;
        const int64_t p = start + r;
        TORCH_CHECK(p < cos_.size(0), "position past the rope table");
        const torch::Tensor& kn = layers_[li].k_norm;
        for (int64_t g = 0; g < hs_.kv_heads; ++g) {
          if (kn.numel())
            rms_norm_rows(row + g * hs_.hd, kn.data_ptr<float>(), row + g * hs_.hd, 1, hs_.hd,
                          layers_[li].qk_eps);
          rope_pairs(row + g * hs_.hd, cos_.data_ptr<float>() + p * half,
                     sin_.data_ptr<float>() + p * half, half);
        }
        store_kv(hs_, row, row + kvw, kl, vl, p, capacity);
      }
      clock_.mark(PhaseClock::context_store);
    }
  }

  // The block after the anchor (embedding anchor_emb [dim], at position start, the Markov
  // head's previous token prev): rows [anchor, mask, ...] attend to the committed slots
  // [0, start) and to every block row; their K/V use scratch slots start..start+block-1.
  // noise: empty, or [block, V_d] added to the backbone logits (sampling).
  // Returns hidden [block, dim] and backbone logits [block, V_d].
  std::vector<torch::Tensor> backbone(torch::Tensor cache_k, torch::Tensor cache_v,
                                      torch::Tensor anchor_emb, int64_t start,
                                      torch::Tensor noise) {
    auto hidden = torch::empty({block_, dim_}, torch::kFloat);
    auto logits = torch::empty({block_, head_.n}, torch::kFloat);
    backbone_into(cache_k, cache_v, anchor_emb, start, noise, hidden, logits);
    return {hidden, logits};
  }

  // One draft: backbone, then the Markov head along the picks over each row's `shortlist`
  // best backbone candidates (the low-rank bias moves a ranking only near its top), the top-k
  // of the biased shortlist (the pick first), and the calibrated confidence of each pick.
  // Returns picks [block], topk ids [block, k] (draft indices), their logits, confidence.
  // The backbone's rows go to buffers kept between drafts (a fresh 2 MB of logits a draft
  // was paid in page faults and page clearing).
  std::vector<torch::Tensor> draft(torch::Tensor cache_k, torch::Tensor cache_v,
                                   torch::Tensor anchor_emb, int64_t start, int64_t prev,
                                   int64_t shortlist, int64_t topk, torch::Tensor noise) {
    if (!hidden_.defined()) {
      hidden_ = torch::empty({block_, dim_}, torch::kFloat);
      logits_ = torch::empty({block_, head_.n}, torch::kFloat);
    }
    backbone_into(cache_k, cache_v, anchor_emb, start, noise, hidden_, logits_);
    return markov(hidden_, logits_, prev, shortlist, topk);
  }

  // The anchor as a target id, for draft_token(): the target's embedding table (its row, the
  // values the target's embedding lookup gives), to_draft [ids] (target id -> draft index; an
  // id past its end, or mapped to V_d, is outside the draft vocabulary) and draft_ids [V_d]
  // (back to target ids).
  void set_vocab(QWeight embedding, torch::Tensor to_draft, torch::Tensor draft_ids) {
    TORCH_CHECK(embedding.k == dim_, "the embedding table must have dim columns");
    TORCH_CHECK(draft_ids.numel() == head_.n, "draft_ids must have V_d entries");
    embedding_ = std::move(embedding);
    to_draft_ = to_draft.to(torch::kLong).contiguous();
    draft_ids_ = draft_ids.to(torch::kLong).contiguous();
    anchor_row_ = torch::empty({dim_}, torch::kFloat);
  }

  // draft() from the anchor's target id, picks and top-k as target ids: a round's draft with
  // no tensor work around it (after a target forward the host's caches are cold, and each
  // torch call around the draft cost some 20-60 us there).
  std::vector<torch::Tensor> draft_token(torch::Tensor cache_k, torch::Tensor cache_v,
                                         int64_t anchor, int64_t start, int64_t shortlist,
                                         int64_t topk, torch::Tensor noise) {
    TORCH_CHECK(embedding_.has_value(), "set_vocab() first");
    TORCH_CHECK(anchor >= 0 && anchor < embedding_->n, "anchor id out of the vocabulary");
    embedding_->row(anchor, anchor_row_.data_ptr<float>());
    const int64_t prev = pick_keys_.defined() ? anchor  // W1 keyed by target id
                         : anchor < to_draft_.numel() ? to_draft_.data_ptr<int64_t>()[anchor]
                                                      : head_.n;
    auto out = draft(cache_k, cache_v, anchor_row_, start, prev, shortlist, topk, noise);
    const int64_t* ids = draft_ids_.data_ptr<int64_t>();
    for (int i = 0; i < 2; ++i) {
      int64_t* p = out[i].data_ptr<int64_t>();
      for (int64_t j = 0; j < out[i].numel(); ++j) p[j] = ids[p[j]];
    }
    return out;
  }

  // {phase: ms} of the append() and draft() calls since the last read (the phase clock).
  std::map<std::string, double> phase_ms() { return clock_.take(); }

 private:
  // backbone() into hidden [block, dim] and logits [block, V_d], float32, contiguous.
  void backbone_into(torch::Tensor cache_k, torch::Tensor cache_v, torch::Tensor anchor_emb,
                     int64_t start, torch::Tensor noise, torch::Tensor& hidden,
                     torch::Tensor& logits) {
    TORCH_CHECK(anchor_emb.numel() == dim_ && anchor_emb.scalar_type() == torch::kFloat,
                "anchor_emb must be float32 [dim]");
    const int64_t B = block_, capacity = check_cache(cache_k, cache_v, start, B);
    const int64_t qw = hs_.heads * hs_.hd, kvw = hs_.kv_heads * hs_.hd, qkvw = qw + 2 * kvw;
    const int64_t half = hs_.hd / 2;
    TORCH_CHECK(start + B <= cos_.size(0), "position past the rope table");
    clock_.start();
    anchor_emb = anchor_emb.contiguous();
    Scratch& sc = scratch_;
    sc.x.resize(B * dim_);
    sc.h.resize(B * dim_);
    sc.qkv.resize(B * qkvw);
    sc.attn.resize(B * qw);
    sc.y.resize(B * dim_);
    sc.gu.resize(B * 2 * ffn_);
    sc.act.resize(B * ffn_);
    auto &x = sc.x, &h = sc.h, &qkv = sc.qkv, &attn = sc.attn, &y = sc.y, &gu = sc.gu,
         &act = sc.act;
    std::memcpy(x.data(), anchor_emb.data_ptr<float>(), dim_ * 4);
    for (int64_t r = 1; r < B; ++r) std::memcpy(&x[r * dim_], mask_.data_ptr<float>(), dim_ * 4);
    std::vector<uint8_t> all(B * B, 1);  // non-causal inside the block
    static constexpr PhaseClock::Phase tail[] = {PhaseClock::o, PhaseClock::ffn_norm,
                                                 PhaseClock::gate_up, PhaseClock::gate,
                                                 PhaseClock::down};
    auto mark_tail = [this](int step) { clock_.mark(tail[step]); };
    for (size_t li = 0; li < layers_.size(); ++li) {
      const DraftLayer& ly = layers_[li];
      auto [kl, vl] = layer_cache(cache_k, cache_v, li, capacity);
      rms_norm_rows(x.data(), ly.attn_norm.data_ptr<float>(), h.data(), B, dim_, eps_);
      quantize_rows(h.data(), B, dim_, act_);
      clock_.mark(PhaseClock::block_norm);
      qmatmul_into(ly.qkv, act_, qkv.data(), qkvw);
      clock_.mark(PhaseClock::qkv);
      for (int64_t r = 0; r < B; ++r) {
        float* row = qkv.data() + r * qkvw;
        const float* cs = cos_.data_ptr<float>() + (start + r) * half;
        const float* sn = sin_.data_ptr<float>() + (start + r) * half;
        for (int64_t hh = 0; hh < hs_.heads + hs_.kv_heads; ++hh) {
          const torch::Tensor& norm = hh < hs_.heads ? ly.q_norm : ly.k_norm;
          if (norm.numel())
            rms_norm_rows(row + hh * hs_.hd, norm.data_ptr<float>(), row + hh * hs_.hd, 1, hs_.hd,
                          ly.qk_eps);
          rope_pairs(row + hh * hs_.hd, cs, sn, half);
        }
        store_kv(hs_, row + qw, row + qw + kvw, kl, vl, start + r, capacity);
      }
      clock_.mark(PhaseClock::block_rope);
      Segment block{kl, vl, start, capacity, 0, B, reinterpret_cast<const bool*>(all.data()), B};
      block.block = true;  // every row sees the others: one pass of each K/V tile for all
      attend(hs_, qkv.data(), qkvw, {block}, attn.data());
      clock_.mark(PhaseClock::attention);
      attn_out_and_ffn(ly, x.data(), attn.data(), B, dim_, qw, ffn_, eps_, act_, h.data(), y.data(),
                       gu.data(), act.data(), {}, mark_tail);
    }
    rms_norm_rows(x.data(), out_norm_.data_ptr<float>(), hidden.data_ptr<float>(), B, dim_, eps_);
    quantize_rows(hidden.data_ptr<float>(), B, dim_, act_);
    clock_.mark(PhaseClock::out_norm);
    qmatmul_into(head_, act_, logits.data_ptr<float>(), head_.n);
    clock_.mark(PhaseClock::head);
    if (noise.numel()) {
      TORCH_CHECK(noise.sizes() == logits.sizes() && noise.scalar_type() == torch::kFloat,
                  "noise must be float32 [block, V_d]");
      logits.add_(noise);
    }
  }

 public:

  // out[j] = lr[cand[j]] + w2[cand[j]].e over candidates cand (fused_dots)
  void biased_into_(const std::vector<int64_t>& cand, const float* lr, const float* e,
                    std::vector<float>& out) const {
    const int64_t n = static_cast<int64_t>(cand.size()), r = w1_.size(1);
    out.resize(n);
    if (r % (2 * W) == 0) {
      if (w2h_.defined())
        fused_dots(reinterpret_cast<const uint16_t*>(w2h_.data_ptr<at::Half>()), cand.data(), n,
                   e, r, out.data());
      else
        fused_dots(w2_.data_ptr<float>(), cand.data(), n, e, r, out.data());
      for (int64_t j = 0; j < n; ++j) out[j] = lr[cand[j]] + out[j];
    } else {
      const float* w2 = w2_.data_ptr<float>();
      for (int64_t j = 0; j < n; ++j) out[j] = lr[cand[j]] + dot(w2 + cand[j] * r, e, r);
    }
  }

  // A row's candidates under the Markov table: the shortlist `cand` (values in sv), then its
  // previous pick's high set, then every other candidate whose backbone logit l reaches the
  // threshold of the K-th best so far (l + 2^-22 |l| >= it), in index order, each biased
  // exactly; into merged_ and sv (runtime.markov_chain's order, so both paths rank the same
  // list): the top K of the whole vocabulary is among them.
  void table_candidates(const std::vector<int64_t>& cand, const float* lr, const float* e,
                        int64_t row, int64_t K, std::vector<float>& sv) {
    const int64_t V = head_.n, r = w1_.size(1), M = mt_m_;
    if (static_cast<int64_t>(in_short_.size()) != V) in_short_.assign(V, 0);
    merged_.assign(cand.begin(), cand.end());
    for (int64_t j : cand) in_short_[j] = 1;
    const int32_t* high = mt_high_.data_ptr<int32_t>() + row * M;
    extra_.clear();
    for (int64_t q = 0; q < M; ++q)
      if (!in_short_[high[q]]) {
        in_short_[high[q]] = 1;
        extra_.push_back(high[q]);
      }
    auto append = [&]() {
      biased_into_(extra_, lr, e, extra_v_);
      merged_.insert(merged_.end(), extra_.begin(), extra_.end());
      sv.insert(sv.end(), extra_v_.begin(), extra_v_.end());
    };
    append();
    double e2 = 0.0;
    for (int64_t k = 0; k < r; ++k) e2 += double(e[k]) * e[k];
    const double en = std::sqrt(e2) * (1 + 0x1p-20), tau = mt_tau_.data_ptr<float>()[row];
    // the K-th best so far: every candidate that can enter the top K reaches the threshold
    float thr = -std::numeric_limits<float>::infinity();
    if (static_cast<int64_t>(sv.size()) >= K) {
      kth_.assign(sv.begin(), sv.end());
      std::nth_element(kth_.begin(), kth_.begin() + (K - 1), kth_.end(), std::greater<float>());
      const double kth = kth_[K - 1];
      const double slack = 2.0 * (r + 8) * 0x1p-24 * w2_max_ * en;
      thr = static_cast<float>(kth - tau - slack -
                               0x1p-22 * (std::abs(kth) + std::abs(tau) + slack));
    }
    extra_.clear();
    const vf vthr = vset1(thr), vk = vset1(0x1p-22f);
    int64_t j = 0;
    for (; j + W <= V; j += W) {
      const vf l = vload(lr + j);
      for (unsigned bits = vge_mask(vfma(vk, vabs(l), l), vthr); bits; bits &= bits - 1) {
        const int64_t c = j + __builtin_ctz(bits);
        if (!in_short_[c]) extra_.push_back(c);
      }
    }
    for (; j < V; ++j)
      if (lr[j] + 0x1p-22f * std::abs(lr[j]) >= thr && !in_short_[j]) extra_.push_back(j);
    for (int64_t c : merged_) in_short_[c] = 0;  // unmarked for the next row
    append();
  }

  // The Markov and confidence heads over given backbone rows (draft() and the tests).
  std::vector<torch::Tensor> markov(torch::Tensor hidden, torch::Tensor logits, int64_t prev,
                                    int64_t shortlist, int64_t topk) {
    const int64_t B = block_, V = head_.n, r = w1_.size(1);
    TORCH_CHECK(hidden.sizes() == torch::IntArrayRef({B, dim_}) &&
                    logits.sizes() == torch::IntArrayRef({B, V}),
                "hidden [block, dim] and logits [block, V_d]");
    TORCH_CHECK(prev >= 0 && prev < w1_.size(0), "previous token's W1 row out of range");
    const int64_t S = std::min(shortlist, V), K = std::min(topk, S);
    TORCH_CHECK(K >= 1, "topk and shortlist must be at least 1");
    hidden = hidden.contiguous();
    logits = logits.contiguous();
    auto picks = torch::empty({B}, torch::kLong);
    auto top_ids = torch::empty({B, K}, torch::kLong);
    auto top_v = torch::empty({B, K}, torch::kFloat);
    auto conf = torch::empty({B}, torch::kFloat);
    const float* w1 = w1_.data_ptr<float>();
    const float* cw = conf_.data_ptr<float>();
    std::vector<int64_t> order;
    std::vector<float> sv;
    clock_.start();
    // best first, ties to the lower index: one ranking everywhere
    shortlists_.resize(B);
    auto shortlist_row = [&](int64_t i) {
      Shortlist& sl = shortlists_[i];
      shortlist_of(logits.data_ptr<float>() + i * V, V, S, sl.idx, sl.maxima, sl.cand);
    };
    if (B >= 4) {  // both threads, rows on either: the same ranking
      at::parallel_for(0, B, (B + 1) / 2, [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) shortlist_row(i);
      });
    } else {
      for (int64_t i = 0; i < B; ++i) shortlist_row(i);
    }
    clock_.mark(PhaseClock::shortlist);
    if (static_cast<int64_t>(all_.size()) != V) {
      all_.resize(V);
      std::iota(all_.begin(), all_.end(), 0);
    }
    auto biased_into = [&](const std::vector<int64_t>& cand, const float* lr, const float* e,
                           std::vector<float>& out) { biased_into_(cand, lr, e, out); };
    auto biased = [&](const std::vector<int64_t>& cand, const float* lr, const float* e) {
      biased_into(cand, lr, e, sv);
    };
    const int64_t* pick_keys = pick_keys_.defined() ? pick_keys_.data_ptr<int64_t>() : nullptr;
    for (int64_t i = 0; i < B; ++i) {
      const float* lr = logits.data_ptr<float>() + i * V;
      const float* e = w1 + prev * r;
      const std::vector<int64_t>* cand = &shortlists_[i].idx;
      biased(*cand, lr, e);
      const int32_t row = mt_m_ > 0 ? mt_row_of_.data_ptr<int32_t>()[prev] : -1;
      if (mt_m_ > 0 && row < 0) {  // a key the table lacks: every candidate
        cand = &all_;
        biased(all_, lr, e);
      } else if (mt_m_ > 0) {
        table_candidates(*cand, lr, e, row, K, sv);
        cand = &merged_;
      } else if (S < V) {
        // Exact or full: an outside candidate has a base logit <= the shortlist's last and a
        // bias <= |w2 row| |e| (Cauchy-Schwarz), plus the float rounding of an r-term dot and
        // an add (generous factors); a best strictly above that cap is the argmax of all V.
        double e2 = 0.0;
        for (int64_t k = 0; k < r; ++k) e2 += double(e[k]) * e[k];
        const double bias_cap = w2_max_ * std::sqrt(e2) * (1.0 + r * 0x1p-23);
        const double last = lr[(*cand)[S - 1]];
        const double cap = last + bias_cap + 0x1p-22 * (std::abs(last) + bias_cap);
        const float best = *std::max_element(sv.begin(), sv.end());
        if (!(best > cap) && mb_k_ > 0) {
          // Per candidate: w2_j.e = (P_j).(B^T e) + (its rest).(e's rest) <= P_j.pe + res_j re
          // (Cauchy-Schwarz on the part outside W2's top directions, where little is left),
          // plus slack for this pass's float rounding and the exact path's (an r-term dot and
          // an add: (r + 2K + 8) 2^-24 of |base| + 2 |w2_j| |e|, generous). Candidates whose cap
          // reaches the shortlist's best join it and are computed exactly; no other can win.
          const int64_t Kb = mb_k_;
          const float* basis = mb_basis_.data_ptr<float>();
          double pe[64], re2 = 0.0;
          for (int64_t q = 0; q < Kb; ++q) {
            double acc = 0.0;
            for (int64_t k = 0; k < r; ++k) acc += double(e[k]) * basis[k * Kb + q];
            pe[q] = acc;
          }
          for (int64_t k = 0; k < r; ++k) {
            double rest = e[k];
            for (int64_t q = 0; q < Kb; ++q) rest -= basis[k * Kb + q] * pe[q];
            re2 += rest * rest;
          }
          const float re = static_cast<float>(std::sqrt(re2) * (1 + 0x1p-20));
          const float en = static_cast<float>(std::sqrt(e2) * (1 + 0x1p-20));
          const float c = static_cast<float>(r + 2 * Kb + 8) * 0x1p-24f;
          in_short_.assign(V, 0);
          for (int64_t j : *cand) in_short_[j] = 1;
          const float *proj = mb_proj_.data_ptr<float>(), *res = mb_res_.data_ptr<float>(),
                      *nrm = mb_norm_.data_ptr<float>();
          const vf vbest = vset1(best), vc = vset1(c), vre = vset1(re), v2cen = vset1(2 * c * en);
          // Part p of the vocabulary, [j0, j1) (j0 a multiple of W): its candidates outside the
          // shortlist whose cap reaches the best, in order, and their exact biased values. A
          // trained W2 lets hundreds through a row (the gathers of their W2 rows are most of
          // the Markov phase), so a large vocabulary's two halves run on two threads; the
          // candidates and each one's float steps are the same either way.
          auto scan = [&](int64_t p, int64_t j0, int64_t j1) {
            std::vector<int64_t>& found = found_[p];
            found.clear();
            auto reaches = [&](int64_t j) {
              if (!in_short_[j]) found.push_back(j);
            };
            int64_t j = j0;
            for (; j + W <= j1; j += W) {
              const vf l = vload(lr + j);
              vf capv = vfma(vc, vabs(l), l);
              for (int64_t q = 0; q < Kb; ++q)
                capv = vfma(vload(proj + q * V + j), vset1(static_cast<float>(pe[q])), capv);
              capv = vfma(vload(res + j), vre, capv);
              capv = vfma(vload(nrm + j), v2cen, capv);
              for (unsigned bits = vge_mask(capv, vbest); bits; bits &= bits - 1)
                reaches(j + __builtin_ctz(bits));
            }
            for (; j < j1; ++j) {
              float capj = lr[j] + c * std::abs(lr[j]);
              for (int64_t q = 0; q < Kb; ++q)
                capj += proj[q * V + j] * static_cast<float>(pe[q]);
              capj += res[j] * re + nrm[j] * 2 * c * en;
              if (capj >= best) reaches(j);
            }
            biased_into(found, lr, e, found_v_[p]);
          };
          const int64_t split = V >= kSplitMarkovV ? V / 2 / W * W : V;
          if (split < V) {
            at::parallel_for(0, 2, 1, [&](int64_t p0, int64_t p1) {
              for (int64_t p = p0; p < p1; ++p) scan(p, p == 0 ? 0 : split, p == 0 ? split : V);
            });
          } else {
            scan(0, 0, V);
            found_[1].clear();
            found_v_[1].clear();
          }
          if (!found_[0].empty() || !found_[1].empty()) {
            // the shortlist (its values in sv already), then the parts' candidates in order
            merged_.assign(cand->begin(), cand->end());
            for (int64_t p = 0; p < 2; ++p) {
              merged_.insert(merged_.end(), found_[p].begin(), found_[p].end());
              sv.insert(sv.end(), found_v_[p].begin(), found_v_[p].end());
            }
            cand = &merged_;
          }
        } else if (!(best > cap)) {
          cand = &all_;
          biased(all_, lr, e);
        }
      }
      clock_.mark(PhaseClock::markov);
      const std::vector<int64_t>& idx = *cand;
      order.resize(idx.size());
      std::iota(order.begin(), order.end(), 0);
      auto by_value = [&](int64_t a, int64_t b) {  // best first, ties to the lower index
        return sv[a] > sv[b] || (sv[a] == sv[b] && idx[a] < idx[b]);
      };
      std::partial_sort(order.begin(), order.begin() + K, order.end(), by_value);
      for (int64_t j = 0; j < K; ++j) {
        top_ids.data_ptr<int64_t>()[i * K + j] = idx[order[j]];
        top_v.data_ptr<float>()[i * K + j] = sv[order[j]];
      }
      clock_.mark(PhaseClock::topk);
      const float c = dot(cw, hidden.data_ptr<float>() + i * dim_, dim_) + dot(cw + dim_, e, r) +
                      conf_bias_;
      conf.data_ptr<float>()[i] = 1.0f / (1.0f + std::exp(-c / temp_.data_ptr<float>()[i]));
      picks.data_ptr<int64_t>()[i] = idx[order[0]];
      prev = pick_keys ? pick_keys[idx[order[0]]] : idx[order[0]];
      clock_.mark(PhaseClock::confidence);
    }
    return {picks, top_ids, top_v, conf};
  }

 private:
  static float dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  // cache [layers, kv_heads, capacity, head_dim] fp16; returns the capacity.
  int64_t check_cache(const torch::Tensor& k, const torch::Tensor& v, int64_t start, int64_t n) {
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == torch::kHalf &&
                    k.dim() == 4 && k.size(0) == static_cast<int64_t>(layers_.size()) &&
                    k.size(1) == hs_.kv_heads && k.size(3) == hs_.hd && v.sizes() == k.sizes(),
                "drafter cache must be float16 [layers, kv_heads, capacity, head_dim]");
    TORCH_CHECK(start >= 0 && n >= 0 && start + n <= k.size(2), "rows do not fit the cache");
    return k.size(2);
  }

  std::pair<uint16_t*, uint16_t*> layer_cache(torch::Tensor& k, torch::Tensor& v, size_t li,
                                              int64_t capacity) {
    const int64_t stride = hs_.kv_heads * capacity * hs_.hd;
    return {reinterpret_cast<uint16_t*>(k.data_ptr<at::Half>()) + li * stride,
            reinterpret_cast<uint16_t*>(v.data_ptr<at::Half>()) + li * stride};
  }

  int64_t dim_;
  Heads hs_;
  int64_t ffn_, block_;
  float eps_;
  torch::Tensor cos_, sin_;
  torch::Tensor fc_;  // float32 or float16 [dim, taps*dim]
  torch::Tensor ctx_norm_, mask_, out_norm_;
  QWeight head_;
  torch::Tensor w1_, w2_, conf_;
  torch::Tensor w2h_;  // W2 as fp16 where the caller passed it so (each weight one): the Markov
                       // pass gathers half the bytes, the same values
  float conf_bias_;
  torch::Tensor temp_;
  std::vector<DraftLayer> layers_;
  QAct act_;
  struct Scratch {  // the backbone's per-row buffers, kept between calls
    std::vector<float> x, h, qkv, attn, y, gu, act;
  } scratch_;
  torch::Tensor hidden_, logits_;  // draft()'s backbone rows
  PhaseClock clock_;
  double w2_max_ = 0.0;  // the largest |W2 row|
  torch::Tensor pick_keys_;  // set_markov_keys()'s, or undefined: W1 keyed by draft index
  std::vector<int64_t> all_;  // 0..V_d-1: every candidate, where a shortlist is not exact
  torch::Tensor mb_basis_, mb_proj_, mb_res_, mb_norm_;  // set_markov_bound()'s
  int64_t mb_k_ = 0;
  // the Markov cap pass's two vocabulary parts: reaching candidates and their values
  std::array<std::vector<int64_t>, 2> found_;
  std::array<std::vector<float>, 2> found_v_;
  static constexpr int64_t kSplitMarkovV = 4096;  // smaller vocabularies scan on one thread
  std::vector<uint8_t> in_short_;  // the shortlist's members, marked
  std::vector<int64_t> merged_;    // the shortlist and the candidates its bound cannot exclude
  torch::Tensor mt_high_, mt_tau_, mt_row_of_;  // set_markov_table()'s
  int64_t mt_m_ = 0;
  std::vector<int64_t> extra_;  // table_candidates()'s high set, then its threshold's
  std::vector<float> extra_v_, kth_;
  std::optional<QWeight> embedding_;  // set_vocab()'s
  torch::Tensor to_draft_, draft_ids_, anchor_row_;
  struct Shortlist {  // a row's shortlist and its scratch, kept between calls
    std::vector<int64_t> idx, cand;
    std::vector<float> maxima;
  };
  std::vector<Shortlist> shortlists_;
};

}  // namespace adaspark
