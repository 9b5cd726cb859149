// Quantized-weight products on the CPU: weights in GGML's block formats (the byte layouts GGUF files store),
// activations quantized to int8 in blocks of 32 (256 for the K types), products summed in integers.
//
// Each block type is defined once, in its own struct below (written from the formats' arithmetic, docs/kernels.md):
//   T::Block        its bytes, field by field (sizeof checked against GGML's size at compile time)
//   T::id           GGML's type id; T::name; T::elements per block; T::act, the activation block it meets
//   T::codes        the block's codes as unsigned bytes (stored code + T::code_offset), the portable reference
//   T::scales       its integer scales and mins per 16 weights, and its float d and m
//   T::sub_avx2     the codes of one 32-element sub-block on AVX2: the type's one vector decoder, which feeds both
//                   its rows (T::part_avx2, the block's integer sums against one row: exactly the portable
//                   integers) and the multi-row tiles (codes_avx2<T>: T::codes on AVX2); signed values where
//                   T::signed_subs (T::codes adds code_offset to them), else the unsigned codes themselves
//   T::dequantize   one block to float32, bitwise as the `gguf` package's decoder
//   T::isum_vnni    (the 32-element types) the block's integer sums against one row in one VNNI instruction, its
//                   codes unsigned (stored code + T::code_offset): the rows on AVX-512 VNNI (dot_row_vnni32), a
//                   second decoder where VNNI's byte mask or unsigned operand makes a shorter one
// and listed once in WS_TYPES; everything else (row sizes, checks, dispatch, the table Python checks itself against
// at load: native.py) is derived from those. Adding a type is its struct and its line in WS_TYPES.
//
// Activations: per block of 32 values (256 for the K types), dx = max|x| / 127, qx = round(x / dx) in -127..127,
// and per 32 and per 16 values the sum of qx. A block's product with a row is d dx isum + m dx msum, both sums
// integers (sub-block scales are integers), so a super-block of 256 costs one float multiply-add (two with a min
// term). BF16 is not quantized: its activations stay float32 and each weight meets its value in a float fused
// multiply-add.
//
// Determinism: every path (portable rows, AVX2 rows and their AVX-512 variants, tiles of 16 rows on AVX-512 VNNI or
// on AVX2) computes the same integers and then the same float chain per output (Chain), compiled with
// -ffp-contract=off so the compiler fuses nothing on its own; each output element is computed by one thread. So the
// result does not depend on the path, the thread count, the number of rows or the other rows of the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WS_X86 1
#define WS_AVX2_TARGET "avx2,fma,f16c"
#define WS_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni," WS_AVX2_TARGET
#define WS_AVX2 __attribute__((target(WS_AVX2_TARGET)))
#define WS_AVX2_INLINE __attribute__((target(WS_AVX2_TARGET), always_inline)) inline
#define WS_AVX512 __attribute__((target(WS_AVX512_TARGET)))
#define WS_AVX512_INLINE __attribute__((target(WS_AVX512_TARGET), always_inline)) inline
#endif

namespace {

// ---- shared arithmetic ----

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = mant;
    do { e++; m <<= 1; } while ((m & 0x400) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float bf16(const uint8_t* p) {
  const uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// All 8 (scale, min) pairs of a Q4_K / Q5_K super-block at once, from the 12 bytes as three 32-bit words.
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  uint32_t w[3];
  std::memcpy(w, q, 12);
  const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, two = 0x03030303u;
  const uint32_t s0 = w[0] & low6, m0 = w[1] & low6;
  const uint32_t s1 = (w[2] & low4) | (((w[0] >> 6) & two) << 4);
  const uint32_t m1 = ((w[2] >> 4) & low4) | (((w[1] >> 6) & two) << 4);
  std::memcpy(sc, &s0, 4);
  std::memcpy(sc + 4, &s1, 4);
  std::memcpy(m, &m0, 4);
  std::memcpy(m + 4, &m1, 4);
}

// Activations of one row quantized: K / act scales, K / 32 sums.
struct QAct {
  const int8_t* q;   // K values
  const float* d;    // one scale per activation block (32, or 256 for K types)
  const int16_t* s;  // one sum of q per 32 (at most 32 x 127 in size: int16, which the AVX2 min terms take)
  const int16_t* s16;  // one sum of q per 16 (Q2_K's mins are per 16)
  const float* f;    // BF16 weights: the K values themselves, not quantized
};

void quantize_row(const float* x, int64_t k, int64_t ablock, int8_t* q, float* d, int16_t* s, int16_t* s16) {
  for (int64_t b = 0; b < k / ablock; b++) {
    const float* xb = x + b * ablock;
    float amax = 0.f;
    for (int64_t i = 0; i < ablock; i++) amax = std::fmax(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < ablock; i++) q[b * ablock + i] = (int8_t)std::nearbyint(xb[i] * inv);
    d[b] = scale;
  }
  for (int64_t b = 0; b < k / 16; b++) {
    int32_t sum = 0;
    for (int i = 0; i < 16; i++) sum += q[b * 16 + i];
    s16[b] = (int16_t)sum;
  }
  for (int64_t b = 0; b < k / 32; b++) s[b] = (int16_t)(s16[2 * b] + s16[2 * b + 1]);
}

// What one block of weights gives against one row's activations, in integers and the two factors that scale them:
// the block's dot product is d dx isum + m dx msum, isum = sum over 16-element groups g of sc_g sum (q_i - offset) qx_i
// and msum = sum over g of mn_g sum qx_i (the min or offset term of the types that have one). Every path computes
// these integers exactly (in any order), so every path gives the same Part.
struct Part {
  int32_t isum, msum;
  float d, m;
};

// The float arithmetic every path shares, per output: block b's d dx times isum fused into accumulator b % 8, its
// m dx times msum into rest b % 8 (eight chains: one vector of them on the AVX2 rows, one chain at a time per lane
// of a tile), then each set of eight added in one fixed tree and the two sums added. So a row's result is the
// same bits whichever path, tile or batch computes it.
struct Chain {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, rest[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  template <bool HasMin>
  __attribute__((always_inline)) inline void add(int64_t b, const Part& p, float dx) {
    acc[b & 7] = std::fma(p.d * dx, (float)p.isum, acc[b & 7]);
    if constexpr (HasMin) rest[b & 7] = std::fma(p.m * dx, (float)p.msum, rest[b & 7]);
  }
  static float tree(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
  float total() const { return tree(acc) + tree(rest); }
};

// A block's integer scales and mins per 16 weights and its d and m, written where the caller wants them (a block's
// own arrays, or a whole row's): T::scales's output; T::codes gives the codes, unsigned (stored code + code_offset).
struct ScalesOut {
  int32_t* sc;
  int32_t* mn;
  float d = 0.f, m = 0.f;
};

inline void nibbles32(const uint8_t* qs, uint8_t* out) {  // Q4_0 / Q4_1 / MXFP4 element order
  for (int j = 0; j < 16; j++) {
    out[j] = qs[j] & 0xF;
    out[j + 16] = qs[j] >> 4;
  }
}

#ifdef WS_X86
WS_AVX2_INLINE float fp16_hw(const uint8_t* p) {  // the same value as fp16(): the conversion is exact
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// u8 x s8 pair sums, then pairs of those times `mult` (int16): 8 int32, lane l = mult x elements 4l..4l+3
WS_AVX2_INLINE __m256i lanes_u8_s8_times(__m256i w, __m256i x, __m256i mult) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), mult);
}

WS_AVX2_INLINE __m256i lanes_u8_s8(__m256i w, __m256i x) { return lanes_u8_s8_times(w, x, _mm256_set1_epi16(1)); }

WS_AVX2_INLINE __m256i lanes_s8_s8_times(__m256i w, __m256i x, __m256i mult) {
  return lanes_u8_s8_times(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), mult);  // |w| x sign(w) x
}

WS_AVX2_INLINE __m256i lanes_s8_s8(__m256i w, __m256i x) { return lanes_s8_s8_times(w, x, _mm256_set1_epi16(1)); }

WS_AVX2_INLINE __m256i nibbles32_avx2(const uint8_t* qs) {  // low nibbles in the low half, high in the high
  const __m128i raw = _mm_loadu_si128((const __m128i*)qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
}

// The 16 per-16 scales of a K super-block as int16, each 128-bit half holding 8 of them twice over: lo for
// sub-blocks 0-3 (scales 0-7), hi for 4-7 (scales 8-15).
struct Scales16 {
  __m256i lo, hi;
};

WS_AVX2_INLINE Scales16 scales16_avx2(__m128i sc8, bool is_signed) {
  const __m256i all = is_signed ? _mm256_cvtepi8_epi16(sc8) : _mm256_cvtepu8_epi16(sc8);
  return {_mm256_permute2x128_si256(all, all, 0x00), _mm256_permute2x128_si256(all, all, 0x11)};
}

// int16 multipliers of sub-block `sub` of 32 whose scales are per 16: scale 2 sub for elements 0-15, 2 sub + 1 for
// 16-31, broadcast by one shuffle.
WS_AVX2_INLINE __m256i per16(const Scales16& sc, int sub) {
  const int j = sub % 4;
  const __m256i ctrl = _mm256_setr_m128i(_mm_set1_epi16((short)((4 * j) | ((4 * j + 1) << 8))),
                                         _mm_set1_epi16((short)((4 * j + 2) | ((4 * j + 3) << 8))));
  return _mm256_shuffle_epi8(sub < 4 ? sc.lo : sc.hi, ctrl);
}

WS_AVX2_INLINE int32_t hsum_i32(__m256i v) {
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i quad = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xb1)));
}

// int16 element i of each 128-bit half, in all 16 int16 lanes
WS_AVX2_INLINE __m256i broadcast_i16(__m256i v, int i) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)((2 * i) | ((2 * i + 1) << 8))));
}

// A Q4_K / Q5_K block's 8 scales and 8 mins as int16, scales in both 128-bit halves: scales_mins_k4's arithmetic
// on the 12 bytes in a vector register (the 4 bytes loaded after them are the block's own and unused).
WS_AVX2_INLINE void scales_mins_k4_avx2(const uint8_t* q, __m256i& scales, __m128i& mins) {
  const __m128i w = _mm_loadu_si128((const __m128i*)q);                          // w0, w1, w2, -
  const __m128i low6 = _mm_set1_epi32(0x3f3f3f3f), low4 = _mm_set1_epi32(0x0f0f0f0f), two = _mm_set1_epi32(0x03030303);
  const __m128i s0m0 = _mm_and_si128(w, low6);                                    // s0, m0
  const __m128i w2 = _mm_srlv_epi32(_mm_shuffle_epi32(w, 0xaa), _mm_setr_epi32(0, 4, 0, 0));  // w2, w2 >> 4
  const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(w, 6), two), 4);         // from w0, w1
  const __m128i s1m1 = _mm_or_si128(_mm_and_si128(w2, low4), high);               // s1, m1
  const __m256i both = _mm256_cvtepu8_epi16(_mm_unpacklo_epi32(s0m0, s1m1));      // s0 s1 m0 m1 as 16 int16
  scales = _mm256_permute2x128_si256(both, both, 0x00);
  mins = _mm256_extracti128_si256(both, 1);
}

// The 8 mins of a Q4_K / Q5_K block times the 8 sums of qx of its sub-blocks, in integers.
WS_AVX2_INLINE int32_t min_term_k4(__m128i mins, const int16_t* sums) {
  const __m128i pairs = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)sums));
  const __m128i quad = _mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xb1)));
}

WS_AVX2_INLINE __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// A block's Part on AVX2, its integer sum still in 8 lanes (added up 8 blocks at a time: totals8).
struct PartV {
  __m256i isum;
  int32_t msum;
  float d, m;
};

// Lane i of the result is the sum of v[i]'s 8 lanes (exact: integers).
WS_AVX2_INLINE __m256i totals8(const __m256i* v) {
  const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}
#endif

// ---- the block types ----

