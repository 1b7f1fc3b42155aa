"""Numeric-type expressions (`bf16 @accum(fp32)`, `mxfp4`, `fp8_e4m3 @scale(per_block(32))`), parsed with Lark.

`parse(text)` returns a frozen `NumericType` whose `str()` is the canonical text (modifiers in the
order accum, scale, loss_scale, one space apart), so `parse(str(t)) == t`. Mistakes raise
`NumericTypeError` carrying the 0-based offset inside `text`, which the spec layer turns into a
column inside the YAML value.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from pathlib import Path
from typing import Any, Literal

import lark

# name -> (bits per element, jax.numpy dtype name or None for block formats, kind).
# mxfp4 (OCP microscaling): 4-bit e2m1 elements plus one 8-bit shared scale per 32 → 4 + 8/32 bits.
BASE_TYPES: dict[str, tuple[float, str | None, str]] = {
    "fp32": (32, "float32", "float"),
    "bf16": (16, "bfloat16", "float"),
    "fp16": (16, "float16", "float"),
    "fp8_e4m3": (8, "float8_e4m3fn", "float"),
    "fp8_e5m2": (8, "float8_e5m2", "float"),
    "fp6_e2m3": (6, "float6_e2m3fn", "float"),
    "fp6_e3m2": (6, "float6_e3m2fn", "float"),
    "fp4_e2m1": (4, "float4_e2m1fn", "float"),
    "mxfp4": (4 + 8 / 32, None, "block"),
    "int8": (8, "int8", "int"),
    "fp64": (64, "float64", "float"),  # scientific models (L-BFGS to 1e-3): jax runs with jax_enable_x64
}
MX_BLOCK = 32  # elements sharing one scale in the microscaling formats
ACCUM_TYPES = ("fp32", "bf16", "fp16")  # types a matmul/reduction can accumulate in
MODIFIERS = ("accum", "scale", "loss_scale")  # also the canonical print order
SCALE_KINDS = ("per_tensor", "per_block", "delayed")
# delayed scaling (Transformer Engine's recipe): each fp8 product keeps an amax history of the last H steps per
# operand; `@scale(delayed)` is H = DELAYED_HISTORY, `@scale(delayed(H))` any 1 <= H <= MAX_DELAYED_HISTORY
DELAYED_HISTORY = 16
MAX_DELAYED_HISTORY = 65536
# fp8 bases a parameter may be held in with one fp32 scale per N×N block of its last two dims (DeepSeek-V3's
# weights): the IR names that storage `<base>_b<N>` (`fp8_e4m3_b128`), tessera/lower/reference/fp8_blocks.py
BLOCK_SCALED_FP8 = ("fp8_e4m3",)


class NumericTypeError(ValueError):
    """A malformed numeric-type expression; `offset`/`length` locate the mistake inside the text (0-based)."""

    def __init__(self, message: str, offset: int, length: int = 1, hint: str | None = None):
        super().__init__(message)
        self.message, self.offset, self.length, self.hint = message, offset, max(1, length), hint


@dataclasses.dataclass(frozen=True)
class Scale:
    """How a low-precision tensor is scaled: one scale per tensor, per block of `block` elements, or delayed (one
    scale per tensor from the max of an amax history of `history` steps)."""

    kind: Literal["per_tensor", "per_block", "delayed"]
    block: int | None = None  # elements per scale, for kind == "per_block"
    history: int | None = None  # steps of amax history, for kind == "delayed"; None: DELAYED_HISTORY

    def __post_init__(self):
        if self.kind == "delayed" and self.history == DELAYED_HISTORY:  # `delayed(16)` is `delayed`: one value
            object.__setattr__(self, "history", None)

    @property
    def history_length(self) -> int:
        """H of delayed scaling (the default when not written)."""
        return self.history if self.history is not None else DELAYED_HISTORY

    def __str__(self) -> str:
        if self.kind == "per_block":
            return f"per_block({self.block})"
        if self.kind == "delayed" and self.history is not None:
            return f"delayed({self.history})"
        return self.kind

    @property
    def explicit(self) -> str:
        """The scaling with every size written out (`delayed(16)` for `delayed`): what the IR and manifest record."""
        return f"delayed({self.history_length})" if self.kind == "delayed" else str(self)


@dataclasses.dataclass(frozen=True)
class NumericType:
    """A base element type plus optional accumulation type, scaling and loss scaling."""

    base: str
    accum: str | None = None
    scale: Scale | None = None
    loss_scale: float | Literal["dynamic"] | None = None

    def __str__(self) -> str:
        parts = [self.base]
        if self.accum is not None:
            parts.append(f"@accum({self.accum})")
        if self.scale is not None:
            parts.append(f"@scale({self.scale})")
        if self.loss_scale is not None:
            value = self.loss_scale if self.loss_scale == "dynamic" else repr(float(self.loss_scale))
            parts.append(f"@loss_scale({value})")
        return " ".join(parts)

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, block scales included (mxfp4 = 4.25, fp32 = 32)."""
        return BASE_TYPES[self.base][0]

    @property
    def is_block_format(self) -> bool:
        """True for microscaling formats that have no single jax.numpy dtype (mxfp4)."""
        return BASE_TYPES[self.base][1] is None

    @property
    def jnp_dtype(self) -> Any:
        """The jax.numpy dtype of one element, or None for block formats like mxfp4."""
        name = BASE_TYPES[self.base][1]
        if name is None:
            return None
        import jax.numpy as jnp  # imported here: parsing a spec must not pay for jax

        return jnp.dtype(getattr(jnp, name))

    @property
    def accum_dtype(self) -> Any:
        """The jax.numpy dtype to accumulate in: `@accum(T)` when given, else the element dtype."""
        return NumericType(self.accum).jnp_dtype if self.accum else self.jnp_dtype


