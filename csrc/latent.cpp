// DeepSeek's absorbed latent attention for query rows that see every cached position (decode): one pass over the
// cache. A head's score at position p is scale * (q_lat[h] . c[p] + q_rot[h] . r[p]); its output is the
// softmax-weighted sum of the latents c[p]. torch's form (engine/latent_attention.py) reads the latents twice, once
// for the scores and once for the weighted sum, and between them a layer's weights have pushed them out of the
// caches; here each block of positions is read while it is in L2, once for each group of heads.
//
// Positions go in blocks of kBlock, a fixed size, so the result does not depend on the number of threads: each block
// keeps its own maximum, sum of exponentials and weighted latents, merged in block order at the end (the softmax
// over all positions, as flash-decoding does it).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
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

// Heads a task computes. A block of positions is read once per group (from L2), a group's weighted latents stay in
// registers across the block (kGroup x 16 floats), and blocks x groups gives both threads work at short contexts
// (16 heads over 264 positions: 3 blocks, 6 tasks). Heads are independent, so the grouping changes no result.
constexpr int64_t kGroup = 8;

typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

// out[h][j] += q[h] . k[j] for four query rows and four key rows of n floats: each load feeds four multiply-adds
// (a 4 x 4 tile of dot products)
__attribute__((always_inline)) inline void dot4x4(const float* const* q, const float* const* k, int64_t n,
                                                  float (*out)[4]) {
  v16 a[4][4] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 qv[4];
    for (int h = 0; h < 4; h++) qv[h] = load(q[h] + i);
    for (int j = 0; j < 4; j++) {
      const v16 kv = load(k[j] + i);
      for (int h = 0; h < 4; h++) a[h][j] += qv[h] * kv;
    }
  }
  for (int h = 0; h < 4; h++) {
    for (int j = 0; j < 4; j++) {
      float sum = lanes(a[h][j]);
      for (int64_t t = i; t < n; t++) sum += q[h][t] * k[j][t];
      out[h][j] += sum;
    }
  }
}

// e^x of 16 scores less their block's maximum (x <= 0, or -inf): x = k ln2 + f with |f| <= ln2 / 2 (ln2 in two
// parts), e^f by its degree-6 Taylor polynomial (relative error under 1.3e-7, about a float32 ulp), 2^k put into
// the exponent bits; 0 below -87, where 2^k would leave the normal floats. std::exp one at a time cost as much as
// the dot products at depth 4096.
__attribute__((always_inline)) inline v16 exp16(v16 x) {
  const v16 floor = x < -87.f ? (v16){} - 87.f : x;  // -inf and what underflows: computed at -87, zeroed below
  const v16 rounder = (v16){} + 12582912.f;         // 1.5 * 2^23: adding it rounds to an integer
  const v16 k = (floor * 1.44269504f + rounder) - rounder;
  const v16 f = (floor - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  v16 p = f * (1.f / 720) + (1.f / 120);
  p = p * f + (1.f / 24);
  p = p * f + (1.f / 6);
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? (v16){} : p * scale;
}

// One block of positions [p0, p1) for heads [h0, h1) (at most kGroup): their scores into `weights` (kGroup rows of
// kBlock), then the exponentials less each head's maximum over the block; each head's maximum, sum of exponentials
// and weighted latents (lora floats) into m[h], l[h] and acc + h * lora. Positions go four at a time and heads four
// at a time; a short last group repeats a row (its results unused or identical).
WS_CLONES void attend_block(const Sizes& s, const float* q_lat, const float* q_rot, const float* c, int64_t c_row,
                            const float* r, int64_t r_row, int64_t p0, int64_t p1, int64_t h0, int64_t h1,
                            float scale, float* weights, float* m, float* l, float* acc) {
  const int64_t n = p1 - p0, heads = h1 - h0;
  for (int64_t p = 0; p < n; p += 4) {
    const float* cs[4];
    const float* rs[4];
    for (int j = 0; j < 4; j++) {
      const int64_t at = p0 + (p + j < n ? p + j : p);
      cs[j] = c + at * c_row;
      rs[j] = r + at * r_row;
    }
    for (int64_t g = 0; g < heads; g += 4) {
      const float* ql[4];
      const float* qr[4];
      int64_t row[4];
      for (int i = 0; i < 4; i++) {
        row[i] = g + i < heads ? g + i : g;
        ql[i] = q_lat + (h0 + row[i]) * s.lora;
        qr[i] = q_rot + (h0 + row[i]) * s.rope;
      }
      float got[4][4] = {};
      dot4x4(ql, cs, s.lora, got);
      dot4x4(qr, rs, s.rope, got);
      for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4 && p + j < n; j++) weights[row[i] * kBlock + p + j] = scale * got[i][j];
      }
    }
  }
  const int64_t padded = (n + 15) / 16 * 16;
  for (int64_t h = 0; h < heads; h++) {
    float* w = weights + h * kBlock;
    const float top = *std::max_element(w, w + n);
    std::fill(w + n, w + padded, -std::numeric_limits<float>::infinity());
    v16 total = {};
    for (int64_t p = 0; p < padded; p += 16) {
      const v16 e = exp16(load(w + p) - top);
      __builtin_memcpy(w + p, &e, sizeof e);
      total += e;
    }
    m[h0 + h] = top;
    l[h0 + h] = lanes(total);
  }
  // acc[h] = sum_p w[h][p] c[p], 16 latent values at a time with every head's sums in registers (a second 16
  // in registers as well measured no faster: the multiply-adds, not the loads, bound this loop at ~70% of peak)
  int64_t i = 0;
  for (; i + 16 <= s.lora; i += 16) {
    v16 a[kGroup] = {};
    for (int64_t p = 0; p < n; p++) {
      const v16 cv = load(c + (p0 + p) * c_row + i);
      for (int64_t h = 0; h < kGroup; h++) a[h] += weights[h * kBlock + p] * cv;  // rows past `heads`: unused
    }
    for (int64_t h = 0; h < heads; h++) __builtin_memcpy(acc + (h0 + h) * s.lora + i, &a[h], sizeof a[h]);
  }
  for (; i < s.lora; i++) {
    for (int64_t h = 0; h < heads; h++) {
      float sum = 0.f;
      for (int64_t p = 0; p < n; p++) sum += weights[h * kBlock + p] * c[(p0 + p) * c_row + i];
      acc[(h0 + h) * s.lora + i] = sum;
    }
  }
}

