// The target: a llama / qwen2 / qwen3 / gemma3 / lfm2 (and their routed kin) stack over a fp16 K/V cache, and its LM head.
// An architecture is a choice of parts per layer (Layer: optional norms and bias, the gate's
// activation, an attention window, a RoPE table) and two model-wide numbers (embed_scale,
// attn_scale), all handed over by transformer.py's _native_model. A layer with conv taps is an
// LFM2 short-convolution layer (shortconv.h): qkv holds its in_proj, o its out_proj. A layer
// with experts (route_layer) runs a routed FFN (moe.h) instead of gate_up / down.
#pragma once

#include <memory>

#include "kernels.h"
#include "moe.h"
#include "shortconv.h"

namespace adaspark {

struct Layer {
  torch::Tensor attn_norm, ffn_norm, q_norm, k_norm, qkv_bias;  // the last three may be empty
  QWeight qkv, o, gate_up, down;
  torch::Tensor post_attn_norm, post_ffn_norm;  // may be empty
  Act act;
  int64_t window;            // attention sees positions > p - window; 0: all
  torch::Tensor cos, sin;    // this layer's RoPE table [positions, head_dim / 2]
  torch::Tensor conv_taps;   // float32 [L, dim] (tap-major): a short-convolution layer; empty: attention
  int64_t cache_index;       // its index among the layers of its kind (K/V or B*x slots)
  std::shared_ptr<Routed> experts = nullptr;  // a routed FFN (gate_up, down then empty)

  BlockParts parts() const {
    auto ptr = [](const torch::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; };
    return BlockParts{ptr(post_attn_norm), ptr(post_ffn_norm), act};
  }
};

inline Act act_named(const std::string& name) {
  if (name == "silu") return Act::silu;
  TORCH_CHECK(name == "gelu_tanh", "unknown activation ", name);
  return Act::gelu_tanh;
}

class Model {
 public:
  Model(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t ffn,
        double eps, torch::Tensor rope_cos, torch::Tensor rope_sin, QWeight embeddings,
        torch::Tensor out_norm, QWeight head, torch::Tensor head_bounds, torch::Tensor head_norms,
        double embed_scale, double attn_scale)
      : dim_(dim), heads_(n_heads), kv_heads_(n_kv_heads), hd_(head_dim), ffn_(ffn),
        eps_(static_cast<float>(eps)), cos_(rope_cos.contiguous()), sin_(rope_sin.contiguous()),
        emb_(std::move(embeddings)), out_norm_(out_norm.contiguous()), head_(std::move(head)),
        head_bounds_(head_bounds.contiguous()),
        head_norms_(head_norms.contiguous()), embed_scale_(static_cast<float>(embed_scale)),
        attn_scale_(static_cast<float>(attn_scale)) {
    TORCH_CHECK(emb_.k == dim_ && head_.k == dim_, "embeddings and head must have dim inputs");
    TORCH_CHECK(head_bounds_.scalar_type() == torch::kFloat && head_bounds_.numel() == 2 * head_.nb,
                "head_bounds must be float32 [2, blocks]");
    TORCH_CHECK(head_norms_.scalar_type() == torch::kFloat && head_norms_.numel() == head_.n,
                "head_norms must be float32 [vocab]");
    TORCH_CHECK(attend_takes(hd_) && dim_ % W == 0,
                "head_dim must be 2, 4, 8 or 16 times ", W, " and dim a multiple of ", W);
    TORCH_CHECK(heads_ % kv_heads_ == 0, "heads must be a multiple of kv heads");
  }

