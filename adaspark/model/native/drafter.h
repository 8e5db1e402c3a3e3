// The DSpark block drafter (adaspark/drafter/model.py) as two native calls: append the
// features of newly committed tokens to its fp16 K/V cache, and draft one block.
//
// Its weights are the checkpoint's float32 ones quantised to Q8_0 (drafter/native.py), so the
// backbone runs on the target's integer kernels; a draft only proposes, the target decides,
// so this changes which tokens are proposed, never which are emitted. The Markov head and the
// confidence head stay float32 (they are small and run along the picks).
#pragma once

#include <numeric>

#include "kernels.h"

namespace adaspark {

struct DraftLayer {
  torch::Tensor attn_norm, ffn_norm;
  QWeight qkv, kv, o, gate_up, down;  // kv: the k|v rows of qkv alone, for context features
};

class Drafter {
 public:
  // cos/sin [positions, head_dim/2]; fc float32 [dim, taps*dim]; head [V_d <- dim]; w1 [V_d+1, r];
  // w2 [V_d, r]; confidence [dim + r] and its bias; temperature [block].
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
        w2_(w2.contiguous()), conf_(confidence.contiguous()),
        conf_bias_(static_cast<float>(confidence_bias)), temp_(temperature.contiguous()) {
    TORCH_CHECK(attend_takes(head_dim) && dim % W == 0,
                "head_dim must be 2, 4, 8 or 16 times ", W, " and dim a multiple of ", W);
    TORCH_CHECK(n_heads % n_kv_heads == 0, "heads must be a multiple of kv heads");
    TORCH_CHECK(w1_.dim() == 2 && w2_.dim() == 2 && w1_.size(1) == w2_.size(1) &&
                    w2_.size(0) == head_.n && w1_.size(0) == head_.n + 1,
                "Markov weights must be w1 [V_d+1, r], w2 [V_d, r]");
    TORCH_CHECK(conf_.numel() == dim_ + w1_.size(1) && temp_.numel() == block_,
                "confidence [dim + r], temperature [block]");
  }

