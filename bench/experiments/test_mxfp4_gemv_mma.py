"""The tensor-core route of the MXFP4 matrix-vector kernel (mxfp4_gemv_mma.py) against the reference: interpreter,
PTX emulator and (marked gpu) the GPU.

    python -m pytest bench/experiments/test_mxfp4_gemv_mma.py [-m gpu]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.experiments.mxfp4_gemv_mma import _E4M3_F16_HI, _E4M3_F16_LO, MmaConfig, installed, nibbles_f16
from tessera.lower.kernels.mxfp4_gemv import E4M3_SHIFT
from tessera.lower.kernels.mxfp4_matmul import pair_dot
from tessera.lower.reference import mxfp4 as ref
from tests.lower.kernels._check import assert_close
from tests.lower.kernels.test_mxfp4_matmul import _every_byte_in_every_position, _inputs, _run_ptx, _weights


@pytest.mark.parametrize("experts,k,n,cfg,dtype", [
    # two K splits over three steps (the last split's second step masked), N off the tile
    ([3, 0, 3, 1, 3], 96, 48, MmaConfig(block_n=32, splits=2, interpret=True), jnp.float32),
    # the weights as the dot's left operand, one split, loads in the step, bf16 stored by the kernel
    ([2, 0, 2], 96, 48, MmaConfig(block_n=32, splits=1, ahead=0, weights_first=True, interpret=True), jnp.bfloat16),
])
def test_interpret_tensor_core_route(experts, k, n, cfg, dtype):
    """Interpreter: row r times expert experts[r], in any order and with repeats, against dequantised weights."""
    r = len(experts)
    lhs, rhs, _ = _inputs(r * k + n, r, k, n, [0] * 4)
    ex = jnp.asarray(experts, jnp.int32)
    with installed():
        out = jax.jit(lambda x: pair_dot(x, rhs, ex, preferred_element_type=dtype, config=cfg))(lhs)
    want = np.einsum("rk,rkn->rn", np.asarray(lhs.astype(jnp.float32), np.float64), _weights(rhs, experts))
    assert out.shape == (r, n) and out.dtype == dtype
    assert_close(out, want, 1e-5 if dtype == jnp.float32 else 1e-2, "pairs")


def test_a_tensor_core_config_takes_one_e4m3_group_a_step():
    with pytest.raises(ValueError, match="one scale group"):
        MmaConfig(groups=2)
    with pytest.raises(ValueError, match="dequant e4m3"):
        MmaConfig(dequant="pair")


def test_interpret_tensor_core_route_scales_x_into_fp16():
    """The tensor-core route carries x in fp16 scaled by a power of two from the pair's largest |x|: a zero row
    gives zeros, rows at 2^40 and 2^-60 (outside fp16's range unscaled) and a row whose values span 2^40 match
    the reference to fp32's rounding."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    x[0], x[1], x[2], x[3, ::3] = 0.0, x[1] * 2.0 ** 40, x[2] * 2.0 ** -60, x[3, ::3] * 2.0 ** -40
    lhs = jnp.asarray(x, jnp.bfloat16)
    _, rhs, _ = _inputs(7, 4, 96, 48, [0] * 4)
    ex = jnp.asarray([3, 0, 2, 1], jnp.int32)
    cfg = MmaConfig(block_n=32, splits=2, interpret=True)
    with installed():
        got = np.asarray(jax.jit(lambda a: pair_dot(a, rhs, ex, preferred_element_type=jnp.float32, config=cfg))(lhs))
    want = np.einsum("rk,rkn->rn", np.asarray(lhs.astype(jnp.float32), np.float64), _weights(rhs, [3, 0, 2, 1]))
    assert not got[0].any()
    for row in range(1, 4):
        assert_close(got[row], want[row], 1e-5, f"row {row}")



@pytest.mark.gpu
@pytest.mark.parametrize("r,n,block_n,weights_first", [(4, 5760, 256, False), (1, 2880, 512, False),
                                                       (5, 200, 128, False), (4, 2880, 256, True)])
def test_gpu_pair_dot_tensor_core_route_matches_reference(r, n, block_n, weights_first):
    """On a GPU: the tensor-core route, x or the weights on the dot's left, against the reference's pair_dot,
    unsorted experts with a repeat, fp32 out."""
    rng = np.random.default_rng(r * n)
    lhs, rhs, _ = _inputs(r + n, r, 2880, n, [0] * 32)
    experts = rng.integers(0, 32, r).astype(np.int32)
    experts[-1] = experts[0]
    ex = jnp.asarray(experts)
    cfg = MmaConfig(block_n=block_n, num_warps=4, weights_first=weights_first)
    want = ref.pair_dot(lhs.astype(jnp.float32), rhs, ex, preferred_element_type=jnp.float32)
    with installed():
        got = jax.jit(lambda a: pair_dot(a, rhs, ex, preferred_element_type=jnp.float32, config=cfg))(lhs)
    assert_close(got, want, 1e-5, "fp32 out")



def test_e4m3_f16_ptx_is_bitwise_the_reference_on_an_emulator():
    """`_E4M3_F16_LO` / `_HI` (the tensor-core route: four code bytes -> four fp16 values of one nibble, times
    2^-6, two a register, in element order): the E2M1 values exactly for every byte in every position; the
    jnp route the interpreter takes gives the same bits."""
    table = (np.asarray(ref.E2M1, np.float32) / np.float32(E4M3_SHIFT)).astype(np.float16).view(np.uint16)
    for rolled, word in _every_byte_in_every_position(6):
        jnp_lo, jnp_hi = nibbles_f16(jnp.asarray(rolled.astype(np.uint8)), ptx=False)
        for asm, nib, via_jnp in ((_E4M3_F16_LO, rolled & 15, jnp_lo), (_E4M3_F16_HI, rolled >> 4, jnp_hi)):
            out = _run_ptx(asm, {"$2": word})
            want = table[nib].astype(np.uint32)  # [4 positions, 256]
            np.testing.assert_array_equal(out["$0"], want[0] | want[1] << 16)
            np.testing.assert_array_equal(out["$1"], want[2] | want[3] << 16)
            np.testing.assert_array_equal(np.asarray(via_jnp).view(np.uint16), table[nib])