  // rope_cos / rope_sin: the layer's own table (empty: the model's); post norms may be empty.
  void add_layer(torch::Tensor attn_norm, torch::Tensor ffn_norm, torch::Tensor q_norm,
                 torch::Tensor k_norm, torch::Tensor qkv_bias, QWeight qkv, QWeight o,
                 std::optional<QWeight> gate_up, std::optional<QWeight> down,
                 torch::Tensor post_attn_norm,
                 torch::Tensor post_ffn_norm, const std::string& act, int64_t window,
                 torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor conv_taps) {
    if (!rope_cos.numel()) rope_cos = cos_, rope_sin = sin_;
    const bool conv = conv_taps.numel() > 0;
    TORCH_CHECK(!conv || (conv_taps.dim() == 2 && conv_taps.size(0) == dim_ &&
                          conv_taps.scalar_type() == torch::kFloat && qkv.n == 3 * dim_ &&
                          o.k == dim_ && (conv_l_ == 0 || conv_l_ == conv_taps.size(1))),
                "conv taps must be float32 [dim, L] (one L), in_proj 3 * dim rows, out_proj dim "
                "inputs");
    if (conv) conv_l_ = conv_taps.size(1);
    const int64_t index = conv ? conv_layers_++ : attn_layers_++;
    TORCH_CHECK(rope_cos.sizes() == cos_.sizes() && rope_sin.sizes() == cos_.sizes() &&
                    rope_cos.scalar_type() == torch::kFloat &&
                    rope_sin.scalar_type() == torch::kFloat,
                "a layer's RoPE table must be float32 shaped like the model's");
    for (const torch::Tensor* t : {&post_attn_norm, &post_ffn_norm})
      TORCH_CHECK(!t->numel() || (t->numel() == dim_ && t->scalar_type() == torch::kFloat),
                  "post norms must be empty or float32 [dim]");
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
    layers_.push_back(Layer{attn_norm.contiguous(), ffn_norm.contiguous(), q_norm.contiguous(),
                            k_norm.contiguous(), qkv_bias.contiguous(), std::move(qkv),
                            std::move(o), gate_up.value_or(QWeight()),
                            down.value_or(QWeight()),
                            post_attn_norm.contiguous(), post_ffn_norm.contiguous(),
                            act_named(act), window, rope_cos.contiguous(), rope_sin.contiguous(),
                            conv ? conv_taps.t().contiguous() : conv_taps, index});
  }

