// The small float32 steps around a decoder layer's products, each one call instead of a chain of torch ops:
// transformers' RMSNorm (8 ops) and its standard rotary embedding (about 16 ops for q and k). A model whose dense
// weights are GGML blocks computes in float32 (QuantFormat.compute_dtype), where these chains cost more time a
// token than their arithmetic; engine/fused.py puts these ops in their place where a model's own modules prove
// equal to them.
//
// rope is bitwise the standard `q * cos + rotate_half(q) * sin`: each product rounded, then the sum (compiled with
// -ffp-contract=off, so nothing is fused). rms_norm sums the squares in its own order (8 lanes, then a fixed
// tree), so it differs from torch's sum in the last bits of the scale; everything after is torch's sequence.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, float32: the Llama-style RMSNorm in float32.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && weight_in.scalar_type() == at::kFloat,
              "weightstream rms_norm: x and weight must be float32");
  TORCH_CHECK(weight_in.dim() == 1 && x_in.dim() >= 1 && x_in.size(-1) == weight_in.size(0),
              "weightstream rms_norm: weight must be (", x_in.size(-1), ")");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t d = weight.size(0), rows = d ? x.numel() / d : 0;
  const float e = (float)eps, n = (float)d;
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r++) {
      const float* xr = xp + r * d;
      float* o = op + r * d;
      float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 8 <= d; i += 8) {
        for (int l = 0; l < 8; l++) {
          const float sq = xr[i + l] * xr[i + l];
          lane[l] += sq;
        }
      }
      float total = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      for (; i < d; i++) {
        const float sq = xr[i] * xr[i];
        total += sq;
      }
      const float inv = 1.f / std::sqrt(total / n + e);
      for (i = 0; i < d; i++) {
        const float scaled = xr[i] * inv;
        o[i] = w[i] * scaled;
      }
    }
  });
  return out;
}

// Calls row(x, o, b, s) for each row (b, h, s) of t (B, H, S, D) and of out, in parallel: x its D inputs, o its D
// outputs (t's last dimension dense; out's too).
template <typename Row>
void each_row(const at::Tensor& t, at::Tensor& out, const Row& row) {
  const int64_t B = t.size(0), H = t.size(1), S = t.size(2), D = t.size(3);
  TORCH_CHECK(t.stride(3) == 1 && out.stride(3) == 1, "weightstream rope: the last dimension must be dense");
  const float* tp = t.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H * S, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; idx++) {
      const int64_t b = idx / (H * S), h = (idx / S) % H, s = idx % S;
      row(tp + b * t.stride(0) + h * t.stride(1) + s * t.stride(2),
          op + b * out.stride(0) + h * out.stride(1) + s * out.stride(2), b, s);
    }
  });
}

// t (B, H, S, D) rotated: out = t * cos + rotate_half(t) * sin, cos and sin (B or 1, S, D) broadcast over heads;
// rotate_half(t) = cat(-t[..., D/2:], t[..., :D/2]). Strides as empty_like(t) gives; t's last dimension dense.
// `interleaved`: DeepSeek-V3's form (transformers' apply_rotary_pos_emb_interleave), whose pairs are t's even and odd
// elements and whose angles are the first half of cos and sin: out = cat(t1 * c - t2 * s, t2 * c + t1 * s) with
// t1 = t[..., 0::2], t2 = t[..., 1::2], c = cos[..., :D/2], s = sin[..., :D/2] (the same roundings: a * c + (-b) * s
// is a * c - b * s exactly).
at::Tensor rotate(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  const int64_t S = t.size(2), D = t.size(3), half = D / 2;
  at::Tensor out = at::empty_like(t);
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t cb = cos.size(0) == 1 ? 0 : S * D;
  each_row(t, out, [&](const float* x, float* o, int64_t b, int64_t s) {
    const float* c = cp + b * cb + s * D;
    const float* n = sp + b * cb + s * D;
    if (interleaved) {
      for (int64_t j = 0; j < half; j++) {
        const float even = x[2 * j], odd = x[2 * j + 1];
        const float straight = even * c[j], turned = (-odd) * n[j];
        o[j] = straight + turned;
        const float straight2 = odd * c[j], turned2 = even * n[j];
        o[j + half] = straight2 + turned2;
      }
      return;
    }
    for (int64_t j = 0; j < half; j++) {
      const float straight = x[j] * c[j], turned = (-x[j + half]) * n[j];
      o[j] = straight + turned;
    }
    for (int64_t j = half; j < D; j++) {
      const float straight = x[j] * c[j], turned = x[j - half] * n[j];
      o[j] = straight + turned;
    }
  });
  return out;
}

