"""One native call where transformers runs a chain of small ops, for a model that computes in float32.

A checkpoint whose dense weights are GGML blocks computes in float32 (`QuantFormat.compute_dtype`), and its products
are native calls. Between them, each decoder layer runs transformers' RMSNorm modules (8 torch ops each, up to four
a layer) and its rotary embedding (about 16 ops for q and k): at batch 1, most of a token's operator calls and a
share of its time that the arithmetic does not explain. `fuse_dense_ops` puts one native op in their place
(csrc/layers.cpp), each only where it is proven on the model's own code at load:

- an RMSNorm module (a class named ...RMSNorm with a 1-d weight and an epsilon) becomes `NativeRMSNorm` when the
  native op gives its output to within float32 rounding of the scale (`NORM_TOLERANCE`: the squares are summed in
  another order than torch's) on random rows; Gemma-style `(1 + weight)` norms and other forms fail and stay;
- a modeling module's `apply_rotary_pos_emb` is replaced, in that module, by `NativeRotary` when the native op
  equals it bitwise on random inputs; for any call the op does not cover (other dtypes, `unsqueeze_dim`, shapes)
  it calls the original. `apply_rotary_pos_emb_interleave` (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash: pairs of even and
  odd elements; some 20 torch ops for q and k a layer) likewise, by the native op's interleaved form.

The rotary replacement holds for the whole process, not for the one model: transformers' attention looks
`apply_rotary_pos_emb` up in its modeling module's globals at every call, so the only ways to scope it to a model
would be a copy of each architecture's attention forward, or a flag set and cleared around every forward of the
fused model (and left wrong by a forward that raises). Neither is needed: the replacement is proven bitwise equal
to the function it replaces and hands every call it does not cover to that function, so every other model in the
process, a bf16 one or one loaded with `fuse=False`, computes the same bits as before; only its speed can differ.
`use_native_ops(model, False)` puts transformers' function back (for every model, likewise).

A streamed run and the same model with every expert resident both run these ops, so they stay bitwise equal.
bf16 checkpoints are left as they are (their eager-exact path). `use_native_ops` switches a fused model's ops off
and on again, to time them against transformers' own in one process (benchmarks/kernel_bench.py steps).
"""

from __future__ import annotations

import sys
import weakref

import torch

from weightstream import native

NORM_TOLERANCE = 1e-5  # relative to the output's largest magnitude: a few float32 ulps of the scale
# model -> what `fuse_dense_ops` put in it: ([(parent module, attribute, NativeRMSNorm)], [(modeling module,
# function name, NativeRotary)]), for `use_native_ops`
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class NativeRMSNorm(torch.nn.Module):
    """An RMSNorm computed by one native call (float32); any other input runs the module it replaces."""

    def __init__(self, norm: torch.nn.Module, eps: float):
        super().__init__()
        self.weight, self.eps = norm.weight, eps
        self.replaced = [norm]  # a list, so the module is kept (for other dtypes) but not registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and self.weight.dtype is torch.float32:
            return native.rms_norm(x, self.weight, self.eps)
        return self.replaced[0](x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, native"


# a modeling module's rotary functions the native op may stand for -> whether it is the interleaved form
ROTARY_FUNCTIONS = {"apply_rotary_pos_emb": False, "apply_rotary_pos_emb_interleave": True}


class NativeRotary:
    """A modeling module's rotary function (`ROTARY_FUNCTIONS`), by the native op where it covers the call, else
    the original."""

    def __init__(self, original, interleaved: bool = False):
        self.original, self.interleaved = original, interleaved

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        if args or kwargs or not _rope_covers(q, k, cos, sin):
            return self.original(q, k, cos, sin, *args, **kwargs)
        return native.rope(q, k, cos, sin, self.interleaved)


def _rope_covers(q, k, cos, sin) -> bool:
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) and t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    return all(
        t.shape[3] % 2 == 0 and t.shape[2:] == cos.shape[1:] and cos.shape[0] in (1, t.shape[0]) and t.stride(3) == 1
        for t in (q, k)
    )