// A 16-bit cache (float16 or bfloat16: half a float32 cache's bytes, as llama.cpp keeps its KV cache in f16) is
// widened a block at a time into float32 rows, then attended exactly as a float32 cache of those values: the
// widening is exact, so the result is the float32 kernel's on the 16-bit values, bit for bit.
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"))) void half_rows_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  }
  for (; i < n; i++) out[i] = c10::detail::fp16_ieee_to_fp32_value(in[i]);
}

__attribute__((target("avx,f16c"))) void half_rows_f16c(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; i++) out[i] = c10::detail::fp16_ieee_to_fp32_value(in[i]);
}
#endif

void half_rows(const uint16_t* in, float* out, int64_t n) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const int level = __builtin_cpu_supports("avx512f")                                  ? 2
                           : __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") ? 1
                                                                                             : 0;
  if (level == 2) return half_rows_avx512(in, out, n);
  if (level == 1) return half_rows_f16c(in, out, n);
#endif
  for (int64_t i = 0; i < n; i++) out[i] = c10::detail::fp16_ieee_to_fp32_value(in[i]);
}

WS_CLONES void bf16_rows(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const uint32_t bits = (uint32_t)in[i] << 16;
    __builtin_memcpy(out + i, &bits, sizeof bits);
  }
}

// An 8-bit cache in llama.cpp's q8_0 (`-ctk q8_0`): each 32 values a GGML block, a float16 scale d then 32 int8
// codes q, the value d * q; 34 bytes where float16 takes 64. Stored as uint8 rows of whole blocks (latent and rotary
// key each a multiple of 32 values). Widened a block of positions at a time as a 16-bit cache is: the values are
// exactly d * q, so the result is the float32 kernel's on those values.
constexpr int64_t kQ8Values = 32, kQ8Bytes = 34;

WS_CLONES void q8_rows(const uint8_t* in, float* out, int64_t n) {
  for (int64_t b = 0; b < n / kQ8Values; b++) {
    const uint8_t* block = in + b * kQ8Bytes;
    uint16_t bits;
    __builtin_memcpy(&bits, block, sizeof bits);
    const float d = c10::detail::fp16_ieee_to_fp32_value(bits);
    const auto* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int64_t j = 0; j < kQ8Values; j++) out[b * kQ8Values + j] = d * (float)q[j];
  }
}

