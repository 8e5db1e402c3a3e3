// The target: a llama / qwen2 / qwen3 stack over a fp16 K/V cache, and its LM head.
#pragma once

#include "kernels.h"

namespace adaspark {

struct Layer {
  torch::Tensor attn_norm, ffn_norm, q_norm, k_norm, qkv_bias;  // the last three may be empty
  QWeight qkv, o, gate_up, down;
};

class Model {
 public:
  Model(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t ffn,
        double eps, torch::Tensor rope_cos, torch::Tensor rope_sin, torch::Tensor embeddings,
        torch::Tensor out_norm, QWeight head, torch::Tensor head_f32, torch::Tensor head_bounds)
      : dim_(dim), heads_(n_heads), kv_heads_(n_kv_heads), hd_(head_dim), ffn_(ffn),
        eps_(static_cast<float>(eps)), cos_(rope_cos.contiguous()), sin_(rope_sin.contiguous()),
        emb_(embeddings.contiguous()), out_norm_(out_norm.contiguous()), head_(std::move(head)),
        head_f32_(head_f32.contiguous()), head_bounds_(head_bounds.contiguous()) {
    TORCH_CHECK(head_bounds_.scalar_type() == torch::kFloat && head_bounds_.numel() == 2 * head_.nb,
                "head_bounds must be float32 [2, blocks]");
    TORCH_CHECK(attend_takes(hd_) && dim_ % W == 0,
                "head_dim must be 2, 4, 8 or 16 times ", W, " and dim a multiple of ", W);
    TORCH_CHECK(heads_ % kv_heads_ == 0, "heads must be a multiple of kv heads");
  }

  void add_layer(torch::Tensor attn_norm, torch::Tensor ffn_norm, torch::Tensor q_norm,
                 torch::Tensor k_norm, torch::Tensor qkv_bias, QWeight qkv, QWeight o,
                 QWeight gate_up, QWeight down) {
    layers_.push_back(Layer{attn_norm.contiguous(), ffn_norm.contiguous(), q_norm.contiguous(),
                            k_norm.contiguous(), qkv_bias.contiguous(), std::move(qkv),
                            std::move(o), std::move(gate_up), std::move(down)});
  }

  // Rows at cache slots start..start+n-1, positions `positions`; row r sees the committed
  // slots [0, start) and rows t with anc[r, t]. Writes their K/V into the cache.
  // Returns the final-normed rows [n, dim] and the residual after each tap layer [taps, n, dim].
  std::vector<torch::Tensor> forward(torch::Tensor cache_k, torch::Tensor cache_v,
                                     torch::Tensor tokens, torch::Tensor positions, int64_t start,
                                     torch::Tensor anc, std::vector<int64_t> taps) {
    const int64_t n = tokens.numel(), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(cache_k.is_contiguous() && cache_v.is_contiguous() &&
                    cache_k.scalar_type() == torch::kHalf && cache_k.dim() == 5 &&
                    cache_k.size(0) == L && cache_k.size(1) == 1 && cache_k.size(2) == kv_heads_ &&
                    cache_k.size(4) == hd_ && cache_v.sizes() == cache_k.sizes(),
                "cache must be float16 [layers, 1, kv_heads, capacity, head_dim], contiguous");
    const int64_t capacity = cache_k.size(3);
    TORCH_CHECK(n >= 1 && start >= 0 && start + n <= capacity, "rows do not fit the cache");
    TORCH_CHECK(anc.scalar_type() == torch::kBool && anc.dim() == 2 && anc.size(0) == n &&
                    anc.size(1) == n, "anc must be bool [n, n]");
    tokens = tokens.to(torch::kLong).contiguous();
    positions = positions.to(torch::kLong).contiguous();
    anc = anc.contiguous();
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(tok[r] >= 0 && tok[r] < emb_.size(0), "token id out of range");
      TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_.size(0), "position past the rope table");
    }
    for (int64_t t : taps) TORCH_CHECK(t >= 0 && t < L, "tap layer out of range");