def fuse_dense_ops(model: torch.nn.Module) -> list[str]:
    """Put the native ops in place of the model's RMSNorm modules and rotary function where they prove equal; what
    was fused, as `ClassName` / `module.apply_rotary_pos_emb` (for the run's report)."""
    if not native.available():
        return []
    fused: set[str] = set()
    norms, rotaries = [], []
    for name, module in list(model.named_modules()):
        eps = _norm_eps(module)
        if eps is not None and _norm_proves(module, eps):
            parent, _, attr = name.rpartition(".")
            norms.append((model.get_submodule(parent), attr, NativeRMSNorm(module, eps)))
            setattr(*norms[-1])
            fused.add(type(module).__name__)
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        modeling = sys.modules.get(module_name)
        for name, interleaved in ROTARY_FUNCTIONS.items():
            original = getattr(modeling, name, None)
            if not isinstance(original, NativeRotary):  # another model of this architecture replaced it already
                if not (callable(original) and _rope_proves(original, interleaved)):
                    continue
                setattr(modeling, name, NativeRotary(original, interleaved))
            rotaries.append((modeling, name, getattr(modeling, name)))
            fused.add(f"{module_name.rsplit('.', 1)[-1]}.{name}")
    _FUSED[model] = (norms, rotaries)
    return sorted(fused)


def use_native_ops(model: torch.nn.Module, on: bool) -> int:
    """Switch the ops `fuse_dense_ops` put in `model` off (transformers' own RMSNorm modules back in their places
    and its rotary function back in its modeling modules, for every model in the process) or on again; the number
    of norm modules switched (0: none of `model`'s were fused)."""
    norms, rotaries = _FUSED.get(model, ((), ()))
    for parent, attr, norm in norms:
        setattr(parent, attr, norm if on else norm.replaced[0])
    for modeling, name, rotary in rotaries:
        setattr(modeling, name, rotary if on else rotary.original)
    return len(norms)


def _norm_eps(module: torch.nn.Module) -> float | None:
    """The epsilon of a module that looks like an RMSNorm (its proof decides), else None."""
    if not type(module).__name__.endswith("RMSNorm") or list(module.children()):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.dtype is not torch.float32:
        return None
    return float(eps) if isinstance(eps, float | int) else None


def _norm_proves(module: torch.nn.Module, eps: float) -> bool:
    """Whether the native op gives the module's output on random rows (scales 1e-3 to 1e3), to NORM_TOLERANCE."""
    gen = torch.Generator().manual_seed(0)
    width = module.weight.shape[0]
    rows = torch.randn(4, width, generator=gen) * torch.tensor([[1e-3], [1.0], [30.0], [1e3]])
    try:
        with torch.no_grad():
            want = module(rows)
            got = native.rms_norm(rows, module.weight, eps)
    except Exception:  # a forward with other arguments or shapes: not this form
        return False
    if want.shape != got.shape or want.dtype is not torch.float32:
        return False
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return bool(((want - got).abs() / scale).max() <= NORM_TOLERANCE)


def _rope_proves(fn, interleaved: bool = False) -> bool:
    """Whether the native op (its interleaved form if `interleaved`) equals `fn(q, k, cos, sin)` bitwise, on the
    layouts attention passes (q and k viewed (B, S, H, D) and transposed; GQA's fewer key heads; a batch-1 cos)."""
    gen = torch.Generator().manual_seed(0)
    cases = ((1, 4, 2, 3, 16, 1), (2, 2, 2, 5, 8, 2), (1, 3, 3, 1, 32, 1))
    for batch, heads, kv_heads, seq, dim, cos_batch in cases:
        q = torch.randn(batch, seq, heads, dim, generator=gen).transpose(1, 2)
        k = torch.randn(batch, seq, kv_heads, dim, generator=gen).transpose(1, 2)
        cos, sin = torch.randn(2, cos_batch, seq, dim, generator=gen)
        try:
            with torch.no_grad():
                want = fn(q, k, cos, sin)
        except Exception:  # another signature or layout: not the standard function
            return False
        got = native.rope(q, k, cos, sin, interleaved)
        if not (isinstance(want, tuple) and len(want) == 2):
            return False
        if not all(w.shape == g.shape and torch.equal(w, g) for w, g in zip(want, got, strict=True)):
            return False
    return True
