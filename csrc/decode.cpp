// One decode row of a DeepSeek decoder layer in a few calls: `mla_decode`, its attention half (the input norm, the
// query (q_lora's two products and their norm, or one), the latent and rotary key, their norm and rotation, the
// cache's next position written, the absorbed attention (k_b, the latents' softmax-weighted sum, v_b), the output
// projection, the residual sum, and the post-attention norm the MLP takes); `route_decode`, a MoE block's router;
// `mlp_decode`, a dense MLP or the shared experts and the sums. Each step is the op that engine/latent_attention.py's
// `LatentAttention.decode`, engine/lean_moe.py and the layer's modules call (looked up in the dispatcher, or the same
// ATen call: the same kernels on the same values, the same bits), in the same order; at one row those steps are some
// 60 Python and torch calls a layer, a share of a token that the arithmetic does not explain (engine/lean_layer.py
// has the figures).

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace {

template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                            const std::optional<at::Tensor>&);
using NormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using RopeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, bool);
using PairsFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
using HeadsFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using AttendFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using QuantizeFn = at::Tensor(const at::Tensor&);

// Position `used` of a cache buffer written with `row`: as it is (rounded to a 16-bit buffer's dtype by copy_), or as
// q8_0 blocks into a uint8 buffer (weightstream::quantize_q8_0, as engine/kv_cache.py writes a prompt's rows).
void write_row(const at::Tensor& buffer, int64_t used, const at::Tensor& row) {
  static const auto quantize_op = op<QuantizeFn>("weightstream::quantize_q8_0");
  buffer.narrow(2, used, 1).copy_(buffer.scalar_type() == at::kByte ? quantize_op.call(row) : row);
}

// The values a cache buffer's row holds (q8_0: 32 a 34-byte block; -1 for a q8_0 row of part of a block).
int64_t row_values(const at::Tensor& buffer) {
  if (buffer.scalar_type() != at::kByte) return buffer.size(3);
  return buffer.size(3) % 34 ? -1 : buffer.size(3) / 34 * 32;
}

// One row times the i-th of the blocks `w` (types, rows x cols each), by weightstream::linear: a NativeLinear's
// one-row forward.
at::Tensor product(const at::Tensor& x, at::TensorList w, at::IntArrayRef types, at::IntArrayRef rows,
                   at::IntArrayRef cols, size_t i) {
  static const auto linear_op = op<LinearFn>("weightstream::linear");
  return linear_op.call(x, w[i], types[i], rows[i], cols[i], std::nullopt);
}

// Rotations the layer's rotary function may be: transformers' rotate-half form or DeepSeek-V3's interleaved one on
// (cos, sin), or DeepSeek-V2's complex pairs.
enum RotKind : int64_t { kRope = 0, kRopeInterleaved = 1, kPairs = 2 };

// h (1, 1, D): the residual stream entering the layer. w: [q_a, q_b, kv_a, o] (a q_lora model) or [q, kv_a, o],
// GGML blocks of `types`, rows x cols each; k_b and v_b the absorbed attention's blocks (each head's kv_lora rows of
// nope, and its v rows of kv_lora). norms/eps: [input, q_a (a q_lora model), kv_a, post-attention]. rot_a/rot_b:
// (cos, sin) or the complex frequencies (rot_b absent). c_buf (1, 1, capacity, kv_lora) and r_buf (1, 1, capacity,
// rope), or q8_0 blocks of those (uint8): the layer's cache buffers, positions [0, used) filled; `used` gets this
// row's. dims: heads, nope, rope, v, kv_lora. Returns (h + attention, the post-attention norm of that).
std::tuple<at::Tensor, at::Tensor> mla_decode(const at::Tensor& h, at::TensorList w, at::IntArrayRef types,
                                              at::IntArrayRef rows, at::IntArrayRef cols, const at::Tensor& k_b,
                                              int64_t k_type, const at::Tensor& v_b, int64_t v_type,
                                              at::TensorList norms, at::ArrayRef<double> eps, const at::Tensor& rot_a,
                                              const std::optional<at::Tensor>& rot_b, int64_t rot_kind,
                                              const at::Tensor& c_buf, const at::Tensor& r_buf, int64_t used,
                                              at::IntArrayRef dims, double scale) {
  static const auto norm_op = op<NormFn>("weightstream::rms_norm");
  static const auto rope_op = op<RopeFn>("weightstream::rope");
  static const auto pairs_op = op<PairsFn>("weightstream::rope_pairs");
  static const auto heads_op = op<HeadsFn>("weightstream::heads_product");
  static const auto attend_op = op<AttendFn>("weightstream::latent_attend");
  const bool q_lora = w.size() == 4;
  TORCH_CHECK((w.size() == 4 || w.size() == 3) && types.size() == w.size() && rows.size() == w.size() &&
                  cols.size() == w.size() && norms.size() == (q_lora ? 4u : 3u) && eps.size() == norms.size() &&
                  dims.size() == 5,
              "weightstream mla_decode: weights, norms and sizes do not match");
  TORCH_CHECK(h.dim() == 3 && h.size(0) == 1 && h.size(1) == 1 && h.scalar_type() == at::kFloat,
              "weightstream mla_decode: one float32 row (1, 1, hidden) only");
  const int64_t heads = dims[0], nope = dims[1], rope = dims[2], v = dims[3], kv_lora = dims[4];
  TORCH_CHECK(used >= 0 && used < c_buf.size(2) && used < r_buf.size(2) && row_values(c_buf) == kv_lora &&
                  row_values(r_buf) == rope && c_buf.scalar_type() == r_buf.scalar_type(),
              "weightstream mla_decode: the cache buffers hold ", c_buf.sizes(), " and ", r_buf.sizes(),
              "; position ", used, " does not fit");
  auto lin = [&](const at::Tensor& x, size_t i) { return product(x, w, types, rows, cols, i); };

  const at::Tensor x = norm_op.call(h, norms[0], eps[0]);
  size_t next = 0, norm = 1;
  at::Tensor query;
  if (q_lora) {
    query = lin(norm_op.call(lin(x, 0), norms[1], eps[1]), 1);
    next = 2, norm = 2;
  } else {
    query = lin(x, 0);
    next = 1;
  }
  const auto q_parts = query.view({1, heads, 1, -1}).split_with_sizes({nope, rope}, -1);
  const auto kv_parts = lin(x, next).split_with_sizes({kv_lora, rope}, -1);
  const at::Tensor latent = norm_op.call(kv_parts[0], norms[norm], eps[norm]).view({1, 1, 1, kv_lora});
  const at::Tensor k_rot_in = kv_parts[1].view({1, 1, 1, rope});
  at::Tensor q_rot, k_rot;
  if (rot_kind == kPairs) {
    std::tie(q_rot, k_rot) = pairs_op.call(q_parts[1], k_rot_in, at::view_as_real(rot_a));
  } else {
    TORCH_CHECK(rot_b.has_value(), "weightstream mla_decode: cos and sin needed");
    std::tie(q_rot, k_rot) = rope_op.call(q_parts[1], k_rot_in, rot_a, *rot_b, rot_kind == kRopeInterleaved);
  }
  write_row(c_buf, used, latent);
  write_row(r_buf, used, k_rot);
  const at::Tensor c = c_buf.narrow(2, 0, used + 1).select(1, 0);
  const at::Tensor r = r_buf.narrow(2, 0, used + 1).select(1, 0);
  const at::Tensor q_lat = heads_op.call(q_parts[0].view({heads, 1, nope}), k_b, k_type, kv_lora).view({1, heads, kv_lora});
  const at::Tensor weighted = attend_op.call(q_lat, q_rot.view({1, heads, rope}), c, r, scale);
  const at::Tensor out = heads_op.call(weighted.view({heads, 1, kv_lora}), v_b, v_type, v);
  const at::Tensor attended = h + lin(out.view({1, 1, heads * v}), next + 1);
  return {attended, norm_op.call(attended, norms[norm + 1], eps[norm + 1])};
}