struct Q8_0 {  // w = d q
  static constexpr int64_t id = 8, elements = 32, act = 32;
  static constexpr const char* name = "Q8_0";
  // scale_group: elements an integer scale covers (0: none, every sc is 1); min_group: those a min covers (0: none)
  static constexpr int code_offset = 128, scale_group = 0, min_group = 0;
  static constexpr bool has_min = false;
  struct Block {
    uint8_t d[2];
    int8_t qs[32];
  };
  static void codes(const Block& x, uint8_t* u) {
    for (int i = 0; i < 32; i++) u[i] = (uint8_t)(x.qs[i] + 128);
  }
  static void scales(const Block& x, ScalesOut& o) {
    o.sc[0] = o.sc[1] = 1;
    o.mn[0] = o.mn[1] = 0;
    o.d = fp16(x.d);
    o.m = 0.f;
  }
  static void dequantize(const Block& x, float* o) {
    const float d = fp16(x.d);
    for (int i = 0; i < 32; i++) o[i] = d * (float)x.qs[i];
  }
#ifdef WS_X86
  static constexpr bool signed_subs = true;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int) { return load256(x.qs); }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    return {lanes_s8_s8(sub_avx2(x, 0), load256(a.q + b * 32)), 0, fp16_hw(x.d), 0.f};
  }
  // VNNI multiplies unsigned bytes by signed ones: the codes as q + 128 (code_offset), 128 x sum(qx) taken back
  WS_AVX512_INLINE static __m256i isum_vnni(const Block& x, const int8_t* xq) {
    const __m256i codes = _mm256_xor_si256(load256(x.qs), _mm256_set1_epi8((char)0x80));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, load256(xq));
  }
#endif
};

// The legacy 32-element types: element j < 16 the low nibble of byte j, j + 16 its high nibble, and for Q5_0 and
// Q5_1 a fifth bit, bit j of the 32-bit word qh. w = d (q - 8) (Q4_0), d (q - 16) (Q5_0), d q + m (Q4_1, Q5_1):
// integer sums of the unsigned codes, the offset as d dx times the block's sum of qx.
struct BlockQ4_0 {
  uint8_t d[2];
  uint8_t qs[16];
};
struct BlockQ4_1 {
  uint8_t d[2], m[2];
  uint8_t qs[16];
};
struct BlockQ5_0 {
  uint8_t d[2];
  uint8_t qh[4];
  uint8_t qs[16];
};
struct BlockQ5_1 {
  uint8_t d[2], m[2];
  uint8_t qh[4];
  uint8_t qs[16];
};
template <typename B, bool WithMin, bool Fifth>
struct Legacy32 {
  using Block = B;
  static constexpr int code_offset = 0, scale_group = 0, min_group = 32;
  static constexpr bool has_min = true;
  static float offset(const Block& x, float d) {
    if constexpr (WithMin) return fp16(x.m);
    return (Fifth ? -16.f : -8.f) * d;
  }
  static void codes(const Block& x, uint8_t* u) {
    nibbles32(x.qs, u);
    if constexpr (Fifth) {
      uint32_t qh;
      std::memcpy(&qh, x.qh, 4);
      for (int i = 0; i < 32; i++) u[i] |= ((qh >> i) & 1) << 4;
    }
  }
  static void scales(const Block& x, ScalesOut& o) {
    o.sc[0] = o.sc[1] = 1;
    o.mn[0] = o.mn[1] = 1;  // the offset term: m times the block's sum of qx
    o.d = fp16(x.d);
    o.m = offset(x, o.d);
  }
  static void dequantize(const Block& x, float* o) {
    uint8_t u[32];
    codes(x, u);
    const float d = fp16(x.d);
    for (int i = 0; i < 32; i++) {
      if constexpr (WithMin) o[i] = d * (float)u[i] + fp16(x.m);
      else o[i] = d * (float)(u[i] - (Fifth ? 16 : 8));
    }
  }
#ifdef WS_X86
  static constexpr bool signed_subs = false;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int) {
    const __m256i low = nibbles32_avx2(x.qs);
    if constexpr (!Fifth) {
      return low;
    } else {  // byte i of the word's bits: broadcast, byte i / 8 to byte i, bit i % 8 tested, 0x10 where set
      uint32_t qh;
      std::memcpy(&qh, x.qh, 4);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32((int)qh),
          _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
      const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    const float d = fp16_hw(x.d);
    float m;  // the min converted as d is (F16C: offset's value, in one instruction)
    if constexpr (WithMin) m = fp16_hw(x.m);
    else m = offset(x, d);
    return {lanes_u8_s8(sub_avx2(x, 0), load256(a.q + b * 32)), a.s[b], d, m};
  }
  // With AVX-512 the fifth bits are a byte mask: 16 added where bit j of qh is set, one instruction.
  WS_AVX512_INLINE static __m256i isum_vnni(const Block& x, const int8_t* xq) {
    __m256i codes = nibbles32_avx2(x.qs);
    if constexpr (Fifth) {
      uint32_t qh;
      std::memcpy(&qh, x.qh, 4);
      codes = _mm256_mask_add_epi8(codes, (__mmask32)qh, codes, _mm256_set1_epi8(0x10));
    }
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, load256(xq));
  }
#endif
};
struct Q4_0 : Legacy32<BlockQ4_0, false, false> {
  static constexpr int64_t id = 2, elements = 32, act = 32;
  static constexpr const char* name = "Q4_0";
};
struct Q4_1 : Legacy32<BlockQ4_1, true, false> {
  static constexpr int64_t id = 3, elements = 32, act = 32;
  static constexpr const char* name = "Q4_1";
};
struct Q5_0 : Legacy32<BlockQ5_0, false, true> {
  static constexpr int64_t id = 6, elements = 32, act = 32;
  static constexpr const char* name = "Q5_0";
};
struct Q5_1 : Legacy32<BlockQ5_1, true, true> {
  static constexpr int64_t id = 7, elements = 32, act = 32;
  static constexpr const char* name = "Q5_1";
};

// The portable decoder of the 256-element types: T::code(x, sub, l), the value of element l of sub-block sub, and
// T::codes from it (the value plus code_offset, unsigned): one definition of where each type keeps its bits.
template <typename T>
struct SubCodes {
  template <typename B>
  static void codes(const B& x, uint8_t* u) {
    for (int sub = 0; sub < 8; sub++) {
      for (int l = 0; l < 32; l++) u[32 * sub + l] = (uint8_t)(T::code(x, sub, l) + T::code_offset);
    }
  }
};

// Q2_K: per 16 a 4-bit scale and a 4-bit min, codes 0..3; w = d sc q - dmin m. Sub-block s of 32 (half n = s / 4,
// j = s % 4) is bits 2j of bytes 32n..32n+31; its scale bytes are 2s (elements 0-15) and 2s + 1 (16-31).
struct Q2_K : SubCodes<Q2_K> {
  static constexpr int64_t id = 10, elements = 256, act = 256;
  static constexpr const char* name = "Q2_K";
  struct Block {
    uint8_t scales[16];  // low nibble scale, high nibble min
    uint8_t qs[64];
    uint8_t d[2], dmin[2];
  };
  static constexpr int code_offset = 0, scale_group = 16, min_group = 16;
  static constexpr bool has_min = true;
  static uint8_t code(const Block& x, int sub, int l) { return (x.qs[32 * (sub / 4) + l] >> (2 * (sub % 4))) & 3; }
  static void scales(const Block& x, ScalesOut& o) {
    for (int g = 0; g < 16; g++) {
      o.sc[g] = x.scales[g] & 0xF;
      o.mn[g] = x.scales[g] >> 4;
    }
    o.d = fp16(x.d);
    o.m = -fp16(x.dmin);
  }
  static void dequantize(const Block& x, float* o) {
    const float d = fp16(x.d), dmin = fp16(x.dmin);
    for (int g = 0; g < 16; g++) {  // 16 elements a scale
      const float dl = d * (float)(x.scales[g] & 0xF), ml = dmin * (float)(x.scales[g] >> 4);
      for (int l = 0; l < 16; l++) o[16 * g + l] = dl * (float)code(x, g / 2, 16 * (g % 2) + l) - ml;
    }
  }
#ifdef WS_X86
  static constexpr bool signed_subs = false;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int sub) {
    return _mm256_and_si256(_mm256_srli_epi16(load256(x.qs + 32 * (sub / 4)), 2 * (sub % 4)), _mm256_set1_epi8(3));
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)x.scales), low4 = _mm_set1_epi8(0xF);
    const Scales16 sc = scales16_avx2(_mm_and_si128(raw, low4), false);
    const int8_t* xq = a.q + b * 256;
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int sub = 0; sub < 8; sub++) {
      isum = _mm256_add_epi32(isum, lanes_u8_s8_times(sub_avx2(x, sub), load256(xq + 32 * sub), per16(sc, sub)));
    }
    // min term: the 16 mins times the 16 sums of qx, in integers
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
    const int32_t msum = hsum_i32(_mm256_madd_epi16(mins, load256(a.s16 + b * 16)));
    return {isum, msum, fp16_hw(x.d), -fp16_hw(x.dmin)};
  }
#endif
};

// Q3_K: per 16 a 6-bit scale (stored - 32), codes -4..3: 2 low bits as Q2_K lays them out, the third bit (set:
// no -4) bit s of hmask byte l for element l of sub-block s; w = d (sc - 32) q.
struct Q3_K : SubCodes<Q3_K> {
  static constexpr int64_t id = 11, elements = 256, act = 256;
  static constexpr const char* name = "Q3_K";
  static constexpr int code_offset = 4, scale_group = 16, min_group = 0;
  static constexpr bool has_min = false;
  struct Block {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint8_t d[2];
  };
  // 16 scales of 6 bits: the low 4 bits of scale i in bytes 0-7 (i < 8 low nibbles, else high), the high 2 bits in
  // bytes 8-11 (bits 2 (i / 4) of byte 8 + i % 4); unpacked four at a time in 32-bit words
  static void scales16(const Block& x, int8_t* sc) {
    uint32_t w[4];
    std::memcpy(w, x.scales, 12);
    const uint32_t low4 = 0x0f0f0f0fu, two = 0x03030303u, high = w[2];
    w[2] = ((w[0] >> 4) & low4) | (((high >> 4) & two) << 4);
    w[3] = ((w[1] >> 4) & low4) | (((high >> 6) & two) << 4);
    w[0] = (w[0] & low4) | ((high & two) << 4);
    w[1] = (w[1] & low4) | (((high >> 2) & two) << 4);
    std::memcpy(sc, w, 16);
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(sc[i] - 32);
  }
  static int8_t code(const Block& x, int sub, int l) {
    const int low = (x.qs[32 * (sub / 4) + l] >> (2 * (sub % 4))) & 3;
    return (int8_t)(low - ((x.hmask[l] >> sub) & 1 ? 0 : 4));
  }
  static void scales(const Block& x, ScalesOut& o) {
    int8_t sc[16];
    scales16(x, sc);
    for (int g = 0; g < 16; g++) {
      o.sc[g] = sc[g];
      o.mn[g] = 0;
    }
    o.d = fp16(x.d);
    o.m = 0.f;
  }
  static void dequantize(const Block& x, float* o) {
    int8_t sc[16];
    scales16(x, sc);
    const float d = fp16(x.d);
    for (int g = 0; g < 16; g++) {
      const float dl = d * (float)sc[g];
      for (int l = 0; l < 16; l++) o[16 * g + l] = dl * (float)code(x, g / 2, 16 * (g % 2) + l);
    }
  }
#ifdef WS_X86
  static constexpr bool signed_subs = true;
  // the codes -4..3: the low bits, less 4 where the third bit is clear (0 or 4 a byte: no carries)
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int sub) {
    const __m256i ones = _mm256_set1_epi8(1);
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(load256(x.qs + 32 * (sub / 4)), 2 * (sub % 4)),
                                         _mm256_set1_epi8(3));
    const __m256i clear = _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(load256(x.hmask), sub), ones), ones);
    return _mm256_sub_epi8(low, _mm256_slli_epi16(clear, 2));
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    // scales16's arithmetic on the four words in a vector register (the 12 bytes read as 8 + 4: no read past them)
    uint32_t w2;
    std::memcpy(&w2, x.scales + 8, 4);
    const __m128i w01 = _mm_loadl_epi64((const __m128i*)x.scales);                  // w0, w1, 0, 0
    const __m128i lows = _mm_srlv_epi32(_mm_unpacklo_epi64(w01, w01), _mm_setr_epi32(0, 0, 4, 4));
    const __m128i highs = _mm_srlv_epi32(_mm_set1_epi32((int)w2), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i sc6 = _mm_or_si128(_mm_and_si128(lows, _mm_set1_epi8(0xF)),
                                     _mm_slli_epi32(_mm_and_si128(highs, _mm_set1_epi8(3)), 4));
    const Scales16 sc = scales16_avx2(_mm_sub_epi8(sc6, _mm_set1_epi8(32)), true);
    __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int sub = 0; sub < 8; sub++) {
      const __m256i xv = load256(a.q + b * 256 + 32 * sub);
      isum = _mm256_add_epi32(isum, lanes_s8_s8_times(sub_avx2(x, sub), xv, per16(sc, sub)));
    }
    return {isum, 0, fp16_hw(x.d), 0.f};
  }
