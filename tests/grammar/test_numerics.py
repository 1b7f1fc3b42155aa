"""Numeric-type expressions: parsing, canonical printing, dtype helpers, and errors at the right column."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.grammar.numerics import BASE_TYPES, NumericType, NumericTypeError, Scale, parse


@pytest.mark.parametrize("text, expected", [
    ("fp32", NumericType("fp32")),
    ("bf16 @accum(fp32)", NumericType("bf16", accum="fp32")),
    ("mxfp4", NumericType("mxfp4")),
    ("fp8_e4m3 @accum(fp32) @scale(per_block(32))", NumericType("fp8_e4m3", "fp32", Scale("per_block", 32))),
    ("fp8_e5m2 @scale(delayed)", NumericType("fp8_e5m2", scale=Scale("delayed"))),
    ("fp8_e4m3 @scale(delayed(1024))", NumericType("fp8_e4m3", scale=Scale("delayed", history=1024))),
    ("int8 @scale(per_tensor)", NumericType("int8", scale=Scale("per_tensor"))),
    ("fp16 @loss_scale(dynamic)", NumericType("fp16", loss_scale="dynamic")),
    ("fp16 @loss_scale(128.0)", NumericType("fp16", loss_scale=128.0)),
])
def test_parse_canonical(text: str, expected: NumericType) -> None:
    assert parse(text) == expected
    assert str(parse(text)) == text


def test_delayed_history_length() -> None:
    assert parse("fp8_e4m3 @scale(delayed)").scale.history_length == 16
    assert parse("fp8_e4m3 @scale(delayed(16))") == parse("fp8_e4m3 @scale(delayed)")  # the default, printed bare
    assert str(parse("fp8_e4m3 @scale( delayed( 16 ) )")) == "fp8_e4m3 @scale(delayed)"
    assert parse("fp8_e4m3 @scale(delayed(1))").scale.explicit == "delayed(1)"
    assert parse("fp8_e4m3 @scale(delayed)").scale.explicit == "delayed(16)"


def test_non_canonical_text_prints_canonically() -> None:
    t = parse("  fp8_e4m3   @scale( per_block(16) )@accum(bf16) @loss_scale(1024) ")
    assert str(t) == "fp8_e4m3 @accum(bf16) @scale(per_block(16)) @loss_scale(1024.0)"
    assert t.scale is not None and t.scale.block == 16 and t.loss_scale == 1024.0


@pytest.mark.parametrize("name, bits, dtype", [
    ("fp32", 32, jnp.float32), ("bf16", 16, jnp.bfloat16), ("fp16", 16, jnp.float16),
    ("fp8_e4m3", 8, jnp.float8_e4m3fn), ("fp8_e5m2", 8, jnp.float8_e5m2), ("fp6_e2m3", 6, jnp.float6_e2m3fn),
    ("fp6_e3m2", 6, jnp.float6_e3m2fn), ("fp4_e2m1", 4, jnp.float4_e2m1fn), ("int8", 8, jnp.int8),
    ("mxfp4", 4.25, None),
])
def test_dtype_helpers(name: str, bits: float, dtype) -> None:
    t = parse(name)
    assert t.bits_per_element == bits
    assert t.jnp_dtype == (jnp.dtype(dtype) if dtype is not None else None)
    assert t.is_block_format == (dtype is None)


def test_accum_dtype() -> None:
    assert parse("bf16 @accum(fp32)").accum_dtype == jnp.float32
    assert parse("bf16").accum_dtype == jnp.bfloat16


# (text, 0-based offset of the mistake, length, gist)
ERRORS = [
    ("bf17", 0, 4, "unknown numeric type `bf17`"),
    ("bf16 @acum(fp32)", 5, 5, "unknown modifier `@acum`"),
    ("bf16 @accum(fp8_e4m3)", 12, 8, "cannot accumulate in `fp8_e4m3`"),
    ("bf16 @accum(fp33)", 12, 4, "unknown numeric type `fp33`"),
    ("bf16 @accum(fp32", 16, 1, "ends too early"),
    ("bf16 @scale(per_block)", 12, 9, "unknown scaling `per_block`"),
    ("bf16 @scale(per_block(0))", 22, 1, "block size must be a positive integer"),
    ("bf16 @scale(per_block(2.5))", 22, 3, "block size must be a positive integer"),
    ("bf16 @scale(rowwise)", 12, 7, "unknown scaling `rowwise`"),
    ("fp8_e4m3 @scale(delayed(0))", 24, 1, "amax history length must be an integer from 1 to 65536, got `0`"),
    ("fp8_e4m3 @scale(delayed(-2))", 24, 2, "amax history length must be an integer from 1 to 65536"),
    ("fp8_e4m3 @scale(delayed(1.5))", 24, 3, "amax history length must be an integer from 1 to 65536"),
    ("fp8_e4m3 @scale(delayed(65537))", 24, 5, "amax history length must be an integer from 1 to 65536"),
    ("fp8_e4m3 @scale(per_tensor(8))", 16, 10, "per_tensor takes no size"),
    ("fp8_e4m3 @scale(delay(8))", 16, 5, "unknown scaling `delay(...)`; only per_block(N) and delayed(H) take a size"),
    ("bf16 @accum(fp32) @accum(fp32)", 18, 6, "given twice"),
    ("fp16 @loss_scale(-1)", 17, 2, "loss scale must be positive"),
    ("fp16 @loss_scale(always)", 17, 6, "@loss_scale takes a positive number or `dynamic`"),
    ("bf16 fp32", 5, 1, "unexpected `f`"),
    ("", 0, 1, "empty numeric type"),
    ("@accum(fp32)", 0, 1, "unexpected `@`"),
]


@pytest.mark.parametrize("text, offset, length, gist", ERRORS)
def test_errors_carry_the_offset(text: str, offset: int, length: int, gist: str) -> None:
    with pytest.raises(NumericTypeError) as info:
        parse(text)
    assert (info.value.offset, info.value.length) == (offset, length)
    assert gist in info.value.message


def test_error_hints() -> None:
    with pytest.raises(NumericTypeError) as info:
        parse("bf16 @acum(fp32)")
    assert info.value.hint == "did you mean `@accum`?"
    with pytest.raises(NumericTypeError) as info:
        parse("mxfp44")
    assert info.value.hint == "did you mean `mxfp4`?"


_types = st.builds(
    NumericType,
    base=st.sampled_from(sorted(BASE_TYPES)),
    accum=st.none() | st.sampled_from(["fp32", "bf16", "fp16"]),
    scale=st.none() | st.builds(Scale, kind=st.sampled_from(["per_tensor", "delayed"]))
    | st.builds(Scale, kind=st.just("per_block"), block=st.integers(1, 4096))
    | st.builds(Scale, kind=st.just("delayed"), history=st.integers(1, 65536)),
    loss_scale=st.none() | st.just("dynamic") | st.floats(1e-3, 1e9, allow_nan=False),
)


@given(_types)
def test_print_parse_roundtrip(t: NumericType) -> None:
    assert parse(str(t)) == t
    assert str(parse(str(t))) == str(t)


@given(st.text(alphabet="bf1632@()acum_xp ,.-", max_size=30))
def test_garbage_raises_only_numeric_type_error(text: str) -> None:
    try:
        parse(text)
    except NumericTypeError as exc:
        assert 0 <= exc.offset <= len(text)
