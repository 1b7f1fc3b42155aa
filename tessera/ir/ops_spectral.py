"""Spectral ops: Fourier transforms over named dims, complex numbers, and keeping the low modes.

    f = rfft(x, over = [space], to = [freq])            # f32 [batch, space=64] -> c64 [batch, freq=33]
    k = modes(f, dim = freq, keep = 16, to = kmodes)     # the first 16 modes:  c64 [batch, kmodes=16]
    y = irfft(k, over = [kmodes], to = [space = 64])     # zero modes above 16: f32 [batch, space=64]

A transform renames the dims it runs over (`to`), since their sizes change (a real transform of n points
has n // 2 + 1 modes along its last dim). Transforms need f32 or f64 (c64 or c128 for complex ones): XLA
has no half-precision FFT, so a bf16 policy must give these ops f32 (a numerics rule), which `tessera check`
says. `norm` is numpy's: "backward" (1 on the forward transform, 1/n on the inverse), "ortho", "forward".
Complex element types then flow through `add`, `mul`, `dot` (mode mixing: a complex weight built with
`complex(re, im)` from two real params) and back out with `real`/`imag`.

FLOPs: 5 n log2 n per complex transform of n points (n the product of the transformed sizes), half that
for a real one; a complex `dot` counts its 4 real products per complex one (tessera/ir/ops_core.py).
Sharding: a transform needs its dims whole on each device; `tessera check` refuses a mesh that splits one
(tessera/ir/check.py, `check_spectral_dims`).

With parameters: `spectral_conv` (a Fourier neural operator's spectral layer) and `spectral_moe`, its mixture of
experts: the mode weights are `experts` sets, and the `moe` op's routing (top-k of the router's logits, then a
softmax over the k) picks k of them for each band of a sample's modes, from the band's power.
"""

from __future__ import annotations

import math

from tessera.ir.ops_core import need_dim, same_size
from tessera.ir.registry import AttrDef, OpDef, OpError, ParamDecl, register
from tessera.ir.types import Dim, DimName, Init, TensorType, is_float

REAL_OF = {"c64": "f32", "c128": "f64"}
COMPLEX_OF = {v: k for k, v in REAL_OF.items()}
NORMS = ("backward", "ortho", "forward")

# a real dtype -> why it cannot be transformed (bf16, f16, fp8 ...)
_NO_FFT = "XLA has no FFT in {dtype}: give this op f32 (a numerics rule for its path, or `default: fp32`)"


def is_complex(dtype: str) -> bool:
    return dtype in REAL_OF


def _norm(attrs) -> None:
    if attrs["norm"] not in NORMS:
        raise OpError(f"norm must be one of {', '.join(repr(n) for n in NORMS)}, got {attrs['norm']!r}")


def _operand(ins, attrs, complex_: bool, hint: str = "") -> TensorType:
    """The transformed operand, checked: numpy's norm, and a complex (c64, c128) or a real (f32, f64) type."""
    x = ins[0]
    _norm(attrs)
    if complex_ and not is_complex(x.dtype):
        raise OpError(f"operand must be complex (c64 or c128), got {x}{hint}")
    if not complex_ and x.dtype not in COMPLEX_OF:
        raise OpError(f"operand must be f32 or f64, got {x}: " + _NO_FFT.format(dtype=x.dtype))
    return x


def _over(x: TensorType, attrs) -> tuple[list[Dim], list]:
    over = [need_dim(x, d.name) for d in attrs["over"]]
    if not 1 <= len(over) <= 2:
        raise OpError(f"`over` names 1 or 2 dimensions (1-D or 2-D transforms), got {len(over)}")
    if len({d.name for d in over}) != len(over):
        raise OpError("`over` names a dimension twice")
    to = list(attrs["to"]) if attrs.get("to") is not None else [None] * len(over)
    if len(to) != len(over):
        raise OpError(f"`to` names {len(to)} dimension(s) for the {len(over)} in `over`")
    for t, d in zip(to, over):
        name = t.name if t is not None else d.name
        if name != d.name and x.dim(name) is not None:
            raise OpError(f"`to` names `{name}`, which the operand {x} already has")
    return over, to