#endif
};

// Q4_K and Q5_K: per 32 a 6-bit scale and min, w = d sc q - dmin m; T::code(x, sub, l) is the code of element l
// of sub-block sub (the portable path), T::sub_avx2 the same codes 32 at a time (rows and tiles).
template <typename T>
struct ScalesMinsK : SubCodes<T> {
  static constexpr int code_offset = 0, scale_group = 32, min_group = 32;
  static constexpr bool has_min = true;
  template <typename B>
  static void scales(const B& x, ScalesOut& o) {
    uint8_t sc[8], mn[8];
    scales_mins_k4(x.scales, sc, mn);
    for (int g = 0; g < 16; g++) {
      o.sc[g] = sc[g / 2];
      o.mn[g] = mn[g / 2];
    }
    o.d = fp16(x.d);
    o.m = -fp16(x.dmin);
  }
#ifdef WS_X86
  // The tiles' form of scales(): a scale per 32 as int32, the mins as the int16 pairs of neighbouring sub-blocks
  // (which is their order in memory), d and m; the same integers and floats, a few vector instructions.
  template <typename B>
  WS_AVX2_INLINE static void tile_scales_avx2(const B& x, int32_t* sc, int32_t* mn2, float& d, float& m) {
    __m256i scales;
    __m128i mins;
    scales_mins_k4_avx2(x.scales, scales, mins);
    _mm256_storeu_si256((__m256i*)sc, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(scales)));
    _mm_storeu_si128((__m128i*)mn2, mins);
    d = fp16_hw(x.d);
    m = -fp16_hw(x.dmin);
  }
#endif
  template <typename B>
  static void dequantize(const B& x, float* o) {
    uint8_t sc[8], mn[8];
    scales_mins_k4(x.scales, sc, mn);
    const float d = fp16(x.d), dmin = fp16(x.dmin);
    for (int sub = 0; sub < 8; sub++) {
      const float scale = d * (float)sc[sub], offset = dmin * (float)mn[sub];
      for (int l = 0; l < 32; l++) o[32 * sub + l] = scale * (float)T::code(x, sub, l) - offset;
    }
  }
};

#ifdef WS_X86
// Q4_K's and Q5_K's integer sum: each sub-block's codes (T::sub_avx2) against its activations, times its scale.
template <typename T>
WS_AVX2_INLINE __m256i sum_subs_k4(const typename T::Block& x, const int8_t* xq, __m256i scales) {
  __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int sub = 0; sub < 8; sub++) {
    isum = _mm256_add_epi32(
        isum, lanes_u8_s8_times(T::sub_avx2(x, sub), load256(xq + 32 * sub), broadcast_i16(scales, sub)));
  }
  return isum;
}
#endif

// Q4_K: per 32 a 6-bit scale and min; 64-element chunk c holds sub-block 2c in the low nibbles of its 32 bytes,
// 2c + 1 in the high ones; w = d sc q - dmin m.
struct Q4_K : ScalesMinsK<Q4_K> {
  static constexpr int64_t id = 12, elements = 256, act = 256;
  static constexpr const char* name = "Q4_K";
  struct Block {
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qs[128];
  };
  static uint8_t code(const Block& x, int sub, int l) {
    const uint8_t byte = x.qs[32 * (sub / 2) + l];
    return sub & 1 ? byte >> 4 : byte & 0xF;
  }
#ifdef WS_X86
  static constexpr bool signed_subs = false;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int sub) {
    const __m256i raw = load256(x.qs + 32 * (sub / 2));
    return _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0xF));
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    uint32_t halves;
    std::memcpy(&halves, x.d, 4);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));  // d, dmin: exact, as fp16() gives them
    const float d = _mm_cvtss_f32(dd), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
    __m256i scales;
    __m128i mins;
    scales_mins_k4_avx2(x.scales, scales, mins);
    const int8_t* xq = a.q + b * 256;
    return {sum_subs_k4<Q4_K>(x, xq, scales), min_term_k4(mins, a.s + b * 8), d, -dmin};
  }
#endif
};

// Q5_K: Q4_K's scales, mins and nibbles, and a fifth bit: bit s of qh byte l for element l of sub-block s.
struct Q5_K : ScalesMinsK<Q5_K> {
  static constexpr int64_t id = 13, elements = 256, act = 256;
  static constexpr const char* name = "Q5_K";
  struct Block {
    uint8_t d[2], dmin[2];
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
  };
  static uint8_t code(const Block& x, int sub, int l) {
    const uint8_t byte = x.qs[32 * (sub / 2) + l];
    return (sub & 1 ? byte >> 4 : byte & 0xF) | (((x.qh[l] >> sub) & 1) << 4);
  }
#ifdef WS_X86
  static constexpr bool signed_subs = false;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int sub) {  // Q4_K's nibble, the fifth bit as 16
    const __m256i raw = load256(x.qs + 32 * (sub / 2)), ones = _mm256_set1_epi8(1);
    const __m256i low = _mm256_and_si256(sub & 1 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0xF));
    const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load256(x.qh), sub), ones), 4);
    return _mm256_or_si256(low, high);
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    __m256i scales;
    __m128i mins;
    scales_mins_k4_avx2(x.scales, scales, mins);
    const int8_t* xq = a.q + b * 256;
    return {sum_subs_k4<Q5_K>(x, xq, scales), min_term_k4(mins, a.s + b * 8), fp16_hw(x.d), -fp16_hw(x.dmin)};
  }
#endif
};

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, int8 scales per 16; w = d sc (q - 32). Sub-block s of 32
// (half n = s / 4, quarter r = s % 4): low nibbles of bytes 64n + 32(r & 1) (high nibbles when r >= 2), bits 2r
// of bytes 32n of the highs; scales 8n + 2r and 8n + 2r + 1.
struct Q6_K : SubCodes<Q6_K> {
  static constexpr int64_t id = 14, elements = 256, act = 256;
  static constexpr const char* name = "Q6_K";
  static constexpr int code_offset = 32, scale_group = 16, min_group = 0;
  static constexpr bool has_min = false;
  struct Block {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint8_t d[2];
  };
  static int8_t code(const Block& x, int sub, int l) {
    const int n = sub / 4, r = sub % 4;
    const uint8_t byte = x.ql[64 * n + 32 * (r & 1) + l], lo = r >> 1 ? byte >> 4 : byte & 0xF;
    const uint8_t hi = (x.qh[32 * n + l] >> (2 * r)) & 3;
    return (int8_t)((lo | (hi << 4)) - 32);
  }
  static int scale(const Block& x, int sub, int half) { return x.scales[8 * (sub / 4) + 2 * (sub % 4) + half]; }
  static void scales(const Block& x, ScalesOut& o) {
    for (int g = 0; g < 16; g++) {
      o.sc[g] = scale(x, g / 2, g % 2);
      o.mn[g] = 0;
    }
    o.d = fp16(x.d);
    o.m = 0.f;
  }
  static void dequantize(const Block& x, float* o) {
    const float d = fp16(x.d);
    for (int sub = 0; sub < 8; sub++) {
      for (int l = 0; l < 32; l++) o[32 * sub + l] = (d * (float)scale(x, sub, l / 16)) * (float)code(x, sub, l);
    }
  }
#ifdef WS_X86
  static constexpr bool signed_subs = false;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int sub) {  // code + 32: the 6 bits as stored
    const int n = sub / 4, r = sub % 4;
    const __m256i l4 = load256(x.ql + 64 * n + 32 * (r & 1));
    const __m256i lo = _mm256_and_si256(r >> 1 ? _mm256_srli_epi16(l4, 4) : l4, _mm256_set1_epi8(0xF));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load256(x.qh + 32 * n), 2 * r), _mm256_set1_epi8(3));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  // The stored 6 bits (code + 32, unsigned) against the activations, and the offset as 32 times the per-16 scales
  // against the rows' per-16 sums of qx: the same integers as signed codes, without making them signed (two
  // instructions a sub-block), each 32 bytes of codes loaded once.
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i*)x.scales);
    const Scales16 sc = scales16_avx2(sc8, true);
    const __m256i offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sc8), load256(a.s16 + b * 16));
    __m256i isum = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
#pragma GCC unroll 8
    for (int sub = 0; sub < 8; sub++) {
      const __m256i xv = load256(a.q + b * 256 + sub * 32);
      isum = _mm256_add_epi32(isum, lanes_u8_s8_times(sub_avx2(x, sub), xv, per16(sc, sub)));
    }
    return {isum, 0, fp16_hw(x.d), 0.f};
  }
#endif
};

// 2^(e - 128) for every E8M0 byte e, exact (subnormal below e = 2): MXFP4's scales, halved as GGML keeps them.
// A table read is one load where the bit arithmetic was a branch and a move between register files.
const std::array<float, 256> e8m0_half = [] {
  std::array<float, 256> out{};
  for (uint32_t e = 0; e < 256; e++) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
    std::memcpy(&out[e], &bits, 4);
  }
  return out;
}();

// MXFP4 (OCP microscaling, gpt-oss's experts): per 32 a power-of-two scale (E8M0) and 4-bit E2M1 codes, element
// order as Q4_0's. GGML keeps the code values doubled (integers -12..12) and the scale halved: w = kv[q] 2^(e-128).
struct MXFP4 {
  static constexpr int64_t id = 39, elements = 32, act = 32;
  static constexpr const char* name = "MXFP4";
  static constexpr int code_offset = 12, scale_group = 0, min_group = 0;
  static constexpr bool has_min = false;
  static constexpr int8_t kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  struct Block {
    uint8_t e;
    uint8_t qs[16];
  };
  static float scale(const Block& x) { return e8m0_half[x.e]; }
  static void values(const Block& x, int8_t* sv) {
    uint8_t u[32];
    nibbles32(x.qs, u);
    for (int i = 0; i < 32; i++) sv[i] = kvalues[u[i]];
  }
  static void codes(const Block& x, uint8_t* u) {
    int8_t sv[32];
    values(x, sv);
    for (int i = 0; i < 32; i++) u[i] = (uint8_t)(sv[i] + 12);
  }
  static void scales(const Block& x, ScalesOut& o) {
    o.sc[0] = o.sc[1] = 1;
    o.mn[0] = o.mn[1] = 0;
    o.d = scale(x);
    o.m = 0.f;
  }
  static void dequantize(const Block& x, float* o) {
    int8_t sv[32];
    values(x, sv);
    const float d = scale(x);
    for (int i = 0; i < 32; i++) o[i] = d * (float)sv[i];
  }
#ifdef WS_X86
  static constexpr bool signed_subs = true;
  WS_AVX2_INLINE static __m256i sub_avx2(const Block& x, int) {  // the doubled E2M1 values, -12..12
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kvalues));
    return _mm256_shuffle_epi8(table, nibbles32_avx2(x.qs));
  }
  WS_AVX2_INLINE static PartV part_avx2(const Block& x, const QAct& a, int64_t b) {
    return {lanes_s8_s8(sub_avx2(x, 0), load256(a.q + b * 32)), 0, scale(x), 0.f};
  }
  // the values + code_offset (0..24), VNNI's unsigned operand: one table lookup, as the signed values are
  static constexpr std::array<uint8_t, 16> kcodes = [] {
    std::array<uint8_t, 16> out{};
    for (int i = 0; i < 16; i++) out[i] = (uint8_t)(kvalues[i] + code_offset);
    return out;
  }();
  WS_AVX512_INLINE static __m256i isum_vnni(const Block& x, const int8_t* xq) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kcodes.data()));
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_shuffle_epi8(table, nibbles32_avx2(x.qs)), load256(xq));
  }
