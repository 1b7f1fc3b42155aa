"""Shared pieces of the Mosaic GPU (Hopper) kernels: backend checks, interpret mode, accumulators."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
LOG2E = 1.4426950408889634
NEG_BIG = -1e30  # finite "minus infinity" for running maxima: exp2(NEG_BIG - NEG_BIG) == 1, never NaN


@functools.cache
def on_hopper() -> bool:
    """True when the default backend is a CUDA GPU of compute capability 9.x (wgmma, TMA)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    return str(getattr(dev, "compute_capability", "")).startswith("9")


def interpret_params():
    """The Mosaic GPU interpreter's parameters (private in jax 0.10/0.11, public later)."""
    try:
        from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams  # jax >= 0.12
    except ImportError:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


_PROFILE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("profile", default=None)


@contextlib.contextmanager
def profiling(directory: str, space: int = 512):
    """Kernels traced inside record their `jax.named_scope` phases with Mosaic GPU's on-device
    profiler: every call writes a Perfetto trace, `<ns>-trace.json`, to `directory`.

    `space` is the number of scope entries a warpgroup may record per call (more is undefined
    behaviour); each warpgroup keeps 16 bytes of SMEM per entry. The setting is read when a kernel
    is traced, so only functions jitted anew inside the block are profiled. The interpreter ignores it.
    """
    token = _PROFILE.set((str(directory), space))
    try:
        yield
    finally:
        _PROFILE.reset(token)


def kernel_call(body, *, interpret: bool, **kwargs):
    """`plgpu.kernel` with approximate math on the GPU, or the CPU interpreter when `interpret`."""
    if interpret:
        return plgpu.kernel(body, interpret=interpret_params(), **kwargs)
    params = {"approx_math": True}
    if (profile := _PROFILE.get()) is not None:
        params.update(profile_dir=profile[0], profile_space=profile[1])
    return plgpu.kernel(body, compiler_params=plgpu.CompilerParams(**params), **kwargs)


def smem_transforms(dtype):
    """(8, 64) tiling + 128-byte swizzle: the SMEM layout wgmma and TMA both read at full speed."""
    swizzle_elems = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(128))


def mma(a, b, shape, *, acc=None, transpose_b: bool = False, interpret: bool, then=None):
    """acc + a @ b (b.T if transpose_b) on the tensor cores, fp32 [M, N] = `shape`.

    a is a register array or an SMEM ref, b an SMEM ref. `then()` runs while the product is in
    flight (e.g. a barrier). On the GPU an existing accumulator is updated in place
    (`run_state`). The interpreter of jax 0.10/0.11 has neither `run_state` nor transposed wgmma
    operands, so there the product is a plain fp32 dot of the loaded tiles.
    """
    if interpret:
        av = a if isinstance(a, jax.Array) else a[...]
        bv = b[...]
        out = lax.dot_general(av, bv, (((1,), (1 if transpose_b else 0,)), ((), ())),
                              preferred_element_type=jnp.float32)
        if then is not None:
            then()
        return out if acc is None else acc + out
    b = transposed(b) if transpose_b else b

    def issue(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        if then is not None:
            then()

    if acc is not None:
        return pl.run_state(issue)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
        issue(acc_ref)
        return acc_ref[...]
    return pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))


def mma_pair(first, second, shape, *, interpret: bool, between=lambda x: x):
    """(between(a1 @ b1.T), a2 @ b2.T) for first = (a1, b1), second = (a2, b2), SMEM refs.

    Both products (fp32 [M, N] = `shape`) are issued back to back; `between` runs on the first
    as soon as it lands, while the second is still in flight.
    """
    if interpret:
        (a1, b1), (a2, b2) = first, second
        return (between(mma(a1, b1, shape, transpose_b=True, interpret=True)),
                mma(a2, b2, shape, transpose_b=True, interpret=True))

    def body(r1, r2):
        for ref, (a, b) in ((r1, first), (r2, second)):
            plgpu.wgmma(ref, a, transposed(b))
        x = between(plgpu.wgmma_accumulator_load(r1, wait_n=1))  # one group left: the second
        return x, r2[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def mma_acc_pair(first, second, *, interpret: bool):
    """(acc1 + a1 @ b1, acc2 + a2() @ b2) for first = (acc1, a1, b1), second = (acc2, a2, b2).

    a1 is a register array, `a2()` builds the second A operand while the first product is in
    flight; b1, b2 are SMEM refs. Both accumulators are updated in place on the GPU.
    """
    (acc1, a1, b1), (acc2, a2, b2) = first, second
    if interpret:
        return (mma(a1, b1, acc1.shape, acc=acc1, interpret=True),
                mma(a2(), b2, acc2.shape, acc=acc2, interpret=True))

    def body(refs):
        r1, r2 = refs
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2(), b2)
    return pl.run_state(body)((plgpu.ACC.init(acc1), plgpu.ACC.init(acc2)))