    const int64_t qw = heads_ * hd_, kvw = kv_heads_ * hd_, qkvw = qw + 2 * kvw;
    // scratch kept between calls: a fresh allocation per call costs page faults
    std::vector<float>&x = x_, &h = h_, &qkv = qkv_, &attn = attn_, &gu = gu_, &act = act_,
                       &y = y_;
    x.resize(n * dim_); h.resize(n * std::max(dim_, qw)); qkv.resize(n * qkvw);
    attn.resize(n * qw); gu.resize(n * 2 * ffn_); act.resize(n * ffn_); y.resize(n * dim_);
    const float* emb = emb_.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) std::memcpy(&x[r * dim_], emb + tok[r] * dim_, dim_ * 4);
    auto hiddens = torch::empty({static_cast<int64_t>(taps.size()), n, dim_}, torch::kFloat);
    QAct& a = act_q_;
    const int64_t layer_stride = kv_heads_ * capacity * hd_;

    for (int64_t li = 0; li < L; ++li) {
      const Layer& ly = layers_[li];
      rms_norm_rows(x.data(), ly.attn_norm.data_ptr<float>(), h.data(), n, dim_, eps_);
      quantize_rows(h.data(), n, dim_, a);
      qmatmul_into(ly.qkv, a, qkv.data(), qkvw);
      if (ly.qkv_bias.numel()) {
        const float* b = ly.qkv_bias.data_ptr<float>();
        for (int64_t r = 0; r < n; ++r)
          for (int64_t i = 0; i < qkvw; ++i) qkv[r * qkvw + i] += b[i];
      }
      uint16_t* kl = reinterpret_cast<uint16_t*>(cache_k.data_ptr<at::Half>()) + li * layer_stride;
      uint16_t* vl = reinterpret_cast<uint16_t*>(cache_v.data_ptr<at::Half>()) + li * layer_stride;
      place_qkv(ly, qkv.data(), n, pos, kl, vl, start, capacity);
      attend(Heads{heads_, kv_heads_, hd_}, qkv.data(), qkvw, kl, vl, start, capacity,
             anc.data_ptr<bool>(), n, attn.data());
      attn_out_and_ffn(ly, x.data(), attn.data(), n, dim_, qw, ffn_, eps_, a, h.data(), y.data(),
                       gu.data(), act.data());
      for (size_t t = 0; t < taps.size(); ++t)
        if (taps[t] == li) std::memcpy(hiddens[t].data_ptr<float>(), x.data(), n * dim_ * 4);
    }
    auto out = torch::empty({n, dim_}, torch::kFloat);
    rms_norm_rows(x.data(), out_norm_.data_ptr<float>(), out.data_ptr<float>(), n, dim_, eps_);
    return {out, hiddens};
  }

  // Logits [n, vocab] and argmax [n] of final-normed rows. The quantised logits carry the
  // int8 activations' rounding, which is bounded: per block, half a step times the largest
  // sum of |w| over the vocabulary (wmax), plus float rounding of the terms (tmax). Every
  // logit within twice that bound of the row's quantised max is recomputed in float32 from
  // head_f32, so the argmax is the float32 head's argmax, not the int8 one.
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
    const float* hf = head_f32_.data_ptr<float>();
    const float* wmax = head_bounds_.data_ptr<float>();
    const float* tmax = wmax + nb;
    for (int64_t r = 0; r < n; ++r) {
      double bound = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        const double dx = a.dx[r * nb + b];
        bound += dx * (0.5 + 0x1p-19) * wmax[b] + (nb + 4) * 0x1p-22 * 127.0 * dx * tmax[b];
      }
      float* lr = lg + r * vocab;
      const float floor = static_cast<float>(*std::max_element(lr, lr + vocab) - 2.0 * bound);
      const float* xr = rows.data_ptr<float>() + r * dim_;
      std::vector<int64_t> near;
      for (int64_t c = 0; c < vocab; ++c)
        if (lr[c] >= floor) near.push_back(c);
      at::parallel_for(0, static_cast<int64_t>(near.size()), 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) lr[near[i]] = vdot(xr, hf + near[i] * dim_, dim_);
      });
      int64_t best = near[0];  // lowest id among equal maxima, as torch's argmax
      for (int64_t c : near)
        if (lr[c] > lr[best]) best = c;
      argmax.data_ptr<int64_t>()[r] = best;
    }
    return {logits, argmax};
  }

 private:
  // RoPE (adjacent pairs) and the optional q/k norms, then K/V into their cache slots.
  void place_qkv(const Layer& ly, float* qkv, int64_t n, const int64_t* pos, uint16_t* kl,
                 uint16_t* vl, int64_t start, int64_t capacity) {
    const int64_t qw = heads_ * hd_, kvw = kv_heads_ * hd_, qkvw = qw + 2 * kvw, half = hd_ / 2;
    for (int64_t r = 0; r < n; ++r) {
      float* row = qkv + r * qkvw;
      const float* cs = cos_.data_ptr<float>() + pos[r] * half;
      const float* sn = sin_.data_ptr<float>() + pos[r] * half;
      for (int64_t hh = 0; hh < heads_ + kv_heads_; ++hh) {
        float* v = row + hh * hd_;
        const torch::Tensor& norm = hh < heads_ ? ly.q_norm : ly.k_norm;
        if (norm.numel()) rms_norm_rows(v, norm.data_ptr<float>(), v, 1, hd_, eps_);
        rope_pairs(v, cs, sn, half);
      }
      store_kv(Heads{heads_, kv_heads_, hd_}, row + qw, row + qw + kvw, kl, vl, start + r,
               capacity);
    }
  }

  int64_t dim_, heads_, kv_heads_, hd_, ffn_;
  float eps_;
  torch::Tensor cos_, sin_, emb_, out_norm_;
  QWeight head_;
  torch::Tensor head_f32_, head_bounds_;
  QAct head_q_;
  std::vector<Layer> layers_;
  std::vector<float> x_, h_, qkv_, attn_, gu_, act_, y_;
  QAct act_q_;
};

}  // namespace adaspark