#endif
};

// BF16: 32 bfloat16 values a block, the upper halves of float32s, against float32 activations: element i into
// set (i / 8) % 4, lane i % 8 of float accumulators, then the sets and lanes in a fixed tree. Whole rows at a time.
struct BF16 {
  static constexpr int64_t id = 30, elements = 32, act = 0;  // act 0: activations stay float32
  static constexpr const char* name = "BF16";
  struct Block {
    uint8_t v[64];
  };
  static float total(const float (&lane)[4][8]) {
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = (lane[0][i] + lane[1][i]) + (lane[2][i] + lane[3][i]);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  }
  static float dot_row(const uint8_t* row, const float* x, int64_t k) {
    float lane[4][8] = {};
    for (int64_t i = 0; i < k; i++) {
      float& acc = lane[(i / 8) % 4][i % 8];
      acc = std::fma(bf16(row + 2 * i), x[i], acc);
    }
    return total(lane);
  }
  static void dequantize(const Block& x, float* o) {
    for (int i = 0; i < 32; i++) o[i] = bf16(x.v + 2 * i);
  }
#ifdef WS_X86
  WS_AVX2_INLINE static __m256 widen8(const uint8_t* p) {  // 8 bfloat16 values widened to float32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  WS_AVX2 static float dot_row_avx2(const uint8_t* row, const float* x, int64_t k) {
    // four named accumulators, not an array: an indexed array of vectors may be kept in memory, and every
    // multiply-add then waits on a store and a load
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    __m256 acc3 = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32, row += 64) {
      acc0 = _mm256_fmadd_ps(widen8(row), _mm256_loadu_ps(x + i), acc0);
      acc1 = _mm256_fmadd_ps(widen8(row + 16), _mm256_loadu_ps(x + i + 8), acc1);
      acc2 = _mm256_fmadd_ps(widen8(row + 32), _mm256_loadu_ps(x + i + 16), acc2);
      acc3 = _mm256_fmadd_ps(widen8(row + 48), _mm256_loadu_ps(x + i + 24), acc3);
    }
    float lane[4][8];
    _mm256_storeu_ps(lane[0], acc0);
    _mm256_storeu_ps(lane[1], acc1);
    _mm256_storeu_ps(lane[2], acc2);
    _mm256_storeu_ps(lane[3], acc3);
    return total(lane);
  }
#endif
};

// Every type, once: GGML's byte sizes checked here at compile time.
#define WS_TYPES(X) \
  X(Q8_0, 34) X(Q4_0, 18) X(Q4_1, 20) X(Q5_0, 22) X(Q5_1, 24) X(Q2_K, 84) X(Q3_K, 110) X(Q4_K, 144) X(Q5_K, 176) X(Q6_K, 210) \
  X(MXFP4, 17) X(BF16, 64)
#define WS_CHECK_SIZE(T, bytes) static_assert(sizeof(T::Block) == (bytes) && alignof(T::Block) == 1, #T);
WS_TYPES(WS_CHECK_SIZE)

// f(T{}) for the type whose GGML id is `wtype`.
template <typename F>
auto with_type(int64_t wtype, F&& f) {
  switch (wtype) {
#define WS_CASE(T, bytes) \
  case T::id: return f(T{});
    WS_TYPES(WS_CASE)
  }
  TORCH_CHECK(false, "weightstream qmm: unknown weight type ", wtype);
  return f(Q8_0{});  // not reached
}

struct Format {
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
  int64_t act;    // activation block (0: float32 activations)
};

Format format_of(int64_t wtype) {
  return with_type(wtype, [](auto t) {
    using T = decltype(t);
    return Format{T::elements, (int64_t)sizeof(typename T::Block), T::act};
  });
}

// Bytes of one row of k weights (whole blocks) of type wtype.
int64_t row_bytes_of(int64_t wtype, int64_t k) {
  const Format f = format_of(wtype);
  return k / f.block * f.bytes;
}

// ---- rows: the portable reference and the AVX2 path ----

// The portable path: each block unpacked (codes, scales) and summed in integers, the reference every other path
// equals.
template <typename T>
Part part_portable(const typename T::Block& x, const QAct& a, int64_t b) {
  constexpr int E = T::elements, G = E / 16;
  uint8_t u[E];
  int32_t sc[G], mn[G];
  ScalesOut o{sc, mn};
  T::codes(x, u);
  T::scales(x, o);
  const int8_t* xq = a.q + b * E;
  const int16_t* s16 = a.s16 + b * G;
  int32_t isum = 0, msum = 0;
  for (int g = 0; g < G; g++) {
    int32_t sum = 0;
    for (int i = 16 * g; i < 16 * g + 16; i++) sum += ((int32_t)u[i] - T::code_offset) * (int32_t)xq[i];
    isum += sc[g] * sum;
    msum += mn[g] * (int32_t)s16[g];
  }
  return {isum, msum, o.d, o.m};
}

template <typename T>
float dot_row_portable(const uint8_t* row, const QAct& a, int64_t k) {
  if constexpr (T::act == 0) {
    return T::dot_row(row, a.f, k);
  } else {
    Chain chain;
    const auto* blocks = reinterpret_cast<const typename T::Block*>(row);
    for (int64_t b = 0; b < k / T::elements; b++) chain.add<T::has_min>(b, part_portable<T>(blocks[b], a, b), a.d[b]);
    return chain.total();
  }
}

#ifdef WS_X86
// Block b0 + i's Part into lane i of the group's arrays.
template <typename T>
WS_AVX2_INLINE void take_part(const typename T::Block* blocks, const QAct& a, int64_t b0, int i, __m256i* v, float* d,
                              float* m, int32_t* ms, float* dx) {
  const PartV p = T::part_avx2(blocks[b0 + i], a, b0 + i);
  v[i] = p.isum;
  d[i] = p.d;
  m[i] = p.m;
  ms[i] = p.msum;
  dx[i] = a.d[b0 + i];
}

// Eight blocks at a time: their integer sums added up into one vector (lane i: block b0 + i), which meets the
// blocks' d dx in one fused multiply-add into the eight chains.
template <typename T>
WS_AVX2_INLINE float dot_row_body(const uint8_t* row, const QAct& a, int64_t k) {
  if constexpr (T::act == 0) {
    return T::dot_row_avx2(row, a.f, k);
  } else {
    const auto* blocks = reinterpret_cast<const typename T::Block*>(row);
    const int64_t nb = k / T::elements;
    __m256 acc = _mm256_setzero_ps(), rest = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
      const int n = (int)std::min<int64_t>(8, nb - b0);
      __m256i v[8];
      alignas(32) float d[8], m[8], dx[8];
      alignas(32) int32_t ms[8];
      if (n == 8) {  // the whole group, unrolled
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) take_part<T>(blocks, a, b0, i, v, d, m, ms, dx);
      } else {
        for (int i = 0; i < 8; i++) {
          if (i < n) {
            take_part<T>(blocks, a, b0, i, v, d, m, ms, dx);
          } else {
            v[i] = _mm256_setzero_si256();
            d[i] = m[i] = dx[i] = 0.f;
            ms[i] = 0;
          }
        }
      }
      const __m256 dxv = _mm256_load_ps(dx);
      __m256 next = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_load_ps(d), dxv), _mm256_cvtepi32_ps(totals8(v)), acc);
      __m256 next_rest = rest;
      if constexpr (T::has_min) {
        const __m256 mf = _mm256_mul_ps(_mm256_load_ps(m), dxv);
        next_rest = _mm256_fmadd_ps(mf, _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)ms)), rest);
      }
      if (n < 8) {  // only the blocks there are: a lane past them keeps its value (x + 0 would turn -0 into +0)
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        next = _mm256_blendv_ps(acc, next, live);
        next_rest = _mm256_blendv_ps(rest, next_rest, live);
      }
      acc = next;
      rest = next_rest;
    }
    alignas(32) float lanes[8], rests[8];
    _mm256_store_ps(lanes, acc);
    _mm256_store_ps(rests, rest);
    return Chain::tree(lanes) + Chain::tree(rests);
  }
}

template <typename T>
WS_AVX2 float dot_row_avx2(const uint8_t* row, const QAct& a, int64_t k) {
  return dot_row_body<T>(row, a, k);
}

// The same code compiled for a CPU with AVX-512: with its 32 vector registers a group's eight blocks stay in
// registers instead of spilling to the stack (the same arithmetic, so the same bits). Taken for the K types' blocks
// (`kWideRows`), whose bodies spilled: one 4096 x 4096 row product, 1 thread, 7 pairs alternated with the AVX2
// registers: Q6_K 30.6-34.5 -> 36.5-39.7 GB/s (+9 to +21% in every pair), Q4_K +4 to +17% in 6 of 7, the other
// K types unchanged. The 32-element types gained nothing from this build (Q4_0 lost 15% then): they take
// dot_row_vnni32 below instead.
template <typename T>
constexpr bool kWideRows = T::elements == 256 && T::act != 0;

template <typename T>
WS_AVX512 float dot_row_avx512(const uint8_t* row, const QAct& a, int64_t k) {
  return dot_row_body<T>(row, a, k);
}

// The 32-element types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4) on AVX-512 with VNNI: dot_row_body's groups of eight
// blocks and its float chain, each block's integer sums in one VNNI instruction (T::isum_vnni: unsigned codes
// against the signed activations; Q8_0's and MXFP4's signed codes as value + T::code_offset, that offset times
// the block's sum of qx subtracted after; Q5's fifth bits added under a byte mask), the activations'
// scales and sums loaded eight at a time: the same integers and the same float operations, so the same bits.
// Against dot_row_body (one 4096 x 4096 product, 1 thread, AMD EPYC, 3 rounds): Q5_0 11.8 -> 17.5 GB/s, Q8_0 29.2
// -> 39.7, MXFP4 13.0 -> 16.8, Q4_0 13.6 -> 16.7. What it took: a whole group and the row's last, partial one
// compiled apart (one body testing each block against the row's end ran Q8_0 25% slower than dot_row_body), the
// blocks' scales gathered in registers (a vector load of eight just-stored floats waits for the stores), no masked
// loads (25% on Q8_0 here): the activations' scales and sums are read past a row's end instead, into lanes the
// partial group discards (QRows::kPastRow pads them).
template <typename T>
constexpr bool kVnniRows32 = T::elements == 32 && T::act == 32;

// Blocks b0 .. b0 + n - 1 (n = 8 when Full) into the chains acc and rest.
template <typename T, bool Full>
WS_AVX512_INLINE void group_vnni32(const typename T::Block* blocks, const QAct& a, int64_t b0, int n, __m256& acc,
                                   __m256& rest) {
  __m256i v[8];
  float d[8], m[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) {
    if (Full || i < n) {
      const auto& x = blocks[b0 + i];
      const PartV p = T::part_avx2(x, a, b0 + i);  // its d and m; its integer sums are the next line's
      v[i] = T::isum_vnni(x, a.q + (b0 + i) * 32);
      d[i] = p.d;
      m[i] = p.m;
    } else {
      v[i] = _mm256_setzero_si256();
      d[i] = m[i] = 0.f;
    }
  }
  const __m256 dxv = _mm256_loadu_ps(a.d + b0);  // past the row's end: QRows::kPastRow, in lanes discarded below
  __m256i isum = totals8(v);
  if constexpr (T::signed_subs) {  // codes taken as value + offset: offset x the block's sum of qx taken back (the
    // integers exact for finite activations, whose sums `s` hold)
    const __m256i sums = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(a.s + b0)));
    isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(sums, _mm256_set1_epi32(T::code_offset)));
  }
  __m256 next = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_setr_ps(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]), dxv),
                                _mm256_cvtepi32_ps(isum), acc);
  __m256 next_rest = rest;
  if constexpr (T::has_min) {
    const __m256i ms = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(a.s + b0)));
    next_rest = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_setr_ps(m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]), dxv), _mm256_cvtepi32_ps(ms), rest);
  }
  if constexpr (Full) {
    acc = next;
    rest = next_rest;
  } else {  // a lane past the row keeps its value, as dot_row_body's
    const __mmask8 live = (__mmask8)((1u << n) - 1);
    acc = _mm256_mask_blend_ps(live, acc, next);
    rest = _mm256_mask_blend_ps(live, rest, next_rest);
  }
}