def held_name(t: NumericType) -> str:
    """The IR element type a parameter of numeric type `t` is held as: its base, or `fp8_e4m3_b128` for
    `fp8_e4m3 @scale(per_block(128))` (one byte a weight plus an fp32 scale per 128×128 block)."""
    if t.base in BLOCK_SCALED_FP8 and t.scale is not None and t.scale.kind == "per_block":
        return f"{t.base}_b{t.scale.block}"
    return t.base


def block_scaled(dtype: str) -> tuple[str, int] | None:
    """(fp8 base, N) of a block-scaled IR element type such as `fp8_e4m3_b128`, else None."""
    base, sep, n = dtype.rpartition("_b")
    if sep and base in BLOCK_SCALED_FP8 and n.isdigit() and int(n) > 0:
        return base, int(n)
    return None


def block_scaled_bits(dtype: str) -> float:
    """Bits per element of a block-scaled fp8 type: 8, plus a 32-bit scale shared by N×N elements."""
    _, n = block_scaled(dtype)
    return 8 + 32 / (n * n)


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = (Path(__file__).parent / "numeric.lark").read_text()
    return lark.Lark(grammar, parser="lalr", maybe_placeholders=False)


def parse(text: str) -> NumericType:
    """Parse a numeric-type expression such as `bf16 @accum(fp32)`; raises NumericTypeError."""
    if not isinstance(text, str):
        raise NumericTypeError(f"expected a numeric type such as `bf16`, got `{text}`", 0)
    if not text.strip():
        raise NumericTypeError("empty numeric type; expected e.g. `fp32` or `bf16 @accum(fp32)`", 0)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as exc:
        raise _syntax_error(text, exc) from None
    name, *modifiers = tree.children
    fields: dict[str, Any] = {"base": _base_name(name)}
    for mod in modifiers:
        key_tok, arg = mod.children
        key = str(key_tok)
        if key not in MODIFIERS:
            raise NumericTypeError(f"unknown modifier `@{key}`; expected one of "
                                   + ", ".join(f"@{m}" for m in MODIFIERS),
                                   key_tok.start_pos - 1, len(key) + 1, _close(key, MODIFIERS, "@"))
        if key in fields:
            raise NumericTypeError(f"modifier `@{key}` given twice", key_tok.start_pos - 1, len(key) + 1)
        fields[key] = _MODIFIER_ARGS[key](arg)
    return NumericType(**fields)


