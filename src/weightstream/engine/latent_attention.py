"""DeepSeek's multi-head latent attention, absorbed: attention over the cached latent instead of keys and values
re-expanded from it at every step.

transformers' DeepSeek-V2/V3 attention caches the compressed latent `c` (kv_lora_rank) and the rotary key `r`
(qk_rope_head_dim) of each position, which is small, but then expands every cached position through `kv_b_proj`
into per-head keys and values before attending: context x heads x kv_lora x (nope + v) multiply-adds a layer per
token. Measured 2026-12-06 on the V2-Lite attention shape (16 heads, kv_lora 512): decode 0.63x llama.cpp at depth
256, 0.07x at 4096. Absorbed, as llama.cpp and DeepSeek's own inference code run it, a head's score is
`(q_nope k_b) . c + q_rot . r` and its output `v_b (sum_j p_j c_j)`: k_b and v_b multiply the query and the weighted
latent once a row, and the context costs heads x (2 kv_lora + rope) a position, some 120 times less at these sizes.

A forward of many query rows (a prompt) pays the absorbed form's wider dot products on every (query, key) pair;
the expanded form pays the expansion once a key. Per head the absorbed form costs (2 kv_lora + rope) a pair and the
expanded form (nope + rope + v) a pair plus kv_lora x (nope + v) a key, so the expanded form is cheaper from
`rows_to_expand` query rows on (171 for V2/V3's head sizes): such a forward expands from the latent and runs
torch's scaled_dot_product_attention, as transformers does.

The cache is untouched: transformers' layers still update it with the latent and the rotary key (bytes per token and
layer: (kv_lora_rank + qk_rope_head_dim) x the dtype, store/facts.py). The module's own projections, norms and rotary
embedding still run; only `expand_kv` (kept the latent as it is) and the attention function (this module's, through
a copy of the module's config naming it) are replaced. The absorbed form sums in another order than the expanded
one, so logits differ from transformers' within rounding (tests/test_latent_attention.py states the tolerance),
and where k_b and v_b are a GGUF's quantized blocks their products take 8-bit activations, as every native product
and llama.cpp's do (tests/test_gguf_import_families.py states that tolerance); a streamed run and the same model with
every expert resident run the same form and stay bitwise equal.
`load_streaming_model(..., latent_attention="expanded")` keeps transformers' form (bitwise its logits).

A decode step of one sequence in float32 (what a GGUF-imported model computes in) skips the module's forward
altogether (`LatentAttention.decode`): the same projections, norms, rotary function, cache update and native calls
on the same values, without the module's reshaping and copies around them (a concatenated query, float copies,
transposes: some 25 torch calls a layer, a 27-layer model pays them 27 times a token), so it gives the module
path's bits (tests/test_latent_attention.py). transformers' DeepSeek-V3 and V2 attention take it (`weightstream
import` makes a `deepseek2` GGUF scored by sigmoid a V3, by softmax, as DeepSeek-V2 and V2-Lite are, a V2), each
with its own rotary function; every other call runs the module's own forward.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from weightstream import native
from weightstream.engine.kernels.dense import NativeLinear
from weightstream.engine.kv_cache import widened
from weightstream.errors import WeightstreamError
from weightstream.store.facts import KV_B_HALVES, absorb_group, expand_group
from weightstream.store.facts import latent_rows_to_expand as rows_to_expand

FORMS = ("absorbed", "expanded")
LEAN_CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention")  # whose decode row `LatentAttention.decode` computes
IMPLEMENTATION = "weightstream_latent"


class SplitKvB(torch.nn.Module):
    """kv_b_proj as a GGUF stores it for absorbed attention and `weightstream import` keeps it: k_b, each head's
    kv_lora rows of nope inputs, and v_b, its v rows of kv_lora inputs, GGML blocks of the file's types (uint8
    (rows, row bytes), store/facts.py's KV_B_HALVES). The absorbed form multiplies by the blocks themselves; called
    as transformers' Linear (the expanded form), it computes with their decoded values, decoded at each call (a
    float copy would double what they hold resident)."""

    def __init__(self, k_b: torch.Tensor, k_type: str, v_b: torch.Tensor, v_type: str, module: torch.nn.Module):
        super().__init__()
        self.k_b, self.k_type, self.v_b, self.v_type = k_b, k_type, v_b, v_type
        self.heads, self.kv_lora = module.num_heads, module.kv_lora_rank
        self.nope, self.v = module.qk_nope_head_dim, module.v_head_dim

    def float_weight(self) -> torch.Tensor:
        """kv_b_proj's weight (H * (nope + v), kv_lora), float32: what the blocks encode."""
        return _joined_kv_b(self.k_b, self.k_type, self.v_b, self.v_type, self.heads, self.kv_lora, self.nope, self.v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.float_weight().to(x.dtype))