  // Layer `layer`'s FFN as a routed one (moe.h): router float32 [E, dim], selection bias
  // float32 [E] or empty, the packed expert tensors (gate_exps and up_exps [E * ffn, dim],
  // down_exps [E * dim, ffn]), top-k `used`, gating "softmax" | "sigmoid", norm: renormalise
  // the chosen weights.
  void route_layer(int64_t layer, torch::Tensor router, torch::Tensor bias, QWeight gate_exps,
                   QWeight up_exps, QWeight down_exps, int64_t used, const std::string& gating,
                   bool norm) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "no layer ", layer);
    layers_[layer].experts = std::make_shared<Routed>(
        make_routed(dim_, router, bias, gate_exps, up_exps, down_exps, used, gating, norm));
  }

  // Layer `layer`'s FFN alone on rows h [n, dim] (float32, already normed): its output before
  // the residual add (tests compare a routed FFN with the reference's on the same rows).
  torch::Tensor ffn(int64_t layer, torch::Tensor h) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "no layer ", layer);
    TORCH_CHECK(h.dim() == 2 && h.size(1) == dim_ && h.scalar_type() == torch::kFloat,
                "h must be float32 [n, dim]");
    h = h.contiguous();
    const int64_t n = h.size(0);
    auto y = torch::empty({n, dim_}, torch::kFloat);
    QAct a;
    quantize_rows(h.data_ptr<float>(), n, dim_, a);
    const Layer& ly = layers_[layer];
    if (ly.experts) {
      MoeScratch s;
      routed_ffn(*ly.experts, a, h.data_ptr<float>(), n, dim_, y.data_ptr<float>(), s);
    } else {
      std::vector<float> gu(n * 2 * ffn_), act(n * ffn_);
      gated_ffn(ly.gate_up, ly.down, a, y.data_ptr<float>(), n, dim_, ffn_, gu.data(),
                act.data(), ly.act);
    }
    return y;
  }

  // Rows at cache slots start..start+n-1, positions `positions`; row r sees the committed
  // slots [0, start) and rows t with anc[r, t]. Writes their K/V into the cache.
  // Returns the final-normed rows [n, dim] and the residual after each tap layer [taps, n, dim].
  // conv: the B*x cache of the conv layers [conv layers, 1, capacity, dim] fp16 (empty: none);
  // conv_src [n, L]: the slot each row's conv tap reads (-1: zero; shortconv.py's sources).
  std::vector<torch::Tensor> forward(torch::Tensor cache_k, torch::Tensor cache_v,
                                     torch::Tensor tokens, torch::Tensor positions, int64_t start,
                                     torch::Tensor anc, std::vector<int64_t> taps,
                                     torch::Tensor conv, torch::Tensor conv_src) {
    return forward_batch({cache_k}, {cache_v}, {start}, {tokens.numel()}, tokens, positions, anc,
                         taps, {conv}, conv_src);
  }

  // Several sequences' rows in one call: sequence s owns the next counts[s] rows, at slots
  // starts[s].. of its own cache; anc [n, n] may only join rows of one sequence. A row comes
  // out bit-identical to the same row in a call of its sequence alone: the matmuls treat rows
  // independently and attention keeps to each row's sequence.
  std::vector<torch::Tensor> forward_batch(std::vector<torch::Tensor> caches_k,
                                           std::vector<torch::Tensor> caches_v,
                                           std::vector<int64_t> starts, std::vector<int64_t> counts,
                                           torch::Tensor tokens, torch::Tensor positions,
                                           torch::Tensor anc, std::vector<int64_t> taps,
                                           std::vector<torch::Tensor> caches_conv,
                                           torch::Tensor conv_src) {
    const int64_t n = tokens.numel(), L = static_cast<int64_t>(layers_.size());
    const size_t seqs = caches_k.size();
    TORCH_CHECK(seqs >= 1 && caches_v.size() == seqs && starts.size() == seqs &&
                    counts.size() == seqs, "one cache pair, start and row count per sequence");
    TORCH_CHECK(positions.numel() == n, "one position per row");
    TORCH_CHECK(anc.scalar_type() == torch::kBool && anc.dim() == 2 && anc.size(0) == n &&
                    anc.size(1) == n, "anc must be bool [n, n]");
    anc = anc.contiguous();
    const bool* ancp = anc.data_ptr<bool>();
    std::vector<int64_t> row0(seqs + 1, 0), seq_of(n), slot_of(n);
    for (size_t s = 0; s < seqs; ++s) {
      const torch::Tensor &ck = caches_k[s], &cv = caches_v[s];
      TORCH_CHECK(ck.is_contiguous() && cv.is_contiguous() && ck.scalar_type() == torch::kHalf &&
                      ck.dim() == 5 && ck.size(0) == attn_layers_ && ck.size(1) == 1 &&
                      ck.size(2) == kv_heads_ && ck.size(4) == hd_ && cv.sizes() == ck.sizes(),
                  "cache must be float16 [layers, 1, kv_heads, capacity, head_dim], contiguous");
      TORCH_CHECK(counts[s] >= 1 && starts[s] >= 0 && starts[s] + counts[s] <= ck.size(3),
                  "rows do not fit the cache");
      if (conv_layers_) {
        TORCH_CHECK(caches_conv.size() == seqs, "one conv cache per sequence");
        const torch::Tensor& cc = caches_conv[s];
        TORCH_CHECK(cc.is_contiguous() && cc.scalar_type() == torch::kHalf && cc.dim() == 4 &&
                        cc.size(0) == conv_layers_ && cc.size(1) == 1 &&
                        cc.size(2) == ck.size(3) && cc.size(3) == dim_,
                    "conv cache must be float16 [conv layers, 1, capacity, dim], contiguous");
      }
      for (size_t o = 0; o < s; ++o)
        TORCH_CHECK(!ck.is_same(caches_k[o]) && !cv.is_same(caches_v[o]),
                    "each sequence needs a cache of its own");
      row0[s + 1] = row0[s] + counts[s];
      for (int64_t r = row0[s]; r < row0[s + 1] && r < n; ++r) {
        seq_of[r] = static_cast<int64_t>(s);
        slot_of[r] = starts[s] + r - row0[s];
      }
    }
    TORCH_CHECK(row0[seqs] == n, "row counts must add up to the rows");
    for (int64_t r = 0; seqs > 1 && r < n; ++r)  // one sequence: nothing to join
      for (int64_t t = 0; t < n; ++t)
        TORCH_CHECK(!ancp[r * n + t] || seq_of[r] == seq_of[t], "anc joins rows of two sequences");
    tokens = tokens.to(torch::kLong).contiguous();
    positions = positions.to(torch::kLong).contiguous();
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(tok[r] >= 0 && tok[r] < emb_.n, "token id out of range");
      TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_.size(0), "position past the rope table");
    }
    for (int64_t t : taps) TORCH_CHECK(t >= 0 && t < L, "tap layer out of range");
    const int64_t* src = nullptr;
    if (conv_layers_) {
      conv_src = conv_src.to(torch::kLong).contiguous();
      TORCH_CHECK(conv_src.dim() == 2 && conv_src.size(0) == n && conv_src.size(1) == conv_l_,
                  "conv_src must be [n, L]");
      src = conv_src.data_ptr<int64_t>();
      for (int64_t r = 0; r < n; ++r)
        for (int64_t k = 0; k < conv_l_; ++k)
          TORCH_CHECK(src[r * conv_l_ + k] >= -1 &&
                          src[r * conv_l_ + k] < caches_k[seq_of[r]].size(3) &&
                          src[r * conv_l_ + k] <= slot_of[r],
                      "a conv tap reads a slot outside the row's past");
    }

    const int64_t qw = heads_ * hd_, kvw = kv_heads_ * hd_, qkvw = qw + 2 * kvw;
    // scratch kept between calls: a fresh allocation per call costs page faults
    std::vector<float>&x = x_, &h = h_, &qkv = qkv_, &attn = attn_, &gu = gu_, &act = act_,
                       &y = y_;
    const int64_t mixw = conv_layers_ ? std::max(qkvw, 3 * dim_) : qkvw;
    x.resize(n * dim_); h.resize(n * std::max(dim_, qw)); qkv.resize(n * mixw);
    attn.resize(n * std::max(qw, dim_)); gu.resize(n * 2 * ffn_); act.resize(n * ffn_); y.resize(n * dim_);
    for_rows(n, [&](int64_t r) { emb_.row(tok[r], &x[r * dim_]); });  // gguf's values
    if (embed_scale_ != 1.0f)  // float32 times the float32 scale, as torch and llama.cpp round it
      for (int64_t i = 0; i < n * dim_; ++i) x[i] *= embed_scale_;
    auto hiddens = torch::empty({static_cast<int64_t>(taps.size()), n, dim_}, torch::kFloat);
    QAct& a = act_q_;
    std::vector<Segment> segs(seqs);
    std::vector<ConvSegment> conv_segs(seqs);
    std::vector<char> chain(seqs);  // long chains (prefill chunks) attend over the cache alone
    for (size_t s = 0; s < seqs; ++s)
      chain[s] = counts[s] >= kChainRows &&
                 is_chain(ancp + row0[s] * n + row0[s], n, pos + row0[s], starts[s], counts[s]);

    for (int64_t li = 0; li < L; ++li) {
      const Layer& ly = layers_[li];
      const float* norm = ly.attn_norm.data_ptr<float>();
      prepare_rows(n, dim_, a);
      for_rows(n, [&](int64_t r) {
        rms_norm_row(&x[r * dim_], norm, &h[r * dim_], dim_, eps_);
        quantize_row(&h[r * dim_], r, a);
      });
      if (ly.conv_taps.numel()) {  // a short-convolution layer: in_proj, the conv, out_proj
        qmatmul_into(ly.qkv, a, qkv.data(), 3 * dim_);
        for (size_t s = 0; s < seqs; ++s) {
          const int64_t capacity = caches_conv[s].size(2);
          conv_segs[s] = ConvSegment{
              reinterpret_cast<uint16_t*>(caches_conv[s].data_ptr<at::Half>()) +
                  ly.cache_index * capacity * dim_, capacity};
        }
        shortconv_rows(qkv.data(), n, dim_, ly.conv_taps.data_ptr<float>(), conv_l_, src,
                       conv_segs, seq_of.data(), slot_of.data(), attn.data());
        block_tail(ly, x.data(), attn.data(), n, dim_, a, h.data(), y.data(), gu.data(),
                   act.data());
        for (size_t t = 0; t < taps.size(); ++t)
          if (taps[t] == li) std::memcpy(hiddens[t].data_ptr<float>(), x.data(), n * dim_ * 4);
        continue;
      }
      qmatmul_into(ly.qkv, a, qkv.data(), qkvw);
      for (size_t s = 0; s < seqs; ++s) {
        const int64_t capacity = caches_k[s].size(3),
                      layer = ly.cache_index * kv_heads_ * capacity * hd_;
        segs[s] = Segment{reinterpret_cast<uint16_t*>(caches_k[s].data_ptr<at::Half>()) + layer,
                          reinterpret_cast<uint16_t*>(caches_v[s].data_ptr<at::Half>()) + layer,
                          starts[s], capacity, row0[s], counts[s], ancp + row0[s] * n + row0[s], n,
                          pos + row0[s], ly.window, chain[s] != 0};
      }
      place_qkv(ly, qkv.data(), n, pos, segs, seq_of.data(), slot_of.data());
      attend(Heads{heads_, kv_heads_, hd_, attn_scale_}, qkv.data(), qkvw, segs, attn.data());
      block_tail(ly, x.data(), attn.data(), n, qw, a, h.data(), y.data(), gu.data(), act.data());
      for (size_t t = 0; t < taps.size(); ++t)
        if (taps[t] == li) std::memcpy(hiddens[t].data_ptr<float>(), x.data(), n * dim_ * 4);
    }
    auto out = torch::empty({n, dim_}, torch::kFloat);
    rms_norm_rows(x.data(), out_norm_.data_ptr<float>(), out.data_ptr<float>(), n, dim_, eps_);
    return {out, hiddens};
  }

  // Logits [n, vocab] and argmax [n] of final-normed rows x. The quantised logit q_c of a
  // vocabulary row w_c misses x.w_c by the activations' rounding e (x = dx*q + e, known per
  // row): |e.w_c| <= |e| |w_c| (Cauchy-Schwarz), plus the float rounding of the int8 path
  // (per block (nb+4) 2^-22 127 dx tmax, tmax from head_bounds) and of the float32 dot itself
  // (< 2^-18 |x| |w_c|). So q_c + that bound caps x.w_c; only the logits whose cap reaches the
  // float32 value of the top quantised one are recomputed in float32 from the head's rows
  // decoded to gguf's float32 values (a handful per row), and the argmax is the float32 head's, lowest id among equal maxima as torch's.
  std::vector<torch::Tensor> head(torch::Tensor rows) {
    TORCH_CHECK(rows.dim() == 2 && rows.size(1) == dim_ && rows.scalar_type() == torch::kFloat,
                "rows must be float32 [n, dim]");
    rows = rows.contiguous();
    const int64_t n = rows.size(0), vocab = head_.n, nb = head_.nb;
    QAct& a = head_q_;
    quantize_rows(rows.data_ptr<float>(), n, dim_, a);
    auto logits = torch::empty({n, vocab}, torch::kFloat);
    float* lg = logits.data_ptr<float>();
    qmatmul_into(head_, a, lg, vocab);
    auto argmax = torch::empty({n}, torch::kLong);
    const float* tmax = head_bounds_.data_ptr<float>() + nb;
    const float* norms = head_norms_.data_ptr<float>();
    at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
      std::vector<float> wrow(dim_);
      auto exact_logit = [&](const float* xr, int64_t c) {
        head_.row(c, wrow.data());
        return vdot(xr, wrow.data(), dim_);
      };
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = rows.data_ptr<float>() + r * dim_;
        double e2 = 0.0, x2 = 0.0, fl = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
          const double dx = a.dx[r * nb + b];
          fl += (nb + 4) * 0x1p-22 * 127.0 * dx * tmax[b];
          for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) {
            const double e = xr[i] - dx * a.q[r * dim_ + i];
            e2 += e * e;
            x2 += static_cast<double>(xr[i]) * xr[i];
          }
        }
        const float per_norm = static_cast<float>((std::sqrt(e2) + 0x1p-18 * std::sqrt(x2)) *
                                                  (1 + 0x1p-10));
        const float slack = static_cast<float>(fl * (1 + 0x1p-10));
        float* lr = lg + r * vocab;
        int64_t best = argmax_first(lr, vocab);
        const int64_t first = best;
        float top = exact_logit(xr, best);
        std::vector<std::pair<int64_t, float>> exact;
        // the caps are compared with the first top: a later, higher top only drops candidates
        for_each_reaching(lr, norms, slack, per_norm, top, vocab, [&](int64_t c) {
          if (c == first) return;
          const float v = exact_logit(xr, c);
          exact.emplace_back(c, v);
          if (v > top || (v == top && c < best)) best = c, top = v;
        });
        lr[best] = top;
        for (const auto& [c, v] : exact) lr[c] = v;
        argmax.data_ptr<int64_t>()[r] = best;
      }
    });
    return {logits, argmax};
  }

 private:
  // attn_out_and_ffn (layer.h), or with a routed FFN its first steps, the experts and the add.
  void block_tail(const Layer& ly, float* x, const float* attn, int64_t n, int64_t qw, QAct& a,
                  float* h, float* y, float* gu, float* act) {
    if (!ly.experts) {
      TORCH_CHECK(ly.gate_up.n && ly.down.n, "a layer without experts needs gate_up and down");
      attn_out_and_ffn(ly, x, attn, n, dim_, qw, ffn_, eps_, a, h, y, gu, act, ly.parts());
      return;
    }
    attn_out_and_norm(ly, x, attn, n, dim_, qw, eps_, a, h, y, ly.parts());
    routed_ffn(*ly.experts, a, h, n, dim_, y, moe_);
    add_ffn_out(x, y, n, dim_, eps_, ly.parts());
  }

  // The optional q|k|v bias, RoPE (adjacent pairs) and the optional q/k norms, then K/V into
  // their cache slots: row r's at slot slot_of[r] of its sequence's cache.
  void place_qkv(const Layer& ly, float* qkv, int64_t n, const int64_t* pos,
                 const std::vector<Segment>& segs, const int64_t* seq_of, const int64_t* slot_of) {
    const int64_t qw = heads_ * hd_, kvw = kv_heads_ * hd_, qkvw = qw + 2 * kvw, half = hd_ / 2;
    const float* bias = ly.qkv_bias.numel() ? ly.qkv_bias.data_ptr<float>() : nullptr;
    for_rows(n, [&](int64_t r) {
      float* row = qkv + r * qkvw;
      if (bias)
        for (int64_t i = 0; i < qkvw; ++i) row[i] += bias[i];
      const float* cs = ly.cos.data_ptr<float>() + pos[r] * half;
      const float* sn = ly.sin.data_ptr<float>() + pos[r] * half;
      for (int64_t hh = 0; hh < heads_ + kv_heads_; ++hh) {
        float* v = row + hh * hd_;
        const torch::Tensor& norm = hh < heads_ ? ly.q_norm : ly.k_norm;
        if (norm.numel()) rms_norm_rows(v, norm.data_ptr<float>(), v, 1, hd_, eps_);
        rope_pairs(v, cs, sn, half);
      }
      const Segment& sg = segs[seq_of[r]];
      store_kv(Heads{heads_, kv_heads_, hd_}, row + qw, row + qw + kvw,
               const_cast<uint16_t*>(sg.kl), const_cast<uint16_t*>(sg.vl), slot_of[r],
               sg.capacity);
    });
  }

  int64_t dim_, heads_, kv_heads_, hd_, ffn_;
  float eps_;
  torch::Tensor cos_, sin_;
  QWeight emb_;  // the embedding table packed (the head itself where tied)
  torch::Tensor out_norm_;
  QWeight head_;
  torch::Tensor head_bounds_, head_norms_;
  float embed_scale_, attn_scale_;  // inputs times embed_scale; scores q.k times attn_scale
  QAct head_q_;
  std::vector<Layer> layers_;
  std::vector<float> x_, h_, qkv_, attn_, gu_, act_, y_;
  int64_t attn_layers_ = 0, conv_layers_ = 0, conv_l_ = 0;  // layers of each kind; the conv L
  QAct act_q_;
  MoeScratch moe_;
};

}  // namespace adaspark