def _syntax_error(text: str, exc: lark.exceptions.UnexpectedInput) -> NumericTypeError:
    pos = getattr(exc, "pos_in_stream", None)
    if isinstance(exc, lark.exceptions.UnexpectedToken) and exc.token.type == "$END":
        pos = len(text)
    if pos is None or pos < 0:
        pos = len(text)
    if pos >= len(text):
        return NumericTypeError("numeric type ends too early; expected e.g. `bf16 @accum(fp32)`", len(text))
    return NumericTypeError(f"unexpected `{text[pos]}` in numeric type; expected e.g. `bf16 @accum(fp32)`", pos)


def _close(word: str, choices: tuple[str, ...] | list[str], prefix: str = "") -> str | None:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean `{prefix}{match[0]}`?" if match else None


def _base_name(tok: lark.Token) -> str:
    name = str(tok)
    if name not in BASE_TYPES:
        raise NumericTypeError(f"unknown numeric type `{name}`; expected one of " + ", ".join(BASE_TYPES),
                               tok.start_pos, len(name), _close(name, list(BASE_TYPES)))
    return name


def _start(node: lark.Tree | lark.Token) -> tuple[int, int]:
    tok = node if isinstance(node, lark.Token) else next(node.scan_values(lambda v: isinstance(v, lark.Token)))
    return tok.start_pos, len(str(tok))


def _accum(arg: lark.Tree) -> str:
    offset, length = _start(arg)
    if arg.data != "word":
        raise NumericTypeError("@accum takes a type name, e.g. @accum(fp32)", offset, length)
    name = _base_name(arg.children[0])
    if name not in ACCUM_TYPES:
        raise NumericTypeError(f"cannot accumulate in `{name}`; use one of " + ", ".join(ACCUM_TYPES),
                               offset, length)
    return name


def _scale(arg: lark.Tree) -> Scale:
    offset, length = _start(arg)
    if arg.data == "call":
        name_tok, num = arg.children
        if str(name_tok) == "per_tensor":
            raise NumericTypeError("per_tensor takes no size (one scale per tensor, from its current amax)",
                                   offset, length, "write `per_tensor`, `per_block(N)` or `delayed(H)`")
        if str(name_tok) not in ("per_block", "delayed"):
            raise NumericTypeError(f"unknown scaling `{name_tok}(...)`; only per_block(N) and delayed(H) take a size",
                                   offset, length, _close(str(name_tok), SCALE_KINDS))
        if str(name_tok) == "delayed":
            if not str(num).isdigit() or not 1 <= int(num) <= MAX_DELAYED_HISTORY:
                raise NumericTypeError(f"amax history length must be an integer from 1 to {MAX_DELAYED_HISTORY}, "
                                       f"got `{num}`", num.start_pos, len(num),
                                       f"`delayed` alone keeps {DELAYED_HISTORY} steps")
            return Scale("delayed", history=int(num))
        if not str(num).isdigit() or int(num) < 1:
            raise NumericTypeError(f"block size must be a positive integer, got `{num}`", num.start_pos, len(num))
        return Scale("per_block", int(num))
    word = str(arg.children[0])
    if arg.data != "word" or word not in ("per_tensor", "delayed"):
        hint = "per_block takes a size, e.g. per_block(32)" if word == "per_block" else _close(word, SCALE_KINDS)
        raise NumericTypeError(f"unknown scaling `{word}`; expected per_tensor, per_block(N), delayed or delayed(H)",
                               offset, length, hint)
    return Scale(word)  # type: ignore[arg-type]


def _loss_scale(arg: lark.Tree) -> float | str:
    offset, length = _start(arg)
    if arg.data == "word" and str(arg.children[0]) == "dynamic":
        return "dynamic"
    if arg.data == "number":
        value = float(arg.children[0])
        if value > 0:
            return value
        raise NumericTypeError(f"loss scale must be positive, got `{arg.children[0]}`", offset, length)
    raise NumericTypeError("@loss_scale takes a positive number or `dynamic`", offset, length)


_MODIFIER_ARGS = {"accum": _accum, "scale": _scale, "loss_scale": _loss_scale}
