// DeepSeek's absorbed latent attention for query rows that see every cached position (decode): one pass over the
// cache. A head's score at position p is scale * (q_lat[h] . c[p] + q_rot[h] . r[p]); its output is the
// softmax-weighted sum of the latents c[p]. torch's form (engine/latent_attention.py) reads the latents twice, once
// for the scores and once for the weighted sum, and between them a layer's weights have pushed them out of the
// caches; here each block of positions is read once, while it is in L1/L2, for every head.
//
// Positions go in blocks of kBlock, a fixed size, so the result does not depend on the number of threads: each block
// keeps its own maximum, sum of exponentials and weighted latents, merged in block order at the end (the softmax
// over all positions, as flash-decoding does it).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 128;

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
// each instruction set its own copy, chosen at load; multiply-adds fused in these loops alone (the build's
// -ffp-contract=off keeps the other kernels' rounding fixed): this sum is held to its own tolerance, not to bits
#define WS_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), optimize("fp-contract=fast")))
#else
#define WS_CLONES
#endif

// 16 floats, any alignment; only ever passed between always-inlined helpers, so no call passes one in registers
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v16 __attribute__((vector_size(64), aligned(4)));

__attribute__((always_inline)) inline v16 load(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline float lanes(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; i++) s += v[i];
  return s;
}

struct Sizes {
  int64_t heads, lora, rope;
};

// out[h][j] += q[h] . k[j] for two query rows and four key rows of n floats: each load feeds two or four
// multiply-adds (a 2 x 4 tile of dot products)
__attribute__((always_inline)) inline void dot2x4(const float* const* q, const float* const* k, int64_t n,
                                                  float (*out)[4]) {
  v16 a[2][4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 q0 = load(q[0] + i), q1 = load(q[1] + i);
    for (int j = 0; j < 4; j++) {
      const v16 kv = load(k[j] + i);
      a[0][j] += q0 * kv;
      a[1][j] += q1 * kv;
    }
  }
  for (int h = 0; h < 2; h++) {
    for (int j = 0; j < 4; j++) {
      float sum = lanes(a[h][j]);
      for (int64_t t = i; t < n; t++) sum += q[h][t] * k[j][t];
      out[h][j] += sum;
    }
  }
}

// acc[h] += sum_j w[h][j] c[j] over n floats for two accumulator rows and four latent rows (a 2 x 4 tile)
__attribute__((always_inline)) inline void axpy2x4(float* const* acc, const float (*w)[4], const float* const* c,
                                                   int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 a0 = load(acc[0] + i), a1 = load(acc[1] + i);
    for (int j = 0; j < 4; j++) {
      const v16 cv = load(c[j] + i);
      a0 += w[0][j] * cv;
      a1 += w[1][j] * cv;
    }
    __builtin_memcpy(acc[1] + i, &a1, sizeof a1);  // row 1 first: where both rows are one (an odd last head,
    __builtin_memcpy(acc[0] + i, &a0, sizeof a0);  // its second weights zero), row 0's sum is the one kept
  }
  for (; i < n; i++) {
    for (int h = 0; h < 2; h++) acc[h][i] += w[h][0] * c[0][i] + w[h][1] * c[1][i] + w[h][2] * c[2][i] + w[h][3] * c[3][i];
  }
}

// One block of positions [p0, p1) for every head: scores into `weights` (heads x kBlock), then their exponentials
// less the block's maximum; the block's maxima, sums and weighted latents (heads x lora) into m, l and acc.
// Positions go four at a time; a last group of fewer repeats its first row with weight 0.
WS_CLONES void attend_block(const Sizes& s, const float* q_lat, const float* q_rot, const float* c, int64_t c_row,
                            const float* r, int64_t r_row, int64_t p0, int64_t p1, float scale, float* weights,
                            float* m, float* l, float* acc) {
  const int64_t n = p1 - p0;
  for (int64_t p = 0; p < n; p += 4) {
    const float* cs[4];
    const float* rs[4];
    for (int j = 0; j < 4; j++) {
      const int64_t at = p0 + (p + j < n ? p + j : p);
      cs[j] = c + at * c_row;
      rs[j] = r + at * r_row;
    }
    for (int64_t h = 0; h < s.heads; h += 2) {
      const int64_t h1 = h + 1 < s.heads ? h + 1 : h;  // an odd last head is computed twice
      const float* ql[2] = {q_lat + h * s.lora, q_lat + h1 * s.lora};
      const float* qr[2] = {q_rot + h * s.rope, q_rot + h1 * s.rope};
      float got[2][4] = {};
      dot2x4(ql, cs, s.lora, got);
      dot2x4(qr, rs, s.rope, got);
      for (int j = 0; j < 4 && p + j < n; j++) {
        weights[h * kBlock + p + j] = scale * got[0][j];
        weights[h1 * kBlock + p + j] = scale * got[1][j];
      }
    }
  }
  for (int64_t h = 0; h < s.heads; h++) {
    float* w = weights + h * kBlock;
    const float top = *std::max_element(w, w + n);
    float total = 0.f;
    for (int64_t p = 0; p < n; p++) {
      w[p] = std::exp(w[p] - top);
      total += w[p];
    }
    m[h] = top;
    l[h] = total;
  }
  std::fill(acc, acc + s.heads * s.lora, 0.f);
  for (int64_t p = 0; p < n; p += 4) {
    const float* cs[4];
    for (int j = 0; j < 4; j++) cs[j] = c + (p0 + (p + j < n ? p + j : p)) * c_row;
    for (int64_t h = 0; h < s.heads; h += 2) {
      const bool pair = h + 1 < s.heads;
      float w[2][4];
      for (int j = 0; j < 4; j++) {
        w[0][j] = p + j < n ? weights[h * kBlock + p + j] : 0.f;
        w[1][j] = pair && p + j < n ? weights[(h + 1) * kBlock + p + j] : 0.f;
      }
      float* rows[2] = {acc + h * s.lora, acc + (pair ? h + 1 : h) * s.lora};
      axpy2x4(rows, w, cs, s.lora);
    }
  }
}