// t (B, H, S, D) rotated as complex pairs (DeepSeek-V2's apply_rotary_emb: view_as_complex(t) * freqs): pair j of
// t, (a, b) = (t[2j], t[2j + 1]), times the frequency (c, d) = (f[j][0], f[j][1]) of f (B or 1, S, D/2, 2), the real
// and imaginary parts of the complex frequencies: (a c - b d, a d + b c), each product rounded, then the sum, as
// torch multiplies complex floats. The pairs stay where they are; out is contiguous.
at::Tensor rotate_pairs(const at::Tensor& t, const at::Tensor& f) {
  const int64_t S = t.size(2), D = t.size(3), half = D / 2;
  at::Tensor out = at::empty({t.size(0), t.size(1), S, D}, t.options());
  const float* fp = f.data_ptr<float>();
  const int64_t fb = f.size(0) == 1 ? 0 : S * D;
  each_row(t, out, [&](const float* x, float* o, int64_t b, int64_t s) {
    const float* w = fp + b * fb + s * D;
    for (int64_t j = 0; j < half; j++) {
      const float a = x[2 * j], bb = x[2 * j + 1], c = w[2 * j], d = w[2 * j + 1];
      const float ac = a * c, bd = bb * d, ad = a * d, bc = bb * c;
      o[2 * j] = ac - bd;
      o[2 * j + 1] = ad + bc;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_pairs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& f_in) {
  for (const at::Tensor* t : {&q, &k, &f_in}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "weightstream rope_pairs: q, k and the frequencies must be float32");
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && f_in.dim() == 4 && f_in.size(3) == 2,
              "weightstream rope_pairs: q and k must be (B, H, S, D), the frequencies (B, S, D/2, 2)");
  const at::Tensor f = f_in.contiguous();
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->size(3) % 2 == 0 && t->size(3) == 2 * f.size(2) && t->size(2) == f.size(1) &&
                    (f.size(0) == 1 || f.size(0) == t->size(0)),
                "weightstream rope_pairs: q ", q.sizes(), " and k ", k.sizes(), " do not match the frequencies ",
                f.sizes());
  }
  return {rotate_pairs(q, f), rotate_pairs(k, f)};
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                        const at::Tensor& sin_in, bool interleaved) {
  for (const at::Tensor* t : {&q, &k, &cos_in, &sin_in}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, "weightstream rope: q, k, cos and sin must be float32");
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos_in.dim() == 3 && sin_in.sizes() == cos_in.sizes(),
              "weightstream rope: q and k must be (B, H, S, D), cos and sin (B, S, D)");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->size(3) % 2 == 0 && t->size(3) == cos.size(2) && t->size(2) == cos.size(1) &&
                    (cos.size(0) == 1 || cos.size(0) == t->size(0)),
                "weightstream rope: q ", q.sizes(), " and k ", k.sizes(), " do not match cos ", cos.sizes());
  }
  return {rotate(q, cos, sin, interleaved), rotate(k, cos, sin, interleaved)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weightstream, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved=False) -> (Tensor, Tensor)");
  m.def("rope_pairs(Tensor q, Tensor k, Tensor freqs) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(weightstream, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope", &rope);
  m.impl("rope_pairs", &rope_pairs);
}