def _joined_kv_b(k_b, k_type: str, v_b, v_type: str, heads: int, kv_lora: int, nope: int, v: int) -> torch.Tensor:
    """kv_b_proj's weight (H * (nope + v), kv_lora), float32, from k_b's rows (H x kv_lora of nope) and v_b's (H x v
    of kv_lora), GGML blocks of their types: each head's k_b transposed (its nope rows), then its v rows."""
    k = native.dequantize(k_b, k_type, heads * kv_lora, nope).view(heads, kv_lora, nope).transpose(1, 2)
    values = native.dequantize(v_b, v_type, heads * v, kv_lora).view(heads, v, kv_lora)
    return torch.cat([k, values], dim=1).reshape(-1, kv_lora)


def keep_kv_b_apart(model: torch.nn.Module, state: dict, blocks: dict, model_dir: str) -> int:
    """Put the k_b/v_b blocks of a checkpoint that keeps them apart (`state`'s KV_B_HALVES keys, their GGML types
    in `blocks`) in place of each latent attention module's kv_b_proj (taken out of `state`); how many."""
    kept = 0
    for name, module in model.named_modules():
        keys = [f"{name}.{half}.weight" for half in KV_B_HALVES]
        if not is_latent_attention(module) or not any(k in state for k in keys):
            continue
        if not all(k in state and k in blocks for k in keys):
            raise WeightstreamError(
                f"{model_dir}: {name} has {' and '.join(k for k in keys if k in state)} but not both as GGML blocks "
                "listed in the manifest; the checkpoint is damaged: import it again"
            )
        heads, lora = module.num_heads, module.kv_lora_rank
        want = {keys[0]: (heads * lora, module.qk_nope_head_dim), keys[1]: (heads * module.v_head_dim, lora)}
        for key in keys:
            if tuple(blocks[key][1]) != want[key]:
                raise WeightstreamError(
                    f"{model_dir}: {key} is listed as {list(blocks[key][1])} (rows, inputs); {name} of config.json "
                    f"needs {list(want[key])}: the checkpoint and its config disagree; import it again"
                )
        (k_b, k_type), (v_b, v_type) = ((state.pop(k), blocks[k][0]) for k in keys)
        module.kv_b_proj = SplitKvB(k_b, k_type, v_b, v_type, module)
        kept += 1
    return kept