template <typename T>
WS_AVX512 float dot_row_vnni32(const uint8_t* row, const QAct& a, int64_t k) {
  const auto* blocks = reinterpret_cast<const typename T::Block*>(row);
  const int64_t nb = k / 32, full = nb / 8 * 8;
  __m256 acc = _mm256_setzero_ps(), rest = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < full; b0 += 8) group_vnni32<T, true>(blocks, a, b0, 8, acc, rest);
  if (full < nb) group_vnni32<T, false>(blocks, a, full, (int)(nb - full), acc, rest);
  alignas(32) float lanes[8], rests[8];
  _mm256_store_ps(lanes, acc);
  _mm256_store_ps(rests, rest);
  return Chain::tree(lanes) + Chain::tree(rests);
}
#endif

using DotFn = float (*)(const uint8_t*, const QAct&, int64_t);

bool have_vnni();

// The row dot of type wtype on path 1 (portable), 2 (AVX2, with its AVX-512 variants where the CPU has VNNI) or 5
// (AVX2's own body alone, which a VNNI CPU otherwise never runs: for the tests), looked up once per product.
DotFn dot_fn(int64_t path, int64_t wtype) {
  return with_type(wtype, [path](auto t) -> DotFn {
    using T = decltype(t);
#ifdef WS_X86
    if (path == 5) return &dot_row_avx2<T>;
    if (path == 2 && have_vnni()) {
      if constexpr (kWideRows<T>) return &dot_row_avx512<T>;
      if constexpr (kVnniRows32<T>) return &dot_row_vnni32<T>;
    }
    if (path == 2) return &dot_row_avx2<T>;
#endif
    (void)path;
    return &dot_row_portable<T>;
  });
}

// quantize_row's arithmetic, 8 values at a time: the same max (ignoring NaN, as fmax does), scale, reciprocal and
// round-to-nearest-even conversion, so the same bytes, scales and sums.
#ifdef WS_X86
WS_AVX2 void quantize_row_avx2(const float* x, int64_t k, int64_t ablock, int8_t* q, float* d, int16_t* s,
                               int16_t* s16) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < k / ablock; b++) {
    const float* xb = x + b * ablock;
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = 0; i < ablock; i += 8) mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), mx);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.f;
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    for (int64_t i = 0; i < ablock; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; j++) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), inv));
      const int64_t at = (b * ablock + i) / 16;
      s16[at] = (int16_t)hsum_i32(_mm256_add_epi32(v[0], v[1]));
      s16[at + 1] = (int16_t)hsum_i32(_mm256_add_epi32(v[2], v[3]));
      s[at / 2] = (int16_t)(s16[at] + s16[at + 1]);
      // packs work within 128-bit halves: (0 1 4 5 | 2 3 6 7) in 32-bit groups, put back in order
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(q + b * ablock + i), ordered);
    }
    d[b] = scale;
  }
}
#endif