// x (..., n) float32, n a multiple of 32, as q8_0 blocks (..., n / 32 * 34) uint8: ggml's quantize_row_q8_0_ref,
// d = max |x| / 127 (stored as float16), q = round(x / d) with the float32 d's inverse. A block holding a NaN or an
// infinity is stored as a NaN scale and zero codes (it decodes to NaNs, as its attention would), where ggml's cast
// of a NaN to int8 is undefined.
at::Tensor quantize_q8_0(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % kQ8Values == 0,
              "weightstream quantize_q8_0: the last dimension must be whole blocks of 32 values, not ", x_in.sizes());
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  auto sizes = x.sizes().vec();
  const int64_t n = sizes.back(), blocks = x.numel() / kQ8Values;
  sizes.back() = n / kQ8Values * kQ8Bytes;
  at::Tensor out = at::empty(sizes, x.options().dtype(at::kByte));
  const float* in = x.data_ptr<float>();
  uint8_t* to = out.data_ptr<uint8_t>();
  for (int64_t b = 0; b < blocks; b++) {
    const float* v = in + b * kQ8Values;
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < kQ8Values; j++) {
      amax = std::max(amax, std::fabs(v[j]));
      finite = finite && std::isfinite(v[j]);
    }
    const float d = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && d != 0.f ? 1.f / d : 0.f;
    const uint16_t bits = c10::detail::fp16_ieee_from_fp32_value(d);
    uint8_t* block = to + b * kQ8Bytes;
    __builtin_memcpy(block, &bits, sizeof bits);
    for (int64_t j = 0; j < kQ8Values; j++) {
      block[2 + j] = finite ? (uint8_t)(int8_t)std::round(v[j] * inv) : 0;
    }
  }
  return out;
}

// The values a cache row of `bytes` holds: a q8_0 row's 32 a block, a float one's one an element.
int64_t row_values(const at::Tensor& t) {
  return t.scalar_type() == at::kByte ? t.size(-1) / kQ8Bytes * kQ8Values : t.size(-1);
}