class LatentAttention:
    """One MLA module's absorbed attention: its kv_b_proj weight per head as k_b and v_b.

    k_b and v_b are rows of GGML blocks in llama.cpp's layout (k_b: each head's kv_lora x nope, v_b: its v x
    kv_lora), multiplied by the native kernels (`native.heads_product`, activations quantized to the type's
    activation blocks as in every native product) where they can be: the file's own blocks where the checkpoint
    keeps them apart (`SplitKvB`: Q5_0 and Q4_K in a Q4_K_M file, a third of bf16's bytes), or bf16 rows where kv_b's
    weights are bfloat16 values (as `weightstream import` joins float halves and bf16 checkpoints hold them) and the
    rows are whole 32-value blocks (float32 activations, each bf16 weight exact): decode reads them cold every layer
    (16 heads of kv_lora 512: 4 MiB a layer of float32, 0.7 ms of a 20 ms token at depth 256 on the V2-Lite shape).
    Else float32 views, multiplied by torch."""

    def __init__(self, module: torch.nn.Module):
        self.heads, self.kv_lora = module.num_heads, module.kv_lora_rank
        self.nope, self.rope, self.v = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
        proj = module.kv_b_proj
        if isinstance(proj, SplitKvB):
            self.k_rows, self.k_type, self.v_rows, self.v_type = proj.k_b, proj.k_type, proj.v_b, proj.v_type
        else:
            weight = _kv_b_weight(proj)  # (H * (nope + v), kv_lora) float32
            per_head = weight.view(self.heads, self.nope + self.v, self.kv_lora)
            self.k_rows, self.v_rows = _bf16_rows(per_head, self.nope)
            self.k_type = self.v_type = "BF16"
            if self.k_rows is None:
                self.weight = weight
                self.k_b = per_head[:, : self.nope]  # (H, nope, kv_lora): q_nope -> the latent space
                self.v_b = per_head[:, self.nope :].transpose(1, 2)  # (H, kv_lora, v): weighted latent -> values
        self.expand_from = rows_to_expand(self.kv_lora, self.nope, self.v)
        self.native_pairs: bool | None = None  # V2's rotary by the native op at a decode row (decided at the first)

    def _kv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight (H * (nope + v), kv_lora) in `dtype`, for the expanded form."""
        if self.k_rows is None:
            return self.weight.to(dtype)
        rows = (self.k_rows, self.k_type, self.v_rows, self.v_type)
        return _joined_kv_b(*rows, self.heads, self.kv_lora, self.nope, self.v).to(dtype)

    def _to_latent(self, by_head: torch.Tensor) -> torch.Tensor:
        """(H, M, kv_lora): each head's query rows (H, M, nope) times its k_b."""
        if self.k_rows is None:
            return torch.bmm(by_head, self.k_b)
        return native.heads_product(by_head, self.k_rows, self.k_type, self.kv_lora)

    def _to_values(self, by_head: torch.Tensor) -> torch.Tensor:
        """(H, M, v): each head's weighted latents (H, M, kv_lora) times its v_b."""
        if self.k_rows is None:
            return torch.bmm(by_head, self.v_b)
        return native.heads_product(by_head, self.v_rows, self.v_type, self.v)

    def decode(self, module, hidden_states, rotary_embedding, cache) -> torch.Tensor:
        """The attention output (1, 1, hidden) of one decode row of one sequence, float32: the module's forward
        (`_lean_forward` checks that it applies) with its views in place of its copies. `rotary_embedding`: what
        the model passes as position_embeddings (V3: (cos, sin); V2: complex frequencies)."""
        if module.q_lora_rank is None:
            query = module.q_proj(hidden_states)
        else:
            query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
        q_nope, q_rot = query.view(1, self.heads, 1, -1).split([self.nope, self.rope], dim=-1)  # (1, H, 1, N|R)
        latent, k_rot = module.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora, self.rope], dim=-1)
        latent = module.kv_a_layernorm(latent).view(1, 1, 1, self.kv_lora)
        q_rot, k_rot = self._rotate(module, q_rot, k_rot.view(1, 1, 1, self.rope), rotary_embedding)
        latent, k_rot = cache.update(latent, k_rot, module.layer_idx)
        q_lat = self._to_latent(q_nope.view(self.heads, 1, self.nope)).view(1, self.heads, self.kv_lora)
        weighted = native.latent_attend(
            q_lat, q_rot.view(1, self.heads, self.rope), latent[:, 0], k_rot[:, 0], module.scaling
        )
        out = self._to_values(weighted.view(self.heads, 1, self.kv_lora))  # (H, 1, V)
        return module.o_proj(out.view(1, 1, self.heads * self.v))

    def _rotate(self, module, q_rot, k_rot, rotary_embedding):
        """The module's rotary function (as its modeling module holds it: fused or not) on one decode row's query
        (1, H, 1, R) and key (1, 1, 1, R): V3's `apply_rotary_pos_emb` or its interleaved form, on (cos, sin); V2's
        `apply_rotary_emb` on complex frequencies, or the native op where it gives that function's bits on these
        layouts (`_pairs_prove`, once a module: torch multiplies complex floats in one of two roundings, chosen by
        the tensors' shapes and strides, which are the same at every decode row)."""
        modeling = sys.modules[type(module).__module__]
        if isinstance(rotary_embedding, torch.Tensor):
            if self.native_pairs is None:
                self.native_pairs = native.has("rope_pairs") and _pairs_prove(
                    modeling.apply_rotary_emb, q_rot, k_rot, rotary_embedding
                )
            if self.native_pairs and rotary_embedding.shape == (1, 1, self.rope // 2):
                return native.rope_pairs(q_rot, k_rot, torch.view_as_real(rotary_embedding))
            return modeling.apply_rotary_emb(q_rot, k_rot, rotary_embedding)
        interleaved = module.config.rope_interleave
        rotary = modeling.apply_rotary_pos_emb_interleave if interleaved else modeling.apply_rotary_pos_emb
        return rotary(q_rot, k_rot, *rotary_embedding)

    @staticmethod
    def keep_latent(latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """In place of the module's `expand_kv`: the attention function gets the cached latent itself."""
        return latent, k_rot

    def attend(self, query, latent, k_rot, mask, scaling: float) -> torch.Tensor:
        """(B, S, H, v) attention outputs of query (B, H, S, nope + rope) over latent (B, 1, T, kv_lora) and
        k_rot (B, 1, T, rope)."""
        if query.shape[2] >= self.expand_from:
            return self._expanded(query, latent, k_rot, mask, scaling)
        out = self._absorbed(query.float(), latent, k_rot, mask, scaling)
        return out.to(query.dtype)

    def _absorbed(self, query, latent, k_rot, mask, scaling: float) -> torch.Tensor:
        """In float32 whatever the model's dtype: bf16 would round the latent-space query and every score. The cache
        (`latent`, `k_rot`) as it is stored: the native pass widens a 16-bit or q8_0 one a block at a time (exactly),
        torch's form takes a float32 copy."""
        # B batch, H heads, S query rows, T cached positions, L kv_lora, N nope, R rope, V v_head_dim
        batch, heads, rows, _ = query.shape
        q_nope, q_rot = query.split([self.nope, self.rope], dim=-1)  # (B, H, S, N), (B, H, S, R)
        by_head = q_nope.transpose(0, 1).reshape(heads, batch * rows, self.nope)  # (H, B*S, N)
        q_lat = self._to_latent(by_head)  # (H, B*S, L)
        q_lat = q_lat.view(heads, batch, rows, self.kv_lora).transpose(0, 1).reshape(batch, heads * rows, -1)
        q_rot = q_rot.reshape(batch, heads * rows, self.rope)
        c, r = latent[:, 0], k_rot[:, 0]  # (B, T, L), (B, T, R)
        if rows == 1 and _sees_everything(mask) and native.available():
            weighted = native.latent_attend(q_lat, q_rot, c, r, scaling)  # one pass over the cache
        else:  # a group of heads at a time (store/facts.py `absorb_group`: the scores grow with the context)
            c, r = widened(c), widened(r)
            group, _ = absorb_group(heads, c.shape[1], rows)
            parts = []
            for h0 in range(0, heads, group):
                h = min(group, heads - h0)
                span = slice(h0 * rows, (h0 + h) * rows)  # these heads' query rows (head-major)
                rotary = torch.bmm(q_rot[:, span], r.transpose(1, 2))  # (B, h*S, T)
                scores = torch.baddbmm(rotary, q_lat[:, span], c.transpose(1, 2), beta=scaling, alpha=scaling)
                scores = _masked(scores.view(batch, h, rows, -1), mask)
                probs = torch.softmax(scores, dim=-1)
                parts.append(torch.bmm(probs.view(batch, h * rows, -1), c))  # (B, h*S, L)
                del rotary, scores, probs
            weighted = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B, H*S, L)
        by_head = weighted.view(batch, heads, rows, self.kv_lora).transpose(0, 1).reshape(heads, batch * rows, -1)
        out = self._to_values(by_head)  # (H, B*S, V)
        return out.view(heads, batch, rows, self.v).permute(1, 2, 0, 3).contiguous()  # (B, S, H, V)

    def _expanded(self, query, latent, k_rot, mask, scaling: float) -> torch.Tensor:
        """Keys and values re-made from the latent and attended by torch, a group of heads at a time (store/facts.py's
        `expand_group`: what a group holds grows with the context; all heads at once held 1.07 GiB at depth 16384 on
        V2-Lite's heads). Heads are independent: each head's keys, values and attention are its own whatever the
        group."""
        batch, _, positions, _ = latent.shape
        latent, k_rot = widened(latent).to(query.dtype), widened(k_rot).to(query.dtype)  # stored as --kv-dtype
        weight = self._kv_b(latent.dtype).view(self.heads, self.nope + self.v, self.kv_lora)
        rows, itemsize = query.shape[2], query.element_size()
        group, _ = expand_group(self.heads, positions, rows, self.nope, self.rope, self.v, itemsize)
        outs = []
        for h0 in range(0, self.heads, group):
            heads = min(group, self.heads - h0)
            kv = F.linear(latent, weight[h0 : h0 + heads].reshape(-1, self.kv_lora))  # (B, 1, T, h * (N + V))
            kv = kv.view(batch, positions, heads, self.nope + self.v).transpose(1, 2)
            k_nope, values = kv.split([self.nope, self.v], dim=-1)
            keys = torch.cat([k_nope, k_rot.expand(-1, heads, -1, -1)], dim=-1)
            part = query[:, h0 : h0 + heads]
            out, _ = sdpa_attention_forward(_CAUSAL, part, keys, values, mask, dropout=0.0, scaling=scaling)
            outs.append(out)  # (B, S, h, V)
            del kv, k_nope, values, keys
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class _Causal(torch.nn.Module):
    """What sdpa_attention_forward reads of the module it is given: causal attention, one key head a head."""

    is_causal, num_key_value_groups = True, 1


_CAUSAL = _Causal()


def _sees_everything(mask: torch.Tensor | None) -> bool:
    """Whether a one-row query's mask hides no cached position (none given, or all attend / all zero)."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype is torch.bool else not bool(mask.any())


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scores (B, H, S, T) with transformers' attention mask applied: boolean (True: attend), additive, or None
    (causal, the last query row at the last position: what transformers passes when no mask is needed)."""
    if mask is not None:
        mask = mask[..., : scores.shape[-1]]
        return scores.masked_fill(~mask, float("-inf")) if mask.dtype is torch.bool else scores + mask
    rows, positions = scores.shape[-2:]
    if rows == 1:
        return scores
    hidden = torch.ones(rows, positions, dtype=torch.bool).triu(positions - rows + 1)
    return scores.masked_fill(hidden, float("-inf"))


def _kv_b_weight(projection: torch.nn.Module) -> torch.Tensor:
    """kv_b_proj's weight in float32: a float32 Linear's own (no copy), a bf16 one's converted (exactly), GGML
    blocks dequantized once (what the file's blocks encode)."""
    if isinstance(projection, SplitKvB):
        return projection.float_weight()
    if isinstance(projection, NativeLinear):
        n, k = projection.out_features, projection.in_features
        return native.dequantize(projection.blocks, projection.wtype, n, k)
    if isinstance(projection, torch.nn.Linear) and projection.bias is None:
        return projection.weight.detach().float()
    raise WeightstreamError(
        f"latent attention: kv_b_proj is a {type(projection).__name__}, not a Linear without bias; run with "
        "--latent-attention expanded"
    )


def _bf16_rows(per_head: torch.Tensor, nope: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """k_b as each head's (kv_lora, nope) rows and v_b as its (v, kv_lora) rows, the bytes of bf16 blocks, where
    every weight of kv_b (H, nope + v, kv_lora) is a bfloat16 value and both row widths are whole 32-value blocks
    (and the native kernels are here); else (None, None)."""
    kv_lora = per_head.shape[2]
    if not native.available() or nope % 32 or kv_lora % 32:
        return None, None
    as_bf16 = per_head.to(torch.bfloat16)
    if not torch.equal(as_bf16.float(), per_head):  # float32 weights: kept as they are
        return None, None
    k_rows = as_bf16[:, :nope].transpose(1, 2).contiguous()  # (H, kv_lora, nope)
    v_rows = as_bf16[:, nope:].contiguous()  # (H, v, kv_lora)
    return k_rows.reshape(-1).view(torch.uint8), v_rows.reshape(-1).view(torch.uint8)


def _forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function the absorbed modules' configs name (`key`/`value`: the latent and the rotary key)."""
    return module._ws_latent.attend(query, key, value, attention_mask, scaling), None


AttentionInterface.register(IMPLEMENTATION, _forward)


def _lean_forward(module: torch.nn.Module):
    """The module's forward, taking `LatentAttention.decode` for one float32 row of one sequence that sees every
    cached position (in a model out of training mode, natively); anything else runs the module's own forward."""
    original, latent = module.forward, module._ws_latent

    def forward(*args, **kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        rotary = kwargs.get("position_embeddings")
        if (
            hidden.shape[:2] == (1, 1)
            and hidden.dtype is torch.float32
            and cache is not None
            and rotary is not None
            and not args[1:]
            and _sees_everything(kwargs.get("attention_mask"))
            and not module.training
        ):
            return latent.decode(module, hidden, rotary, cache), None
        return original(*args, **kwargs)

    return forward


def is_latent_attention(module: torch.nn.Module) -> bool:
    """Whether a module is transformers' multi-head latent attention (DeepSeek-V2/V3 and their kin)."""
    needed = ("kv_b_proj", "kv_a_proj_with_mqa", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_heads")
    return all(hasattr(module, name) for name in needed) and callable(getattr(type(module), "expand_kv", None))


def check_form(form: str) -> None:
    """Refuses a form of latent attention other than FORMS."""
    if form not in FORMS:
        raise WeightstreamError(f"--latent-attention {form!r}: choose one of {', '.join(FORMS)}")


def absorb_latent_attention(model: torch.nn.Module, form: str = "absorbed") -> int:
    """Put the absorbed form in the model's latent attention modules (form "absorbed"; "expanded" leaves them as
    transformers made them); how many modules were changed. Their kv_b_proj goes: the LatentAttention holds its
    weight (a GGUF's blocks kept apart, bf16 rows, or float32)."""
    check_form(form)
    if form == "expanded":
        return 0
    changed = 0
    for module in model.modules():
        if not is_latent_attention(module) or hasattr(module, "_ws_latent"):
            continue
        module._ws_latent = LatentAttention(module)
        module.kv_b_proj = None  # its weight lives in _ws_latent, read by both forms
        module.expand_kv = module._ws_latent.keep_latent
        module.config = copy.copy(module.config)
        module.config._attn_implementation_internal = IMPLEMENTATION
        if type(module).__name__ in LEAN_CLASSES and native.available():
            module.forward = _lean_forward(module)
        changed += 1
    return changed


def _pairs_prove(fn, q_rot: torch.Tensor, k_rot: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `native.rope_pairs` gives `fn`'s bits (DeepSeek-V2's apply_rotary_emb) on random values laid out as
    `q_rot`, `k_rot` and `freqs` are (the same shapes and strides, other values)."""
    gen = torch.Generator().manual_seed(0)

    def like(t: torch.Tensor) -> torch.Tensor:
        base = torch.randn(t.untyped_storage().nbytes() // 4, generator=gen)
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    for _ in range(3):
        q, k = like(q_rot), like(k_rot)
        f = torch.polar(torch.rand(freqs.shape, generator=gen) + 0.5, torch.randn(freqs.shape, generator=gen))
        with torch.no_grad():
            want = fn(q, k, f)
        got = native.rope_pairs(q, k, torch.view_as_real(f))
        if not all(w.shape == g.shape and torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return False
    return True