bool have_avx2() {
#ifdef WS_X86
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

// AVX-512 with VNNI: 8-bit dot products into 32-bit sums, 16 rows a vector, in one instruction. (Without it, the
// multi-row tiles run on AVX2, 8 rows a vector, in three.)
bool have_vnni() {
#ifdef WS_X86
  static const bool yes = have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

// Paths: 0 the best this CPU runs (from tile_rows(wtype) rows VNNI tiles where it has them, else AVX2 tiles; fewer
// rows as AVX2 rows; portable rows without AVX2), 1 portable rows, 2 AVX2 rows, 3 VNNI tiles at every row count,
// 4 AVX2 tiles at every row count, 5 AVX2 rows without their AVX-512 variants. Every path gives the same bits.
int64_t resolve_path(int64_t path) {
  TORCH_CHECK(path == 0 || path == 1 || ((path == 2 || path == 4 || path == 5) && have_avx2()) ||
                  (path == 3 && have_vnni()),
              "weightstream qmm: path ", path, " is not available here");
  return path;
}

// The path of one-row dot products: 1 (portable), 2 (AVX2 and its variants) or 5 (AVX2's body alone).
int64_t row_path(int64_t path) {
  if (path == 1 || !have_avx2()) return 1;
  return path == 5 ? 5 : 2;
}

// Rows of a product from which the best path computes them as tiles (of 16 rows, the last of 8 or fewer on 8
// lanes). VNNI: from 4 rows tiles were faster for Q4_K, Q6_K and Q8_0, at 3 for the K types alone (2048 x 2048,
// 1 thread: Q4_K 0.38 ms by rows against 0.28 by tiles at 4 rows, Q8_0 0.49 against 0.43, 0.37 against 0.43 at 3).
// AVX2 (AMD EPYC without AVX-512, 2048 x 2048, 1 thread, ms by rows / by tiles; benchmarks/kernel_bench.py
// crossover): Q4_K 0.61 / 0.67 at 4 rows, 0.96 / 0.65 at 6; Q6_K 0.84 / 0.97 at 5, 1.03 / 0.98 at 6; Q8_0, whose
// signed codes take two more instructions a step, 2.25 / 2.37 at 12, 3.07 / 2.39 at 16.
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileRowsAvx2 = 6, kTileRowsAvx2Q8_0 = 16;

int64_t tile_rows(int64_t wtype) {
  if (have_vnni()) return kTileRows;
  return wtype == Q8_0::id ? kTileRowsAvx2Q8_0 : kTileRowsAvx2;
}

bool tiles_for(int64_t path, int64_t wtype, int64_t rows) {
  if (format_of(wtype).act == 0) return false;  // BF16: float activations, rows only
  return path == 3 || path == 4 || (path == 0 && have_avx2() && rows >= tile_rows(wtype));
}

void check_weights(const at::Tensor& w, int64_t wtype, int64_t n, int64_t k) {
  const Format f = format_of(wtype);
  TORCH_CHECK(k % f.block == 0, "weightstream qmm: ", k, " inputs are not whole blocks of ", f.block);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "weightstream qmm: weights must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(w.numel() == n * row_bytes_of(wtype, k), "weightstream qmm: weights hold ", w.numel(), " bytes; ", n,
              " x ", k, " of this type need ", n * row_bytes_of(wtype, k));
}

// Rows of activations quantized for one weight type (its activation block), kept for every product they meet.
struct QRows {
  // entries of d and s after the last row's: dot_row_vnni32 reads a group of 8 whole where the row ends inside it
  static constexpr int64_t kPastRow = 8;
  int64_t k = 0, blocks = 0, sums = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> s, s16;
  const float* f = nullptr;  // BF16 weights: the caller's rows as they are (they outlive this)

  QRows(const float* x, int64_t m, int64_t k_, int64_t wtype, int64_t path) : k(k_) {
    path = row_path(path);
    const int64_t ablock = format_of(wtype).act;
    if (ablock == 0) {
      f = x;
      return;
    }
    blocks = k / ablock;
    sums = k / 32;
    q.resize(m * k);
    d.resize(m * blocks + kPastRow);
    s.resize(m * sums + kPastRow);
    s16.resize(m * 2 * sums);
    for (int64_t r = 0; r < m; r++) {
      int8_t* qr = q.data() + r * k;
      float* dr = d.data() + r * blocks;
      int16_t* sr = s.data() + r * sums;
      int16_t* s16r = s16.data() + r * 2 * sums;
#ifdef WS_X86
      if (path != 1) {
        quantize_row_avx2(x + r * k, k, ablock, qr, dr, sr, s16r);
        continue;
      }
#endif
      quantize_row(x + r * k, k, ablock, qr, dr, sr, s16r);
    }
  }
  QAct row(int64_t r) const {
    if (f != nullptr) return {nullptr, nullptr, nullptr, nullptr, f + r * k};
    return {q.data() + r * k, d.data() + r * blocks, s.data() + r * sums, s16.data() + r * 2 * sums, nullptr};
  }
};

// ---- tiles: many rows at once ----
//
// A tile is 16 rows of activations against weight rows unpacked once (codes, scales) for all of them: per 4 inputs,
// one VNNI instruction multiplies a weight row's 4 codes (broadcast) by the 16 rows' 4 activations and adds the
// products into 16 int32 sums, one per row (AVX2: three instructions on 8 rows, tiles.inc). The integers are
// Part's, exactly; the float arithmetic is Chain's, lane by lane; so a row's result is the bits the rows paths
// give, whatever the rows around it.

// Rows of quantized activations laid out for the tiles: lane r of tile t is row list[16 t + r] (lanes past the end
// hold zeros); per 4 inputs one 64-byte vector of the 16 rows' codes, per block the 16 rows' scales, and the sums of
// qx the offset terms (code_offset times the sum over each scale group) and the min terms (over each min group) take:
// as int32 for the legacy types (a min of 1), as int16 pairs of neighbouring groups for the K types (one VNNI
// instruction multiplies two groups' sums by their two mins). A tile of 8 or fewer rows reads lanes 0-7 alone.
struct Tiles {
  bool vnni = false;  // computed by VNNI's kernel, else by AVX2's
  int64_t k = 0, m = 0, count = 0, blocks = 0, ogroups = 0, mgroups = 0, mvectors = 0;  // mvectors: of ms, a tile
  std::vector<int8_t> xs;   // count x k/4 x 64
  std::vector<float> dx;    // count x blocks x 16
  std::vector<int32_t> os;  // count x ogroups x 16
  std::vector<int32_t> ms;  // count x mvectors x 16: mgroups of int32 (legacy types), or mgroups/2 int16 pairs
};

// The types whose mins meet the rows' sums as int16 pairs of neighbouring min groups (the K types with a min; the
// legacy types' min is 1 a block, its sum taken as it is).
template <typename T>
constexpr bool kPairedMins = T::min_group != 0 && T::scale_group != 0;

template <typename T>
Tiles make_tiles(const QRows& a, const int64_t* list, int64_t m) {
  constexpr int E = T::elements, OG = T::scale_group ? T::scale_group : E, MG = T::min_group;
  Tiles t;
  t.k = a.k;
  t.m = m;
  t.count = (m + 15) / 16;
  t.blocks = a.k / E;
  t.ogroups = T::code_offset ? a.k / OG : 0;
  t.mgroups = MG ? a.k / MG : 0;
  t.mvectors = kPairedMins<T> ? t.mgroups / 2 : t.mgroups;
  const int64_t groups = a.k / 4;
  t.xs.assign(t.count * groups * 64, 0);
  t.dx.assign(t.count * t.blocks * 16, 0.f);
  t.os.assign(t.count * t.ogroups * 16, 0);
  t.ms.assign(t.count * t.mvectors * 16, 0);
  for (int64_t p = 0; p < m; p++) {
    const int64_t tile = p / 16, lane = p % 16;
    const QAct x = a.row(list[p]);
    int8_t* xs = t.xs.data() + tile * groups * 64 + lane * 4;
    for (int64_t g = 0; g < groups; g++) std::memcpy(xs + g * 64, x.q + 4 * g, 4);
    for (int64_t b = 0; b < t.blocks; b++) t.dx[(tile * t.blocks + b) * 16 + lane] = x.d[b];
    for (int64_t g = 0; g < t.ogroups; g++) {
      int32_t sum = 0;
      for (int i = 0; i < OG / 16; i++) sum += x.s16[g * (OG / 16) + i];
      t.os[(tile * t.ogroups + g) * 16 + lane] = T::code_offset * sum;
    }
    for (int64_t g = 0; g < t.mgroups; g++) {
      int32_t sum = 0;  // at most MG x 127 in size: an int16
      for (int i = 0; i < MG / 16; i++) sum += x.s16[g * (MG / 16) + i];
      if constexpr (kPairedMins<T>) {
        int16_t* pair = reinterpret_cast<int16_t*>(t.ms.data() + (tile * t.mvectors + g / 2) * 16 + lane);
        pair[g % 2] = (int16_t)sum;
      } else {
        t.ms[(tile * t.mvectors + g) * 16 + lane] = sum;
      }
    }
  }
  return t;
}

#ifdef WS_X86
// One weight row unpacked for the tiles: codes (plus code_offset, unsigned), a scale per scale group, the mins of
// the K types as int16 pairs of neighbouring min groups (their sums' layout in Tiles), and per block d and m.
template <typename T>
struct RowCodes {
  static constexpr int E = T::elements, SG = T::scale_group ? T::scale_group : E, MG = T::min_group ? T::min_group : E;
  std::vector<uint8_t> u;
  std::vector<int32_t> sc, mn2;
  std::vector<float> d, m;
  explicit RowCodes(int64_t k) : u(k), sc(k / SG), mn2(k / MG / 2 + 1), d(k / E), m(k / E) {}
};

template <typename T>
concept HasTileScales = requires(const typename T::Block& x, int32_t* p, float& f) {
  T::tile_scales_avx2(x, p, p, f, f);
};

// T::codes on AVX2 from the type's one decoder: its sub-blocks, signed values moved up by code_offset.
template <typename T>
WS_AVX2_INLINE void codes_avx2(const typename T::Block& x, uint8_t* u) {
#pragma GCC unroll 8
  for (int sub = 0; sub < T::elements / 32; sub++) {
    __m256i v = T::sub_avx2(x, sub);
    if constexpr (T::signed_subs) v = _mm256_add_epi8(v, _mm256_set1_epi8((char)T::code_offset));
    _mm256_storeu_si256((__m256i*)(u + 32 * sub), v);
  }
}

template <typename T>
WS_AVX2 void unpack_row(const uint8_t* row, int64_t k, RowCodes<T>& out) {
  constexpr int E = T::elements, SG = RowCodes<T>::SG, MG = RowCodes<T>::MG;
  const auto* blocks = reinterpret_cast<const typename T::Block*>(row);
  for (int64_t b = 0; b < k / E; b++) {
    codes_avx2<T>(blocks[b], out.u.data() + b * E);
    if constexpr (HasTileScales<T>) {
      T::tile_scales_avx2(blocks[b], out.sc.data() + b * E / SG, out.mn2.data() + b * E / MG / 2, out.d[b], out.m[b]);
      continue;
    }
    int32_t sc16[E / 16], mn16[E / 16];
    ScalesOut o{sc16, mn16};
    T::scales(blocks[b], o);
    out.d[b] = o.d;
    out.m[b] = o.m;
    if constexpr (T::scale_group != 0) {
      for (int g = 0; g < E / SG; g++) out.sc[b * E / SG + g] = sc16[g * SG / 16];
    }
    if constexpr (kPairedMins<T>) {
      for (int p = 0; p < E / MG / 2; p++) {
        const uint32_t lo = (uint16_t)mn16[2 * p * MG / 16], hi = (uint16_t)mn16[(2 * p + 1) * MG / 16];
        out.mn2[b * E / MG / 2 + p] = (int32_t)(lo | hi << 16);
      }
    }
  }
}

// A tile's lanes as one vector: 16 (AVX-512) or 8 (its 256-bit half, for a tile of 8 rows or fewer: the same
// layout's lanes 0-7). The same operations lane by lane, so a row's result does not depend on which computes it.
// Both widths from one definition: the intrinsics of width P (512 or 256) on its integer and float vectors.
#define WS_LANES(NAME, N, P, I_, F_)                                                                        \
  struct NAME {                                                                                            \
    static constexpr int n = N;                                                                            \
    static constexpr bool vnni = true;                                                                     \
    using I = I_;                                                                                          \
    using F = F_;                                                                                          \
    WS_AVX512_INLINE static I izero() { return _mm##P##_setzero_si##P(); }                                 \
    WS_AVX512_INLINE static F fzero() { return _mm##P##_setzero_ps(); }                                    \
    WS_AVX512_INLINE static I load(const void* p) { return _mm##P##_loadu_si##P((const I*)p); }            \
    WS_AVX512_INLINE static F loadf(const float* p) { return _mm##P##_loadu_ps(p); }                       \
    WS_AVX512_INLINE static I set1(int32_t v) { return _mm##P##_set1_epi32(v); }                           \
    WS_AVX512_INLINE static F set1f(float v) { return _mm##P##_set1_ps(v); }                               \
    WS_AVX512_INLINE static I dpbusd(I acc, I w, I x) { return _mm##P##_dpbusd_epi32(acc, w, x); }         \
    WS_AVX512_INLINE static I dpwssd(I acc, I w, I x) { return _mm##P##_dpwssd_epi32(acc, w, x); }         \
    WS_AVX512_INLINE static I add(I a, I b) { return _mm##P##_add_epi32(a, b); }                           \
    WS_AVX512_INLINE static I sub(I a, I b) { return _mm##P##_sub_epi32(a, b); }                           \
    WS_AVX512_INLINE static I mullo(I a, I b) { return _mm##P##_mullo_epi32(a, b); }                       \
    WS_AVX512_INLINE static F cvt(I a) { return _mm##P##_cvtepi32_ps(a); }                                 \
    WS_AVX512_INLINE static F mul(F a, F b) { return _mm##P##_mul_ps(a, b); }                              \
    WS_AVX512_INLINE static F addf(F a, F b) { return _mm##P##_add_ps(a, b); }                             \
    WS_AVX512_INLINE static F fmadd(F a, F b, F c) { return _mm##P##_fmadd_ps(a, b, c); }                  \
    WS_AVX512_INLINE static void store(float* p, F v) { _mm##P##_storeu_ps(p, v); }                        \
  };
WS_LANES(Lanes16, 16, 512, __m512i, __m512)
WS_LANES(Lanes8, 8, 256, __m256i, __m256)
#undef WS_LANES

// AVX2's 8 lanes: the same operations as Lanes8, VNNI's 8-bit products made of vpmaddubsw's int16 pairs and
// vpmaddwd's int32 sums (tiles.inc says when each is exact).
struct Lanes8Avx2 {
  static constexpr int n = 8;
  static constexpr bool vnni = false;
  using I = __m256i;
  using F = __m256;
  WS_AVX2_INLINE static I izero() { return _mm256_setzero_si256(); }
  WS_AVX2_INLINE static F fzero() { return _mm256_setzero_ps(); }
  WS_AVX2_INLINE static I load(const void* p) { return _mm256_loadu_si256((const I*)p); }
  WS_AVX2_INLINE static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  WS_AVX2_INLINE static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  WS_AVX2_INLINE static F set1f(float v) { return _mm256_set1_ps(v); }
  // u8 codes times s8 activations, neighbouring products summed in int16 (saturating: exact only while they fit)
  WS_AVX2_INLINE static I pairs(I w, I x) { return _mm256_maddubs_epi16(w, x); }
  // s8 codes times s8 activations, the same way: |w| against x with w's sign (|-128| is 128, unsigned)
  WS_AVX2_INLINE static I pairs_signed(I w, I x) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  }
  WS_AVX2_INLINE static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  WS_AVX2_INLINE static I widen(I a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
  WS_AVX2_INLINE static I dpwssd(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  WS_AVX2_INLINE static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  WS_AVX2_INLINE static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  WS_AVX2_INLINE static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  WS_AVX2_INLINE static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  WS_AVX2_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  WS_AVX2_INLINE static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  WS_AVX2_INLINE static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  WS_AVX2_INLINE static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

// The largest code (stored code + code_offset) of each type, and so how many of vpmaddubsw's int16 pair sums
// (each at most 2 x max code x 127 in size) one int16 holds: Q4_K's 8 steps of 4 inputs are its scale group.
constexpr int code_max_of(int64_t id) {
  switch (id) {
    case Q2_K::id: return 3;
    case Q3_K::id: return 7;
    case Q4_0::id: case Q4_1::id: case Q4_K::id: return 15;
    case MXFP4::id: return 24;
    case Q5_0::id: case Q5_1::id: case Q5_K::id: return 31;
    case Q6_K::id: return 63;
    default: return 255;  // Q8_0 (signed in the tiles); a type not listed with a smaller offset fails to compile
  }
}
template <typename T>
constexpr int kCodeMax = code_max_of(T::id);
template <typename T>
constexpr int kInt16Steps = 32767 / (2 * kCodeMax<T> * 127);

namespace vnni {
#define WS_TILE WS_AVX512
#define WS_TILE_INLINE WS_AVX512_INLINE
using Wide = Lanes16;
using Narrow = Lanes8;
constexpr int kWeightRows = 8;  // 8 chains in flight (4 left each chain's latency showing), in 32 registers
#include "tiles.inc"
#undef WS_TILE
#undef WS_TILE_INLINE
}  // namespace vnni

namespace avx2 {
#define WS_TILE WS_AVX2
#define WS_TILE_INLINE WS_AVX2_INLINE
using Wide = Lanes8Avx2;
using Narrow = Lanes8Avx2;
constexpr int kWeightRows = 4;  // in 16 registers: 4 rows' int16, group and block sums, the activations
#include "tiles.inc"
#undef WS_TILE
#undef WS_TILE_INLINE
}  // namespace avx2
#endif

// The products of weight rows j0..j1 with the activation rows a.row(list[p]), p < m: emit(p, j, y) for each, by
// tiles (`tiles`, made from the same rows) where given, else row by row with `dot`.
template <typename Emit>
void rows_product(int64_t wtype, const uint8_t* wp, int64_t row_bytes, int64_t k, int64_t j0, int64_t j1,
                  const QRows& a, const int64_t* list, int64_t m, const Tiles* tiles, DotFn dot, Emit&& emit) {
#ifdef WS_X86
  if (tiles != nullptr) {
    with_type(wtype, [&](auto t) {
      using T = decltype(t);
      if constexpr (T::act != 0) {
        if (tiles->vnni) {
          vnni::tile_product<T>(wp, row_bytes, j0, j1, *tiles, emit);
        } else {
          avx2::tile_product<T>(wp, row_bytes, j0, j1, *tiles, emit);
        }
      }
      return 0;
    });
    return;
  }
#endif
  for (int64_t j = j0; j < j1; j++) {
    const uint8_t* row = wp + j * row_bytes;
    for (int64_t p = 0; p < m; p++) emit(p, j, dot(row, a.row(list[p]), k));
  }
}

// Tiles of the rows list[0..m) for weight type wtype where this path computes m rows by tiles, else none.
std::optional<Tiles> tiles_of(int64_t path, int64_t wtype, const QRows& a, const int64_t* list, int64_t m) {
  if (!tiles_for(path, wtype, m)) return std::nullopt;
  return with_type(wtype, [&](auto t) -> std::optional<Tiles> {
    using T = decltype(t);
    if constexpr (T::act != 0) {
      Tiles tiles = make_tiles<T>(a, list, m);
      tiles.vnni = path == 3 || (path == 0 && have_vnni());
      return tiles;
    }
    return std::nullopt;
  });
}

// Output rows per parallel task: enough that a task reads about 64 KiB of weights.
int64_t grain_for(int64_t row_bytes) { return std::max<int64_t>(1, 65536 / row_bytes); }

// y (m, n) = x (m, k) times W^T, into y; x and y float32, contiguous.
void qmm_into(const float* x, int64_t m, int64_t k, const uint8_t* wp, int64_t wtype, int64_t n, float* yp,
              int64_t path) {
  const QRows a(x, m, k, wtype, path);
  const DotFn dot = dot_fn(row_path(path), wtype);
  const int64_t row_bytes = row_bytes_of(wtype, k);
  std::vector<int64_t> list(m);
  for (int64_t r = 0; r < m; r++) list[r] = r;
  const std::optional<Tiles> tiles = tiles_of(path, wtype, a, list.data(), m);
  at::parallel_for(0, n, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    rows_product(wtype, wp, row_bytes, k, begin, end, a, list.data(), m, tiles ? &*tiles : nullptr, dot,
                 [&](int64_t p, int64_t j, float y) { yp[p * n + j] = y; });
  });
}

// y (..., N) float32 = x (..., K) times W^T, W the N x K matrix the blocks encode; x of any float dtype.
at::Tensor product(const at::Tensor& x_in, const at::Tensor& w, int64_t wtype, int64_t n, int64_t k, int64_t path) {
  check_weights(w, wtype, n, k);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  std::vector<int64_t> sizes = x_in.sizes().vec();
  sizes.back() = n;
  at::Tensor y = at::empty(sizes, at::kFloat);
  qmm_into(x.data_ptr<float>(), x.numel() / k, k, w.data_ptr<uint8_t>(), wtype, n, y.data_ptr<float>(),
           resolve_path(path));
  return y;
}

// y (M, N) float32 = x (M, K) times W^T.
at::Tensor qmm(const at::Tensor& x_in, const at::Tensor& w, int64_t wtype, int64_t n, int64_t k, int64_t path) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == k, "weightstream qmm: x must be (rows, ", k, ")");
  return product(x_in, w, wtype, n, k, path);
}

// y (H, M, N) float32: each head h's rows x[h] (M, K) times its own W_h^T, W_h rows h N .. (h + 1) N of the blocks
// (N x K each). DeepSeek's absorbed attention multiplies each head's query by its k_b and its weighted latent by its
// v_b this way, in the type the file stores them (engine/latent_attention.py).
at::Tensor heads_product(const at::Tensor& x_in, const at::Tensor& w, int64_t wtype, int64_t n) {
  TORCH_CHECK(x_in.dim() == 3, "weightstream heads_product: x must be (heads, rows, K)");
  const int64_t heads = x_in.size(0), m = x_in.size(1), k = x_in.size(2);
  check_weights(w, wtype, heads * n, k);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t path = resolve_path(0);
  const QRows a(x.data_ptr<float>(), heads * m, k, wtype, path);
  const DotFn dot = dot_fn(row_path(path), wtype);
  const int64_t row_bytes = row_bytes_of(wtype, k);
  at::Tensor y = at::empty({heads, m, n}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, heads * n, grain_for(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j++) {
      const int64_t h = j / n, out = j % n;
      for (int64_t p = 0; p < m; p++) yp[(h * m + p) * n + out] = dot(wp + j * row_bytes, a.row(h * m + p), k);
    }
  });
  return y;
}

// A dense Linear in one call: y (..., N) in x's dtype = x (..., K) times W^T, plus bias (in x's dtype, after the
// product is rounded to it, as `y.to(dtype) + bias` would); the decode step of `NativeLinear`.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, int64_t wtype, int64_t n, int64_t k,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == k, "weightstream linear: x must be (..., ", k, ")");
  at::Tensor y = product(x_in, w, wtype, n, k, 0);
  if (x_in.scalar_type() != at::kFloat) y = y.to(x_in.scalar_type());
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// ---- one call per MoE layer ----
//
// A layer's routed experts: for each (token t, choice c) routed to an expert of `experts`,
// contrib[t, c] = (gate(x_t GU^T + b_gu)) D^T + b_d) * w[t, c], with gate_up the expert's (2I, D) blocks, down its
// (D, I) blocks and the biases optional (float, one per expert); then out[t] = the sum of contrib[t, c] over c in
// ascending expert order, in float32. The gate is one of Gate's kinds: SiLU on [G; U] stacked (most families), or
// gpt-oss's clamped SwiGLU on G and U interleaved (row 2j gate j, row 2j + 1 up j).
// `moe_contribute` fills the contributions of some experts (any grouping: an expert's contribution depends on its
// own weights and rows only), `moe_sum` adds them up, `moe_layer` is both in one call for a layer whose experts are
// all at hand. So a layer computed piecewise (resident experts first, each missing one once its bytes are in)
// equals the layer computed at once, bitwise.

struct Pair {
  int64_t token, choice;
};

// The gate between an expert's two products, and its biases.
struct Gate {
  enum Kind : int64_t { kSiluStacked = 0, kClampedSwigluInterleaved = 1 };
  int64_t kind = kSiluStacked;
  float alpha = 0.f, limit = 0.f;           // the clamped SwiGLU's: glu = g * sigmoid(alpha g), g <= limit, |u| <= limit
  std::vector<at::Tensor> gate_up_bias, down_bias;  // float32, one (2I) and one (D) an expert, or none

  // h[j] of one row from its 2I gate/up outputs g
  void apply(const float* g, float* h, int64_t inter) const {
    if (kind == kSiluStacked) {
      for (int64_t j = 0; j < inter; j++) h[j] = g[j] / (1.f + std::exp(-g[j])) * g[inter + j];
      return;
    }
    for (int64_t j = 0; j < inter; j++) {
      const float gate = std::min(g[2 * j], limit), up = std::min(std::max(g[2 * j + 1], -limit), limit);
      h[j] = (up + 1.f) * (gate / (1.f + std::exp(-gate * alpha)));
    }
  }
};

std::vector<at::Tensor> float_biases(at::TensorList biases, int64_t experts, int64_t size, const char* what) {
  TORCH_CHECK(biases.empty() || (int64_t)biases.size() == experts, "weightstream moe: ", what,
              " biases must be none or one per expert");
  std::vector<at::Tensor> out;
  for (const auto& b : biases) {
    TORCH_CHECK(b.numel() == size, "weightstream moe: a ", what, " bias must have ", size, " values, not ", b.numel());
    out.push_back(b.to(at::kFloat).contiguous());
  }
  return out;
}

Gate gate_of(at::TensorList gate_up_bias, at::TensorList down_bias, int64_t kind, double alpha, double limit) {
  TORCH_CHECK(kind == Gate::kSiluStacked || kind == Gate::kClampedSwigluInterleaved,
              "weightstream moe: unknown gate kind ", kind);
  Gate gate;
  gate.kind = kind;
  gate.alpha = (float)alpha;
  gate.limit = (float)limit;
  gate.gate_up_bias = gate_up_bias.vec();
  gate.down_bias = down_bias.vec();
  return gate;
}

// Pairs (t, c) routed to each of `experts` (ascending t within an expert).
std::vector<std::vector<Pair>> pairs_of(const at::Tensor& index, const std::vector<int64_t>& experts) {
  const int64_t tokens = index.size(0), top_k = index.size(1);
  const int64_t* ip = index.data_ptr<int64_t>();
  std::vector<std::vector<Pair>> out(experts.size());
  for (size_t i = 0; i < experts.size(); i++) {
    for (int64_t t = 0; t < tokens; t++) {
      for (int64_t c = 0; c < top_k; c++) {
        if (ip[t * top_k + c] == experts[i]) out[i].push_back({t, c});
      }
    }
  }
  return out;
}

void check_routing(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights) {
  TORCH_CHECK(x.dim() == 2, "weightstream moe: hidden states must be (tokens, hidden)");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == x.size(0) && index.scalar_type() == at::kLong,
              "weightstream moe: top_k_index must be int64 (tokens, top_k)");
  TORCH_CHECK(weights.sizes() == index.sizes(), "weightstream moe: top_k_weights must match top_k_index");
}

// One call's routed experts, resolved: weights checked, the pairs routed to each expert, the rows of x each takes
// (its tokens) and of h (its pairs, from first[i]), x quantized once for every expert; and the steps of a layer.
struct LayerJob {
  int64_t ne = 0, hidden = 0, top_k = 0, inter = 0, path = 0, gu_type = 0, down_type = 0;
  int64_t gu_rows = 0, gu_bytes = 0, down_bytes = 0, np = 0;
  Gate gate;
  at::Tensor x, wr;  // float32, contiguous: the hidden states and the router weights
  std::vector<std::vector<Pair>> pairs;
  std::vector<int64_t> first, tokens, hrows;  // pair p of expert i is row first[i] + p of the buffers
  std::vector<const uint8_t*> gu_ptr, down_ptr;
  DotFn gu_dot = nullptr, down_dot = nullptr;
  std::optional<QRows> ax;
  float* contrib = nullptr;

  int64_t count(int64_t i) const { return first[i + 1] - first[i]; }

  // expert i's gate/up outputs j0..j1 for its rows, into gi (tiles: its rows of x as tiles, or none)
  void gate_up_rows(int64_t i, int64_t j0, int64_t j1, const Tiles* tiles, float* gi) const {
    const float* bias = gate.gate_up_bias.empty() ? nullptr : gate.gate_up_bias[i].data_ptr<float>();
    rows_product(gu_type, gu_ptr[i], gu_bytes, hidden, j0, j1, *ax, tokens.data() + first[i], count(i), tiles, gu_dot,
                 [&](int64_t p, int64_t j, float y) { gi[p * gu_rows + j] = bias ? y + bias[j] : y; });
  }

  void gated(const float* g, float* h, int64_t rows) const {  // the gate of `rows` rows of g, into h
    for (int64_t p = 0; p < rows; p++) gate.apply(g + p * gu_rows, h + p * inter, inter);
  }

  // expert i's down outputs j0..j1 for its rows, their quantized h in ah (expert i's alone: hrows; all: first[i] on)
  void down_rows(int64_t i, int64_t j0, int64_t j1, const QRows& ah, const int64_t* list, const Tiles* tiles) const {
    const float* bias = gate.down_bias.empty() ? nullptr : gate.down_bias[i].data_ptr<float>();
    const float* wp = wr.data_ptr<float>();
    rows_product(down_type, down_ptr[i], down_bytes, inter, j0, j1, ah, list, count(i), tiles, down_dot,
                 [&](int64_t p, int64_t j, float y) {
                   const Pair& pr = pairs[i][p];
                   const int64_t slot = pr.token * top_k + pr.choice;
                   contrib[slot * hidden + j] = (bias ? y + bias[j] : y) * wp[slot];
                 });
  }

  // One expert, whole: gate/up, gate, down, in g and h (room for count(i) rows).
  void expert(int64_t i, float* g, float* h) const {
    const std::optional<Tiles> gu_tiles = tiles_of(path, gu_type, *ax, tokens.data() + first[i], count(i));
    gate_up_rows(i, 0, gu_rows, gu_tiles ? &*gu_tiles : nullptr, g);
    gated(g, h, count(i));
    const QRows ah(h, count(i), inter, down_type, path);
    const int64_t* own = hrows.data() + first[i];
    const std::optional<Tiles> down_tiles = tiles_of(path, down_type, ah, own, count(i));
    down_rows(i, 0, hidden, ah, own, down_tiles ? &*down_tiles : nullptr);
  }

  // Whole experts per task: each thread takes the next expert left, largest first (parallel_for would hand each
  // thread a fixed run of experts, and the one with the larger share would keep the other waiting).
  void by_expert() const {
    std::vector<int64_t> order(ne);
    for (int64_t i = 0; i < ne; i++) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return count(a) > count(b); });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      // one expert's gate/up outputs and gate at a time: the largest expert's rows, reused (they stay in cache,
      // and a prompt's temporaries are a few of its experts' rows, not every pair's)
      const std::unique_ptr<float[]> g(new float[count(order[0]) * gu_rows]), h(new float[count(order[0]) * inter]);
      for (int64_t taken; (taken = next.fetch_add(1)) < ne;) expert(order[taken], g.get(), h.get());
    });
  }

  // Each projection split across the threads: every expert's gate/up, the gate of all pairs, every expert's down.
  void by_projection() const {
    const std::unique_ptr<float[]> g(new float[np * gu_rows]), h(new float[np * inter]);  // every element written
    std::vector<std::optional<Tiles>> gu_tiles(ne), down_tiles(ne);
    for (int64_t i = 0; i < ne; i++) gu_tiles[i] = tiles_of(path, gu_type, *ax, tokens.data() + first[i], count(i));
    at::parallel_for(0, ne * gu_rows, grain_for(gu_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end;) {  // the run of outputs of one expert at a time
        const int64_t i = u / gu_rows, stop = std::min(end, (i + 1) * gu_rows);
        gate_up_rows(i, u - i * gu_rows, stop - i * gu_rows, gu_tiles[i] ? &*gu_tiles[i] : nullptr,
                     g.get() + first[i] * gu_rows);
        u = stop;
      }
    });
    gated(g.get(), h.get(), np);
    const QRows ah(h.get(), np, inter, down_type, path);
    std::vector<int64_t> all(np);
    for (int64_t p = 0; p < np; p++) all[p] = p;
    for (int64_t i = 0; i < ne; i++) down_tiles[i] = tiles_of(path, down_type, ah, all.data() + first[i], count(i));
    at::parallel_for(0, ne * hidden, grain_for(down_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end;) {
        const int64_t i = u / hidden, stop = std::min(end, (i + 1) * hidden);
        down_rows(i, u - i * hidden, stop - i * hidden, ah, all.data() + first[i],
                  down_tiles[i] ? &*down_tiles[i] : nullptr);
        u = stop;
      }
    });
  }
};

// The job's experts and routing: weights checked against their types and sizes, biases as float32, the pairs.
void route(LayerJob& job, const at::Tensor& index_in, const std::vector<int64_t>& experts,
           const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const Gate& gate_in) {
  const int64_t ne = job.ne, hidden = job.hidden;
  const Format fd = format_of(job.down_type);
  job.inter = down[0].numel() / hidden / fd.bytes * fd.block;
  job.gu_ptr.resize(ne);
  job.down_ptr.resize(ne);
  for (int64_t i = 0; i < ne; i++) {
    check_weights(gate_up[i], job.gu_type, 2 * job.inter, hidden);
    check_weights(down[i], job.down_type, hidden, job.inter);
    job.gu_ptr[i] = gate_up[i].data_ptr<uint8_t>();
    job.down_ptr[i] = down[i].data_ptr<uint8_t>();
  }
  job.gate = gate_in;
  job.gate.gate_up_bias = float_biases(gate_in.gate_up_bias, ne, 2 * job.inter, "gate_up");
  job.gate.down_bias = float_biases(gate_in.down_bias, ne, hidden, "down");
  job.pairs = pairs_of(index_in.contiguous(), experts);
  job.first.assign(ne + 1, 0);
  for (int64_t i = 0; i < ne; i++) job.first[i + 1] = job.first[i] + (int64_t)job.pairs[i].size();
  job.np = job.first[ne];
  job.tokens.resize(job.np);
  job.hrows.resize(job.np);
  for (int64_t i = 0; i < ne; i++) {
    for (int64_t p = 0; p < job.count(i); p++) {
      job.tokens[job.first[i] + p] = job.pairs[i][p].token;
      job.hrows[job.first[i] + p] = p;
    }
  }
}

void contribute(const at::Tensor& x_in, const at::Tensor& index_in, const at::Tensor& weights_in,
                const std::vector<int64_t>& experts, const std::vector<at::Tensor>& gate_up, int64_t gu_type,
                const std::vector<at::Tensor>& down, int64_t down_type, const Gate& gate_in, int64_t path,
                float* contrib) {
  LayerJob job;
  job.ne = (int64_t)experts.size();
  job.hidden = x_in.size(1);
  job.top_k = index_in.size(1);
  job.gu_type = gu_type;
  job.down_type = down_type;
  TORCH_CHECK((int64_t)gate_up.size() == job.ne && (int64_t)down.size() == job.ne,
              "weightstream moe: one gate_up and one down tensor per expert");
  if (job.ne == 0) return;
  route(job, index_in, experts, gate_up, down, gate_in);
  if (job.np == 0) return;
  job.path = resolve_path(path);
  job.x = x_in.to(at::kFloat).contiguous();
  job.wr = weights_in.to(at::kFloat).contiguous();
  job.contrib = contrib;
  job.ax.emplace(job.x.data_ptr<float>(), job.x.size(0), job.hidden, gu_type, job.path);
  job.gu_rows = 2 * job.inter;
  job.gu_bytes = row_bytes_of(gu_type, job.hidden);
  job.down_bytes = row_bytes_of(down_type, job.inter);
  job.gu_dot = dot_fn(row_path(job.path), gu_type);
  job.down_dot = dot_fn(row_path(job.path), down_type);
  // The same dot products either way (an output is one dot, its activations quantized row by row), so the two
  // schedules give the same bits: whole experts per task when there are enough of them to share out (one parallel
  // region, no barrier between an expert's gate/up and its down), else each projection split across the threads.
  if (job.ne >= 2 * (int64_t)at::get_num_threads()) {
    job.by_expert();
  } else {
    job.by_projection();
  }
}

// out (tokens, hidden) in `dtype`: per token, its contributions added in ascending expert order, in float32.
at::Tensor sum_contributions(const float* contrib, const at::Tensor& index_in, int64_t hidden, at::ScalarType dtype) {
  const at::Tensor index = index_in.contiguous();
  const int64_t tokens = index.size(0), top_k = index.size(1);
  const int64_t* ip = index.data_ptr<int64_t>();
  at::Tensor out = at::empty({tokens, hidden}, at::kFloat);
  float* op = out.data_ptr<float>();
  std::vector<int64_t> order(top_k);
  for (int64_t t = 0; t < tokens; t++) {
    for (int64_t c = 0; c < top_k; c++) order[c] = c;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return ip[t * top_k + a] < ip[t * top_k + b];
    });
    float* o = op + t * hidden;
    std::fill(o, o + hidden, 0.f);
    for (int64_t c : order) {
      const float* cp = contrib + (t * top_k + c) * hidden;
      for (int64_t j = 0; j < hidden; j++) o[j] += cp[j];
    }
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

// contrib: contiguous float32 (tokens, top_k, hidden) for this routing (hidden < 0: any width)
void check_contributions(const at::Tensor& contrib, const at::Tensor& index, int64_t hidden) {
  TORCH_CHECK(contrib.scalar_type() == at::kFloat && contrib.is_contiguous() && contrib.dim() == 3 &&
                  contrib.size(0) == index.size(0) && contrib.size(1) == index.size(1) &&
                  (hidden < 0 || contrib.size(2) == hidden),
              "weightstream moe: contrib must be contiguous float32 (tokens, top_k, hidden)");
}

void moe_contribute(at::Tensor contrib, const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                    at::IntArrayRef experts, at::TensorList gate_up, int64_t gu_type, at::TensorList down,
                    int64_t down_type, at::TensorList gate_up_bias, at::TensorList down_bias, int64_t gate,
                    double alpha, double limit, int64_t path) {
  check_routing(x, index, weights);
  check_contributions(contrib, index, x.size(1));
  contribute(x, index, weights, experts.vec(), gate_up.vec(), gu_type, down.vec(), down_type,
             gate_of(gate_up_bias, down_bias, gate, alpha, limit), path, contrib.data_ptr<float>());
}

at::Tensor moe_sum(const at::Tensor& contrib, const at::Tensor& index, const at::Tensor& like) {
  check_contributions(contrib, index, -1);
  return sum_contributions(contrib.data_ptr<float>(), index, contrib.size(2), like.scalar_type());
}

at::Tensor moe_layer(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights, at::IntArrayRef experts,
                     at::TensorList gate_up, int64_t gu_type, at::TensorList down, int64_t down_type,
                     at::TensorList gate_up_bias, at::TensorList down_bias, int64_t gate, double alpha, double limit,
                     int64_t path) {
  check_routing(x, index, weights);
  // contribute writes every (token, choice) row routed to one of `experts`; only the others are zeroed here (a
  // prompt's contributions are many megabytes, and filling them twice cost more than the additions)
  const int64_t slots = index.size(0) * index.size(1), hidden = x.size(1);
  const std::unique_ptr<float[]> contrib(new float[slots * hidden]);
  std::vector<int64_t> given = experts.vec();
  std::sort(given.begin(), given.end());
  const at::Tensor idx = index.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t slot = 0; slot < slots; slot++) {
    if (!std::binary_search(given.begin(), given.end(), ip[slot])) {
      std::fill(contrib.get() + slot * hidden, contrib.get() + (slot + 1) * hidden, 0.f);
    }
  }
  contribute(x, index, weights, experts.vec(), gate_up.vec(), gu_type, down.vec(), down_type,
             gate_of(gate_up_bias, down_bias, gate, alpha, limit), path, contrib.get());
  return sum_contributions(contrib.get(), index, hidden, x.scalar_type());
}

// W (N, K) float32, every weight as its block encodes it (the reference the products are checked against).
at::Tensor dequantize(const at::Tensor& w, int64_t wtype, int64_t n, int64_t k) {
  check_weights(w, wtype, n, k);
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const int64_t row_bytes = row_bytes_of(wtype, k);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_type(wtype, [&](auto t) {
    using T = decltype(t);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; j++) {
        const auto* blocks = reinterpret_cast<const typename T::Block*>(wp + j * row_bytes);
        for (int64_t b = 0; b < k / T::elements; b++) T::dequantize(blocks[b], op + j * k + b * T::elements);
      }
    });
    return 0;
  });
  return out;
}

bool avx2_available() { return have_avx2(); }

// (name, GGML id, elements a block, bytes a block, activation block) of every type: native.py checks its own
// table against this one at load.
std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>> block_types() {
  std::vector<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t>> out;
#define WS_ROW(T, bytes) out.emplace_back(T::name, T::id, T::elements, (int64_t)sizeof(T::Block), T::act);
  WS_TYPES(WS_ROW)
  return out;
}

}  // namespace

TORCH_LIBRARY(weightstream, m) {
  m.def("qmm(Tensor x, Tensor w, int wtype, int n, int k, int path=0) -> Tensor");
  m.def("dequantize(Tensor w, int wtype, int n, int k) -> Tensor");
  m.def("heads_product(Tensor x, Tensor w, int wtype, int n) -> Tensor");
  m.def("linear(Tensor x, Tensor w, int wtype, int n, int k, Tensor? bias=None) -> Tensor");
  m.def("moe_layer(Tensor x, Tensor top_k_index, Tensor top_k_weights, int[] experts, Tensor[] gate_up, int gu_type, "
        "Tensor[] down, int down_type, Tensor[] gate_up_bias, Tensor[] down_bias, int gate, float alpha, float limit, "
        "int path=0) -> Tensor");
  m.def("moe_contribute(Tensor(a!) contrib, Tensor x, Tensor top_k_index, Tensor top_k_weights, int[] experts, "
        "Tensor[] gate_up, int gu_type, Tensor[] down, int down_type, Tensor[] gate_up_bias, Tensor[] down_bias, "
        "int gate, float alpha, float limit, int path=0) -> ()");
  m.def("moe_sum(Tensor contrib, Tensor top_k_index, Tensor like) -> Tensor");
}

TORCH_LIBRARY_IMPL(weightstream, CPU, m) {
  m.impl("qmm", &qmm);
  m.impl("dequantize", &dequantize);
  m.impl("heads_product", &heads_product);
  m.impl("linear", &linear);
  m.impl("moe_layer", &moe_layer);
  m.impl("moe_contribute", &moe_contribute);
  m.impl("moe_sum", &moe_sum);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "weightstream's native CPU kernels (registered as torch.ops.weightstream.*)";
  module.def("avx2", &avx2_available, "whether this CPU runs the AVX2 path");
  module.def("vnni", &have_vnni, "whether this CPU has AVX-512 with VNNI (the tiles' 16-row kernel)");
  module.def("tile_rows", &tile_rows, "rows of a product of this weight type from which auto computes them as tiles");
  module.def("block_types", &block_types, "(name, GGML id, elements, bytes, activation block) of every block type");
}