// Rows [p0, p1) of a 16-bit or q8_0 (T, width) cache with `stride` elements a row, as float32 rows in `out`.
void widen(const at::Tensor& t, int64_t b, int64_t p0, int64_t p1, float* out) {
  if (t.scalar_type() == at::kByte) {
    const int64_t width = row_values(t), stride = t.stride(1);
    const uint8_t* base = t.data_ptr<uint8_t>() + b * t.stride(0);
    for (int64_t p = p0; p < p1; p++) q8_rows(base + p * stride, out + (p - p0) * width, width);
    return;
  }
  const int64_t width = t.size(2), stride = t.stride(1);
  const auto* base = reinterpret_cast<const uint16_t*>(t.data_ptr()) + b * t.stride(0);
  const bool half = t.scalar_type() == at::kHalf;
  for (int64_t p = p0; p < p1; p++) {
    const uint16_t* row = base + p * stride;
    float* to = out + (p - p0) * width;
    half ? half_rows(row, to, width) : bf16_rows(row, to, width);
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
// r (B, T, R) the cached latents and rotary keys (rows may be strided), float32, or both float16 or both bfloat16,
// or both q8_0 blocks (uint8 (B, T, L / 32 * 34) and (B, T, R / 32 * 34)). Returns (B, H, L): the weighted latents,
// float32.
at::Tensor latent_attend(const at::Tensor& q_lat_in, const at::Tensor& q_rot_in, const at::Tensor& c,
                         const at::Tensor& r, double scale) {
  for (const at::Tensor* t : {&q_lat_in, &q_rot_in, &c, &r}) {
    TORCH_CHECK(t->dim() == 3, "weightstream latent_attend: (B, ., .) tensors only");
  }
  TORCH_CHECK(q_lat_in.scalar_type() == at::kFloat && q_rot_in.scalar_type() == at::kFloat,
              "weightstream latent_attend: float32 queries only");
  const at::ScalarType cache_type = c.scalar_type();
  TORCH_CHECK(r.scalar_type() == cache_type && (cache_type == at::kFloat || cache_type == at::kHalf ||
                                                 cache_type == at::kBFloat16 || cache_type == at::kByte),
              "weightstream latent_attend: the latents and rotary keys both float32, float16, bfloat16 or q8_0 "
              "blocks (uint8), not ", c.scalar_type(), " and ", r.scalar_type());
  const bool wide = cache_type == at::kFloat;
  TORCH_CHECK(c.stride(2) == 1 && r.stride(2) == 1, "weightstream latent_attend: cache rows must be dense");
  const at::Tensor q_lat = q_lat_in.contiguous(), q_rot = q_rot_in.contiguous();
  const int64_t batch = q_lat.size(0), positions = c.size(1);
  const Sizes s{q_lat.size(1), q_lat.size(2), q_rot.size(2)};
  const bool blocks_whole = cache_type != at::kByte || (c.size(2) % kQ8Bytes == 0 && r.size(2) % kQ8Bytes == 0);
  TORCH_CHECK(q_rot.size(0) == batch && q_rot.size(1) == s.heads && c.size(0) == batch && r.size(0) == batch &&
                  blocks_whole && row_values(c) == s.lora && row_values(r) == s.rope && r.size(1) == positions &&
                  positions > 0,
              "weightstream latent_attend: q_lat ", q_lat.sizes(), ", q_rot ", q_rot.sizes(), ", c ", c.sizes(),
              " and r ", r.sizes(), " do not match");
  const int64_t blocks = (positions + kBlock - 1) / kBlock;
  at::Tensor acc = at::empty({batch, blocks, s.heads, s.lora}, q_lat.options());
  at::Tensor ml = at::empty({2, batch, blocks, s.heads}, q_lat.options());
  float* accp = acc.data_ptr<float>();
  float* mp = ml.data_ptr<float>();
  float* lp = mp + batch * blocks * s.heads;
  const int64_t groups = (s.heads + kGroup - 1) / kGroup;
  // a float32 cache: a task is a block and a group of heads; a 16- or 8-bit one: a block, widened once for all its
  // groups
  const int64_t per_task = wide ? 1 : groups;
  at::parallel_for(0, batch * blocks * groups / per_task, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(kGroup * kBlock, 0.f);
    std::unique_ptr<float[]> rows(wide ? nullptr : new float[kBlock * (s.lora + s.rope)]);  // a block, widened
    for (int64_t i = begin * per_task; i < end * per_task; i++) {
      const int64_t task = i / groups, group = i % groups, b = task / blocks, block = task % blocks;
      const int64_t p0 = block * kBlock, p1 = std::min(positions, p0 + kBlock);
      const int64_t h0 = group * kGroup, h1 = std::min(s.heads, h0 + kGroup);
      const float *cp, *rp;
      int64_t c_row, r_row, first;
      if (wide) {
        cp = c.data_ptr<float>() + b * c.stride(0), rp = r.data_ptr<float>() + b * r.stride(0);
        c_row = c.stride(1), r_row = r.stride(1), first = p0;
      } else {
        if (group == 0) {
          widen(c, b, p0, p1, rows.get());
          widen(r, b, p0, p1, rows.get() + kBlock * s.lora);
        }
        cp = rows.get(), rp = rows.get() + kBlock * s.lora;
        c_row = s.lora, r_row = s.rope, first = 0;
      }
      attend_block(s, q_lat.data_ptr<float>() + b * s.heads * s.lora, q_rot.data_ptr<float>() + b * s.heads * s.rope,
                   cp, c_row, rp, r_row, first, first + (p1 - p0), h0, h1, (float)scale, weights.data(),
                   mp + task * s.heads, lp + task * s.heads, accp + task * s.heads * s.lora);
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

// The cache dtypes latent_attend reads (an extension built before 16-bit caches lacks this op: native.has).
std::vector<std::string> latent_cache_dtypes() { return {"float32", "float16", "bfloat16", "q8_0"}; }

TORCH_LIBRARY_FRAGMENT(weightstream, m) {
  m.def("latent_attend(Tensor q_lat, Tensor q_rot, Tensor c, Tensor r, float scale) -> Tensor");
  m.def("latent_cache_dtypes() -> str[]", &latent_cache_dtypes);
  m.def("quantize_q8_0(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(weightstream, CPU, m) {
  m.impl("latent_attend", &latent_attend);
  m.impl("quantize_q8_0", &quantize_q8_0);
}