  void add_layer(torch::Tensor attn_norm, torch::Tensor ffn_norm, QWeight qkv, QWeight kv,
                 QWeight o, QWeight gate_up, QWeight down) {
    layers_.push_back(DraftLayer{attn_norm.contiguous(), ffn_norm.contiguous(), std::move(qkv),
                                 std::move(kv), std::move(o), std::move(gate_up),
                                 std::move(down)});
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
    taps = taps.contiguous();
    const int64_t kvw = hs_.kv_heads * hs_.hd, half = hs_.hd / 2;
    std::vector<float> feats(n * dim_), kv(n * 2 * kvw);
    // fc in float32: the target's residual streams have outlier channels that would coarsen
    // an int8 block's step for all its other inputs
    const float* tp = taps.data_ptr<float>();
    const float* fw = fc_.data_ptr<float>();
    const int64_t k = fc_.size(1);
    at::parallel_for(0, dim_, 16, [&](int64_t o0, int64_t o1) {
      vdots(tp, n, fw, o0, o1, k, feats.data(), dim_);
    });
    rms_norm_rows(feats.data(), ctx_norm_.data_ptr<float>(), feats.data(), n, dim_, eps_);
    quantize_rows(feats.data(), n, dim_, act_);
    for (size_t li = 0; li < layers_.size(); ++li) {
      qmatmul_into(layers_[li].kv, act_, kv.data(), 2 * kvw);
      auto [kl, vl] = layer_cache(cache_k, cache_v, li, capacity);
      for (int64_t r = 0; r < n; ++r) {
        float* row = kv.data() + r * 2 * kvw;
        const int64_t p = start + r;
        TORCH_CHECK(p < cos_.size(0), "position past the rope table");
        for (int64_t g = 0; g < hs_.kv_heads; ++g)
          rope_pairs(row + g * hs_.hd, cos_.data_ptr<float>() + p * half,
                     sin_.data_ptr<float>() + p * half, half);
        store_kv(hs_, row, row + kvw, kl, vl, p, capacity);
      }
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
    for (size_t li = 0; li < layers_.size(); ++li) {
      const DraftLayer& ly = layers_[li];
      auto [kl, vl] = layer_cache(cache_k, cache_v, li, capacity);
      rms_norm_rows(x.data(), ly.attn_norm.data_ptr<float>(), h.data(), B, dim_, eps_);
      quantize_rows(h.data(), B, dim_, act_);
      qmatmul_into(ly.qkv, act_, qkv.data(), qkvw);
      for (int64_t r = 0; r < B; ++r) {
        float* row = qkv.data() + r * qkvw;
        const float* cs = cos_.data_ptr<float>() + (start + r) * half;
        const float* sn = sin_.data_ptr<float>() + (start + r) * half;
        for (int64_t hh = 0; hh < hs_.heads + hs_.kv_heads; ++hh)
          rope_pairs(row + hh * hs_.hd, cs, sn, half);
        store_kv(hs_, row + qw, row + qw + kvw, kl, vl, start + r, capacity);
      }
      attend(hs_, qkv.data(), qkvw, kl, vl, start, capacity,
             reinterpret_cast<const bool*>(all.data()), B, attn.data());
      attn_out_and_ffn(ly, x.data(), attn.data(), B, dim_, qw, ffn_, eps_, act_, h.data(), y.data(),
                       gu.data(), act.data());
    }
    rms_norm_rows(x.data(), out_norm_.data_ptr<float>(), hidden.data_ptr<float>(), B, dim_, eps_);
    quantize_rows(hidden.data_ptr<float>(), B, dim_, act_);
    qmatmul_into(head_, act_, logits.data_ptr<float>(), head_.n);
    if (noise.numel()) {
      TORCH_CHECK(noise.sizes() == logits.sizes() && noise.scalar_type() == torch::kFloat,
                  "noise must be float32 [block, V_d]");
      logits.add_(noise);
    }
  }

 public:

  // The Markov and confidence heads over given backbone rows (draft() and the tests).
  std::vector<torch::Tensor> markov(torch::Tensor hidden, torch::Tensor logits, int64_t prev,
                                    int64_t shortlist, int64_t topk) {
    const int64_t B = block_, V = head_.n, r = w1_.size(1);
    TORCH_CHECK(hidden.sizes() == torch::IntArrayRef({B, dim_}) &&
                    logits.sizes() == torch::IntArrayRef({B, V}),
                "hidden [block, dim] and logits [block, V_d]");
    TORCH_CHECK(prev >= 0 && prev <= V, "previous token out of the draft vocabulary + 1");
    const int64_t S = std::min(shortlist, V), K = std::min(topk, S);
    TORCH_CHECK(K >= 1, "topk and shortlist must be at least 1");
    hidden = hidden.contiguous();
    logits = logits.contiguous();
    auto picks = torch::empty({B}, torch::kLong);
    auto top_ids = torch::empty({B, K}, torch::kLong);
    auto top_v = torch::empty({B, K}, torch::kFloat);
    auto conf = torch::empty({B}, torch::kFloat);
    const float* w1 = w1_.data_ptr<float>();
    const float* w2 = w2_.data_ptr<float>();
    const float* cw = conf_.data_ptr<float>();
    std::vector<int64_t> idx, order(S);
    std::vector<float> sv(S);
    for (int64_t i = 0; i < B; ++i) {
      const float* lr = logits.data_ptr<float>() + i * V;
      top_indices(lr, V, S, idx);  // best first, ties to the lower index: one ranking everywhere
      const float* e = w1 + prev * r;
      for (int64_t j = 0; j < S; ++j) sv[j] = lr[idx[j]] + dot(w2 + idx[j] * r, e, r);
      std::iota(order.begin(), order.end(), 0);
      auto by_value = [&](int64_t a, int64_t b) {
        return sv[a] > sv[b] || (sv[a] == sv[b] && a < b);
      };
      std::partial_sort(order.begin(), order.begin() + K, order.end(), by_value);
      for (int64_t j = 0; j < K; ++j) {
        top_ids.data_ptr<int64_t>()[i * K + j] = idx[order[j]];
        top_v.data_ptr<float>()[i * K + j] = sv[order[j]];
      }
      const float c = dot(cw, hidden.data_ptr<float>() + i * dim_, dim_) + dot(cw + dim_, e, r) +
                      conf_bias_;
      conf.data_ptr<float>()[i] = 1.0f / (1.0f + std::exp(-c / temp_.data_ptr<float>()[i]));
      prev = idx[order[0]];
      picks.data_ptr<int64_t>()[i] = prev;
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
  torch::Tensor fc_;  // float32 [dim, taps*dim]
  torch::Tensor ctx_norm_, mask_, out_norm_;
  QWeight head_;
  torch::Tensor w1_, w2_, conf_;
  float conf_bias_;
  torch::Tensor temp_;
  std::vector<DraftLayer> layers_;
  QAct act_;
  struct Scratch {  // the backbone's per-row buffers, kept between calls
    std::vector<float> x, h, qkv, attn, y, gu, act;
  } scratch_;
  torch::Tensor hidden_, logits_;  // draft()'s backbone rows
};

}  // namespace adaspark