// The blocks' partial softmaxes of one head merged in block order: out = sum_b e_b acc_b / sum_b e_b l_b, with
// e_b = exp(m_b - max_b m_b).
void merge_head(const Sizes& s, int64_t blocks, const float* m, const float* l, const float* acc, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < blocks; b++) top = std::max(top, m[b * s.heads]);
  float total = 0.f;
  std::fill(out, out + s.lora, 0.f);
  for (int64_t b = 0; b < blocks; b++) {
    const float e = std::exp(m[b * s.heads] - top);
    total += e * l[b * s.heads];
    const float* a = acc + b * s.heads * s.lora;
    for (int64_t i = 0; i < s.lora; i++) out[i] += e * a[i];
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < s.lora; i++) out[i] *= inv;
}

// q_lat (B, H, L), q_rot (B, H, R): one query row a sequence, every cached position visible; c (B, T, L) and
// r (B, T, R) the cached latents and rotary keys (rows may be strided). Returns (B, H, L): the weighted latents.
at::Tensor latent_attend(const at::Tensor& q_lat_in, const at::Tensor& q_rot_in, const at::Tensor& c,
                         const at::Tensor& r, double scale) {
  for (const at::Tensor* t : {&q_lat_in, &q_rot_in, &c, &r}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3, "weightstream latent_attend: float32 (B, ., .) only");
  }
  TORCH_CHECK(c.stride(2) == 1 && r.stride(2) == 1, "weightstream latent_attend: cache rows must be dense");
  const at::Tensor q_lat = q_lat_in.contiguous(), q_rot = q_rot_in.contiguous();
  const int64_t batch = q_lat.size(0), positions = c.size(1);
  const Sizes s{q_lat.size(1), q_lat.size(2), q_rot.size(2)};
  TORCH_CHECK(q_rot.size(0) == batch && q_rot.size(1) == s.heads && c.size(0) == batch && r.size(0) == batch &&
                  c.size(2) == s.lora && r.size(2) == s.rope && r.size(1) == positions && positions > 0,
              "weightstream latent_attend: q_lat ", q_lat.sizes(), ", q_rot ", q_rot.sizes(), ", c ", c.sizes(),
              " and r ", r.sizes(), " do not match");
  const int64_t blocks = (positions + kBlock - 1) / kBlock;
  at::Tensor acc = at::empty({batch, blocks, s.heads, s.lora}, q_lat.options());
  at::Tensor ml = at::empty({2, batch, blocks, s.heads}, q_lat.options());
  float* accp = acc.data_ptr<float>();
  float* mp = ml.data_ptr<float>();
  float* lp = mp + batch * blocks * s.heads;
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(s.heads * kBlock);
    for (int64_t i = begin; i < end; i++) {
      const int64_t b = i / blocks, block = i % blocks;
      const int64_t p0 = block * kBlock, p1 = std::min(positions, p0 + kBlock);
      attend_block(s, q_lat.data_ptr<float>() + b * s.heads * s.lora, q_rot.data_ptr<float>() + b * s.heads * s.rope,
                   c.data_ptr<float>() + b * c.stride(0), c.stride(1), r.data_ptr<float>() + b * r.stride(0),
                   r.stride(1), p0, p1, (float)scale, weights.data(), mp + i * s.heads, lp + i * s.heads,
                   accp + i * s.heads * s.lora);
    }
  });
  at::Tensor out = at::empty({batch, s.heads, s.lora}, q_lat.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++) {
      const int64_t b = i / s.heads, h = i % s.heads, first = b * blocks * s.heads + h;
      merge_head(s, blocks, mp + first, lp + first, accp + first * s.lora, op + i * s.lora);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weightstream, m) {
  m.def("latent_attend(Tensor q_lat, Tensor q_rot, Tensor c, Tensor r, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(weightstream, CPU, m) { m.impl("latent_attend", &latent_attend); }