def _replace(x: TensorType, old: list[Dim], new: list[Dim], dtype: str) -> TensorType:
    swap = dict(zip((d.name for d in old), new))
    return TensorType(dtype, tuple(swap.get(d.name, d) for d in x.dims))


def _fft_rule(ins, attrs):
    x = _operand(ins, attrs, True, "; `rfft` transforms real input")
    over, to = _over(x, attrs)
    new = [Dim(t.name if t is not None else d.name, d.size) for t, d in zip(to, over)]
    return [_replace(x, over, new, x.dtype)]


def _rfft_rule(ins, attrs):
    x = _operand(ins, attrs, False)
    over, to = _over(x, attrs)
    sizes = [d.size for d in over[:-1]] + [None if over[-1].size is None else over[-1].size // 2 + 1]
    new = [Dim(t.name if t is not None else d.name, n) for t, d, n in zip(to, over, sizes)]
    return [_replace(x, over, new, COMPLEX_OF[x.dtype])]


def _irfft_rule(ins, attrs):
    x = _operand(ins, attrs, True)
    over, to = _over(x, attrs)
    if any(t is None for t in to):
        raise OpError("`to` gives the real output's sized dims, e.g. `to = [space = 64]`")
    for t, d in list(zip(to, over))[:-1]:
        same_size(Dim(t.name, t.size), Dim(t.name, d.size), "modes and points of a dim the real transform "
                  "keeps whole")
    last, n = over[-1], to[-1].size
    if last.size is not None and last.size > n // 2 + 1:
        raise OpError(f"{last.size} modes along `{last.name}` are more than {n} real points hold "
                      f"({n // 2 + 1}); use to = [{to[-1].name} = {2 * (last.size - 1)}] or more")
    return [_replace(x, over, list(to), REAL_OF[x.dtype])]


def _transform_flops(kind: str):
    """5 n log2 n per complex transform of n points, half for a real one (rfft, irfft); n is the product of
    the transformed dims' sizes on the real side, and the batch of transforms is every other position."""
    def flops(ins, outs, attrs):
        points = outs[0] if kind == "irfft" else ins[0]
        dims = attrs["to"] if kind == "irfft" else [points.dim(d.name) for d in attrs["over"]]
        n = math.prod(d.size for d in dims)
        count = math.prod(d.size for d in points.dims) / n
        return count * (5.0 * n * math.log2(n) if n > 1 else 0.0) * (0.5 if kind in ("rfft", "irfft") else 1.0)

    return flops


def _transformed(attrs) -> tuple[str, ...]:
    """A transform needs every point of the dims it runs over (and makes its `to` dims whole)."""
    return tuple(d.name for d in attrs["over"]) + tuple(d.name for d in (attrs.get("to") or ()) if d is not None)


_TRANSFORM_ATTRS = (AttrDef("over", "dims"), AttrDef("norm", "str", "backward"))
for _name, _doc in [("fft", "numpy.fft.fftn over `over`"), ("ifft", "numpy.fft.ifftn over `over`")]:
    register(OpDef(_name, (1, 1), _TRANSFORM_ATTRS + (AttrDef("to", "dims?", None),), _fft_rule,
                   flops=_transform_flops("fft"), whole_dims=_transformed,
                   doc=f"{_doc} (complex -> complex; `to` renames the dims, sizes kept)"))
register(OpDef("rfft", (1, 1), _TRANSFORM_ATTRS + (AttrDef("to", "dims?", None),), _rfft_rule,
               flops=_transform_flops("rfft"), whole_dims=_transformed,
               doc="numpy.fft.rfftn over `over` (f32 -> c64, f64 -> c128; the last dim's n points give "
                   "n // 2 + 1 modes); `to` renames the dims"))
register(OpDef("irfft", (1, 1), _TRANSFORM_ATTRS + (AttrDef("to", "shape"),), _irfft_rule,
               flops=_transform_flops("irfft"), whole_dims=_transformed,
               doc="numpy.fft.irfftn over `over` to the real sized dims `to` (modes beyond the input are zero)"))


def _modes_rule(ins, attrs):
    x = ins[0]
    d = need_dim(x, attrs["dim"].name)
    keep, to = attrs["keep"], attrs["to"].name
    if keep < 1 or (d.size is not None and keep > d.size):
        raise OpError(f"keep = {keep} modes of the {d.size} along `{d.name}`: keep 1 to {d.size}")
    if to != d.name and x.dim(to) is not None:
        raise OpError(f"`to` names `{to}`, which the operand {x} already has")
    return [_replace(x, [d], [Dim(to, keep)], x.dtype)]


register(OpDef("modes", (1, 1), (AttrDef("dim", "dim"), AttrDef("keep", "int"), AttrDef("to", "dim")), _modes_rule,
               whole_dims=lambda a: (a["dim"].name, a["to"].name),
               doc="the first `keep` entries along `dim` (the low modes of a transform), renamed `to`"))


def _part_rule(ins, attrs):
    x = ins[0]
    if not is_complex(x.dtype):
        raise OpError(f"operand must be complex (c64 or c128), got {x}")
    return [x.with_dtype(REAL_OF[x.dtype])]


register(OpDef("real", (1, 1), (), _part_rule, doc="the real part"))
register(OpDef("imag", (1, 1), (), _part_rule, doc="the imaginary part"))


def _complex_rule(ins, attrs):
    re, im = ins
    if re.dtype not in COMPLEX_OF or im.dtype != re.dtype:
        raise OpError(f"real and imaginary parts must both be f32 or both f64, got {re} and {im}")
    if re.names != im.names:
        raise OpError(f"real and imaginary parts must have the same dims, got {re} and {im}")
    for a, b in zip(re.dims, im.dims):
        same_size(a, b, "parts")
    return [re.with_dtype(COMPLEX_OF[re.dtype])]


register(OpDef("complex", (2, 2), (), _complex_rule, flops=lambda i, o, a: 0.0,
               doc="re + i * im from two real tensors of the same dims"))


# ---- a spectral convolution with weights -------------------------------------------------------------------

def _spectral_conv_rule(ins, attrs):
    x = ins[0]
    if x.dtype not in COMPLEX_OF:
        raise OpError(f"operand must be f32 or f64, got {x}: " + _NO_FFT.format(dtype=x.dtype))
    over, channels = need_dim(x, attrs["over"].name), need_dim(x, attrs["channels"].name)
    if over.name == channels.name:
        raise OpError(f"`over` and `channels` must be different dims, both are `{over.name}`")
    if channels.size is None:
        raise OpError(f"the channels dim `{channels.name}` needs a size")
    k = attrs["modes"]
    if k < 1 or (over.size is not None and k > over.size // 2 + 1):
        raise OpError(f"modes = {k}: {over.size} points along `{over.name}` hold 1 to {over.size // 2 + 1} modes")
    return [x]


def _spectral_conv_params(a, types):
    x = types[0]
    c = x.dim(a["channels"].name)
    dims = (Dim("modes", a["modes"]), c, Dim(f"{c.name}_out", c.size))
    init = Init("normal", (2.0 * c.size) ** -0.5)  # a mode's mixed output on its input's scale
    return [ParamDecl("w_re", dims, init), ParamDecl("w_im", dims, init)]


def _spectral_conv_flops(ins, outs, attrs):
    x = ins[0]
    n, c, k = x.dim(attrs["over"].name).size, x.dim(attrs["channels"].name).size, attrs["modes"]
    lines = math.prod(d.size for d in x.dims) / n  # transforms: every position off the transformed dim
    transforms = 2 * lines * 0.5 * 5.0 * n * math.log2(n)  # rfft in, irfft out
    mixing = 8.0 * (lines / c) * k * c * c  # a complex multiply-add is 8 real FLOPs
    return transforms + mixing


register(OpDef("spectral_conv", (1, 1), (AttrDef("over", "dim"), AttrDef("modes", "int"),
                                         AttrDef("channels", "dim", DimName("width"))),
               _spectral_conv_rule, params=_spectral_conv_params, flops=_spectral_conv_flops, contraction=True,
               whole_dims=lambda a: (a["over"].name,),
               doc="irfft(modes(rfft(x over `over`), first `modes`) mixed over `channels` by the complex weight "
                   "w_re + i w_im [modes, channels, channels_out]): a Fourier neural operator's spectral layer"))


# ---- a mixture of spectral experts ---------------------------------------------------------------------------

def _spectral_moe_rule(ins, attrs):
    _spectral_conv_rule(ins, attrs)
    e, k, m, bands = attrs["experts"], attrs["top_k"], attrs["modes"], attrs["bands"]
    if not 0 < k <= e:
        raise OpError(f"top_k ({k}) must be between 1 and experts ({e})")
    if bands < 1 or m % bands:
        divisors = [d for d in range(1, m + 1) if m % d == 0]
        raise OpError(f"bands = {bands} must divide modes = {m} (bands of equal width): use one of "
                      f"{', '.join(map(str, divisors))}")
    return [ins[0]]


def _spectral_moe_params(a, types):
    c, experts = types[0].dim(a["channels"].name), Dim("experts", a["experts"])
    dims = (experts, Dim("modes", a["modes"]), c, Dim(f"{c.name}_out", c.size))
    init = Init("normal", (2.0 * c.size) ** -0.5)  # as spectral_conv's: each expert alone keeps the scale
    # the router reads log powers (unit-scale differences): logits of unit scale, not moe's 0.02 for wide inputs
    decls = [ParamDecl("router", (c, experts), Init("normal", c.size ** -0.5))]
    if a["bias"]:
        decls.append(ParamDecl("router_bias", (experts,), Init("zeros")))
    return decls + [ParamDecl("experts/w_re", dims, init), ParamDecl("experts/w_im", dims, init)]


def _spectral_moe_flops(ins, outs, attrs):
    """The transforms (as spectral_conv's), the band powers and the router, and top_k experts' mode mixing."""
    x = ins[0]
    n, c, m = x.dim(attrs["over"].name).size, x.dim(attrs["channels"].name).size, attrs["modes"]
    samples = math.prod(d.size for d in x.dims) / (n * c)
    transforms = 2 * samples * c * 0.5 * 5.0 * n * math.log2(n)
    router = samples * (4.0 * m * c + 2.0 * attrs["bands"] * c * attrs["experts"])
    return transforms + router + attrs["top_k"] * 8.0 * samples * m * c * c


def _spectral_moe_active(attrs: dict, name: str | None) -> float:
    """A sample reads top_k of the experts in each band (top_k / experts of their weights) and the whole router."""
    return attrs["top_k"] / attrs["experts"] if name and name.startswith("experts/") else 1.0


register(OpDef("spectral_moe", (1, 1), (AttrDef("over", "dim"), AttrDef("modes", "int"),
                                        AttrDef("channels", "dim", DimName("width")), AttrDef("experts", "int"),
                                        AttrDef("top_k", "int"), AttrDef("bands", "int", 1),
                                        AttrDef("bias", "bool", True)),
               _spectral_moe_rule, params=_spectral_moe_params, flops=_spectral_moe_flops, contraction=True,
               active_fraction=_spectral_moe_active, whole_dims=lambda a: (a["over"].name,),
               doc="spectral_conv with `experts` sets of mode weights experts/w_re + i experts/w_im [experts, modes, "
                   "channels, channels_out], routed per band of modes as `moe` routes a token: the `modes` lowest "
                   "modes of each sample split into `bands` bands of equal width; a band's router input is the log "
                   "of its mean power per channel, logits = input @ router + router_bias, the top_k logits "
                   "softmaxed among themselves; the band's modes are mixed by sum_k weight_k * expert_k's weights "
                   "for those modes (bands = 1: one routing per sample)"))