def online_softmax(s, acc, m, l, *, qk_scale: float, dtype):
    """Online-softmax update of block scores s [rows, keys] (masked scores -inf): (acc rescaled,
    m_new, l, P in `dtype`), with the running max m in log2 units (qk_scale includes log2 e).

    For qk_scale > 0, max(s) * qk_scale is the scaled max, so exp2(s * qk_scale - m_new) is one
    FMA a score; another scale is applied to s first.
    """
    if qk_scale <= 0:
        s, qk_scale = s * qk_scale, 1.0
    m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l = l * alpha + p.sum(axis=1)
    return lax.optimization_barrier((acc, m_new, l, p.astype(dtype)))


def zeros(shape, *, interpret: bool):
    """fp32 zeros in the wgmma accumulator layout (the interpreter has no layouts)."""
    x = jnp.full(shape, 0.0, jnp.float32)
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def row_vector(value, n, *, interpret: bool, dtype=jnp.float32):
    """A per-row vector [n] (fp32 by default) in the layout of a wgmma accumulator's row reductions."""
    x = jnp.full((n,), value, dtype)
    return x if interpret else plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def iota2d(shape, dim, *, interpret: bool):
    """int32 iota over `dim` of a [rows, cols] tile in the wgmma accumulator layout."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


# jax 0.11 deprecates `plgpu.load`'s separate index (index the ref instead); jax 0.10 requires one
_LOAD_WANTS_INDEX = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty


def load(ref, *, layout, optimized: bool = True):
    """`plgpu.load` of the whole of `ref` (index it with `ref.at[...]` first), on jax 0.10 and 0.11."""
    return plgpu.load(ref, *([()] if _LOAD_WANTS_INDEX else []), layout=layout, optimized=optimized)


def transposed(ref):
    """`ref` [N, K] read as its transpose [K, N], e.g. as a wgmma operand (`plgpu.transpose_ref`,
    deprecated in jax 0.11)."""
    return ref.transpose((1, 0))


def load_rows(ref, *, interpret: bool, dim: int = 1):
    """Read an fp32 [n] SMEM vector in the layout of an accumulator's reductions over `dim`."""
    if interpret:  # the interpreter has no layouts (nor `plgpu.load`)
        return ref[...]
    return load(ref, layout=plgpu.Layout.WGMMA.reduce(dim))


def stream(lo, hi, stages: int, sources):
    """Producer loop of a memory warpgroup: TMA tiles for steps [lo, hi) through a `stages` ring.

    `sources` lists (src(step) -> GMEM ref view, SMEM ring [stages, ...], full barriers, free
    barriers). A slot is refilled once the consumers arrive on its free barrier; at the end the
    last release of every slot is awaited, so each barrier phase is observed (the interpreter checks).
    """
    def load(step, slot):
        for src, ring, full, _ in sources:
            plgpu.copy_gmem_to_smem(src(step), ring.at[slot], full.at[slot])

    for i in range(stages):
        pl.when(lo + i < hi)(functools.partial(load, lo + i, i))

    def refill(step, _):
        slot = lax.rem(step - lo, stages)
        for src, ring, full, free in sources:
            plgpu.barrier_wait(free.at[slot])
            plgpu.copy_gmem_to_smem(src(step), ring.at[slot], full.at[slot])
    lax.fori_loop(lo + stages, hi, refill, None)

    def drain(step, _):
        slot = lax.rem(step - lo, stages)
        for _, _, _, free in sources:
            plgpu.barrier_wait(free.at[slot])
    lax.fori_loop(jnp.maximum(hi - stages, lo), hi, drain, None)


def stream_items(n_items, item, stages: int, sources):
    """Producer of a persistent CTA: one `stages` TMA ring running on across its items.

    `item(i)` gives (lo, hi, index(kv)) of the CTA's i-th item: it needs KV blocks [lo, hi), each
    read as `ref.at[index(kv)]` for every (GMEM ref, SMEM ring [stages, ...], full barriers, free
    barriers) of `sources`. The ring's step count runs on across items, so the next item's tiles
    load while the consumers finish the current one; a slot is refilled once its free barrier
    completes. At the end the last release of every slot is awaited (every barrier phase observed).
    `item(i)` runs once an item, before its first load: it may issue the item's other loads there.
    """
    zero = n_items - n_items

    def item_loads(i, g):
        lo, hi, index = item(i)

        def one(kv, g):
            slot = lax.rem(g, stages)
            for ref, ring, full, free in sources:
                pl.when(g >= stages)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                plgpu.copy_gmem_to_smem(ref.at[index(kv)], ring.at[slot], full.at[slot])
            return g + 1
        return lax.fori_loop(lo, hi, one, g)
    total = lax.fori_loop(zero, n_items, item_loads, zero)

    def drain(g, _):
        slot = lax.rem(g, stages)
        for *_, free in sources:
            plgpu.barrier_wait(free.at[slot])
    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


def strided_count(total: int, cta, grid: int):
    """How many of items [0, total) CTA `cta` of a persistent grid runs (cta, cta + grid, ...)."""
    return lax.div(jnp.int32(total) - cta + (grid - 1), jnp.int32(grid))


def num_sms(interpret: bool, *, fallback: int = 2) -> int:
    """Streaming multiprocessors of the GPU (the size of a persistent grid); `fallback` when interpreting."""
    return fallback if interpret else jax.devices()[0].core_count