// The MLP half of a decode row: residual + (routed + down(silu(gate(x)) * up(x))), or residual + down(...) without
// routed experts (a dense layer): a DeepSeek MoE block's shared experts and its sum with the routed experts' output
// (engine/lean_moe.py), and the layer's residual sum, in the modules' order. w: [gate, up, down], GGML blocks of
// `types`, rows x cols each.
at::Tensor mlp_decode(const at::Tensor& x, const at::Tensor& residual, at::TensorList w, at::IntArrayRef types,
                      at::IntArrayRef rows, at::IntArrayRef cols, const std::optional<at::Tensor>& routed) {
  TORCH_CHECK(w.size() == 3 && types.size() == 3 && rows.size() == 3 && cols.size() == 3,
              "weightstream mlp_decode: gate, up and down needed");
  auto lin = [&](const at::Tensor& in, size_t i) { return product(in, w, types, rows, cols, i); };
  const at::Tensor mlp = lin(at::silu(lin(x, 0)) * lin(x, 1), 2);
  return residual + (routed.has_value() ? routed->view(x.sizes()) + mlp : mlp);
}

// A DeepSeek router's (top-k weights, top-k indices) of one float32 row (1, hidden), as engine/lean_moe.py's
// `_router` (kind 0: V3's sigmoid scores, the correction bias for the choice, normalized if `norm`) and
// `_softmax_router` (kind 1: V2's greedy softmax) compute them: the same ATen calls in the same order.
std::tuple<at::Tensor, at::Tensor> route_decode(const at::Tensor& row, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias, int64_t kind, int64_t top_k,
                                                bool norm, double scaling) {
  if (kind == 1) {
    const at::Tensor scores = at::linear(row, weight).softmax(-1, at::kFloat);
    auto [weights, indices] = at::topk(scores, top_k, -1, true, false);
    return {weights * scaling, indices};
  }
  TORCH_CHECK(kind == 0 && bias.has_value(), "weightstream route_decode: kind 0 (sigmoid, with its bias) or 1");
  const at::Tensor scores = at::linear(row, weight).sigmoid();
  const at::Tensor indices = std::get<1>(at::topk(scores + *bias, top_k, -1, true, false));
  at::Tensor weights = scores.gather(1, indices);
  if (norm) weights.div_(weights.sum(-1, true) + 1e-20);
  return {weights * scaling, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(weightstream, m) {
  m.def(
      "mlp_decode(Tensor x, Tensor residual, Tensor[] w, int[] types, int[] rows, int[] cols, Tensor? routed=None) "
      "-> Tensor");
  m.def(
      "route_decode(Tensor row, Tensor weight, Tensor? bias, int kind, int top_k, bool norm, float scaling) -> "
      "(Tensor, Tensor)");
  m.def(
      "mla_decode(Tensor h, Tensor[] w, int[] types, int[] rows, int[] cols, Tensor k_b, int k_type, Tensor v_b, "
      "int v_type, Tensor[] norms, float[] eps, Tensor rot_a, Tensor? rot_b, int rot_kind, Tensor(a!) c_buf, "
      "Tensor(b!) r_buf, int used, int[] dims, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(weightstream, CPU, m) {
  m.impl("mla_decode", &mla_decode);
  m.impl("mlp_decode", &mlp_decode);
  m.impl("route_decode", &route_decode);
}
