"""Flash attention kernel vs reference attention: forward and gradients (q, k, v, sinks).

The interpreter tests are sized to the case each names, no larger: the Mosaic GPU interpreter runs
a kernel's grid points one after another, and the backward's grid (not persistent) has a CTA per
head and 128-row or 128-key tile. Gradients are checked once per kind of mask; cases that concern
only the forward (its Q slots) check its output and statistics alone. Where a case needs a
property of the schedule (items per CTA, KV blocks per item, half-width blocks), the test asserts
it first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.kernels.attention_mask import MaskSpec
from tessera.lower.kernels.flash_attention import FlashConfig, flash_attention, supported
from tessera.lower.kernels.flash_attention_fwd import _forward, _schedule, _Work
from tessera.lower.reference.attention import attention, attention_mask
from tests.lower.kernels._check import assert_close
from tests.lower.kernels._interpret import share_compiles  # noqa: F401 (autouse: one compile per kernel)


def _inputs(seed, b, s, t, hq, hkv, d, dtype, with_sinks):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
    k = jax.random.normal(ks[1], (b, t, hkv, d), dtype)
    v = jax.random.normal(ks[2], (b, t, hkv, d), dtype)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32) * 2 if with_sinks else None
    ct = jax.random.normal(ks[4], (b, s, hq, d), jnp.float32)
    return q, k, v, sinks, ct


def _check(shape, dtype, *, causal, window, with_sinks, config=None, seed=0, q_offset=0):
    """Forward and all gradients of the kernel against the fp32 reference on fresh inputs."""
    q, k, v, sinks, ct = _inputs(seed, *shape, dtype, with_sinks)
    assert supported(q, k, v, sinks=sinks, causal=causal, window=window, q_offset=q_offset,
                     config=config)

    def loss(fn, q, k, v, sinks):
        out = fn(q, k, v, sinks=sinks, causal=causal, window=window, q_offset=q_offset)
        return jnp.vdot(out.astype(jnp.float32), ct), out

    kernel = lambda *a, **kw: flash_attention(*a, config=config, **kw)
    args = (q, k, v, sinks)
    # eager under the interpreter: its kernels block inside host callbacks, and nesting them in
    # one jitted program can starve XLA's CPU thread pool on small machines
    jit = (lambda f: f) if config is not None and config.interpret else jax.jit
    grad = lambda fn, *a: jit(jax.grad(lambda *x: loss(fn, *x), argnums=(0, 1, 2, 3),
                                       has_aux=True))(*a)
    (gq, gk, gv, gs), out = grad(kernel, *args)
    up = tuple(None if x is None else x.astype(jnp.float32) for x in args)
    (rq, rk, rv, rs), ref = grad(attention, *up)
    tol = 2e-2
    assert_close(out, ref, tol, "out")
    assert_close(gq, rq, tol, "dq")
    assert_close(gk, rk, tol, "dk")
    assert_close(gv, rv, tol, "dv")
    if with_sinks:
        assert_close(gs, rs, tol, "dsinks")


def _reference_lse(q, k, sinks, *, causal, window, q_offset=0, scale=None):
    """log2 of the sum of exp(score) over each row's visible keys and its sink: the statistics
    the forward stores for the backward ([B, Hq, S], -inf for a row that sees nothing)."""
    f32 = lambda x: x.astype(jnp.float32)
    (b, s, hq, d), t = q.shape, k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    scores = jnp.einsum("bshd,bthd->bhst", f32(q), jnp.repeat(f32(k), hq // k.shape[2], axis=2)) * scale
    scores = jnp.where(attention_mask(s, t, causal=causal, window=window, q_offset=q_offset), scores, -jnp.inf)
    if sinks is not None:
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (b, hq, s, 1))], -1)
    return jax.nn.logsumexp(scores, axis=-1) / jnp.log(2.0)


def _check_forward(shape, dtype, *, causal, window, with_sinks, config, seed=0, q_offset=0):
    """The forward alone (no backward kernels to interpret) against the fp32 reference: its output
    and the log-sum-exp it hands the backward."""
    q, k, v, sinks, _ = _inputs(seed, *shape, dtype, with_sinks)
    kw = dict(causal=causal, window=window, q_offset=q_offset)
    out, lse = _forward(q, k, v, sinks, **kw, scale=shape[-1] ** -0.5, cfg=config,
                        has_sinks=with_sinks)
    up = tuple(None if x is None else x.astype(jnp.float32) for x in (q, k, v, sinks))
    assert_close(out, attention(*up[:3], sinks=up[3], **kw), 2e-2, "out")
    assert_close(lse, _reference_lse(q, k, sinks, **kw), 1e-3, "lse")


def _items(shape, cfg, *, causal, window, q_offset=0):
    """Each CTA's items in the forward's schedule: [[(batch, head, row tile, lo, hi), ...], ...],
    lo / hi the item's first / last + 1 KV block; the schedule; the query rows padded in front."""
    b, s, t, hq, _, d = shape
    work, front = _schedule(b, s, hq, t, d, causal=causal, window=window, q_offset=q_offset, cfg=cfg)
    locate = jax.jit(work.locate)  # one dispatch an item
    return [[tuple(int(x) for x in locate(jnp.int32(c), jnp.int32(i)))
             for i in range(int(work.count(jnp.int32(c))))] for c in range(work.grid)], work, front


def test_interpret_causal_window_sinks_gqa():
    """CPU interpreter: GQA 2:1, causal, window 48 < block, sinks, S not a multiple of the block;
    one persistent CTA runs both heads (3 Q slots, K/V ring carried across items)."""
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    _check((1, 100, 100, 2, 1, 64), jnp.bfloat16, causal=True, window=48, with_sinks=True, config=cfg)


def test_interpret_forward_alone_skips_the_statistics():
    """A forward without a gradient stores no log-sum-exp (one kernel output fewer); its output is
    bitwise the gradient path's, whose statistics are log2(sum of 2^(score log2 e)) over the
    visible keys and the sink: the reference's, in log2 units."""
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    q, k, v, sinks, _ = _inputs(3, 1, 100, 100, 2, 1, 64, jnp.bfloat16, True)
    kw = dict(causal=True, window=48, scale=0.125, q_offset=0, cfg=cfg, has_sinks=True)
    out, lse = _forward(q, k, v, sinks, **kw, want_lse=True)
    alone, none = _forward(q, k, v, sinks, **kw, want_lse=False)
    assert none is None
    assert bool(jnp.all(alone == out))
    assert_close(lse, _reference_lse(q, k, sinks, causal=True, window=48), 1e-3, "lse")


def test_interpret_causal_front_padding():
    """CPU interpreter: causal without a window, forward and gradients, S = 190 (not a multiple of a
    128-row item), so the first item starts 66 rows before position 0 (the padding goes in front);
    one CTA runs all 4 items of both heads. The backward's loops split into masked and fully
    visible stretches (causal), over 2 query tiles, 2 key tiles and 2 KV heads."""
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    shape = (1, 190, 190, 2, 2, 64)
    (items,), _, front = _items(shape, cfg, causal=True, window=None)
    assert front == 66 and len(items) == 4
    _check(shape, jnp.bfloat16, causal=True, window=None, with_sinks=True, config=cfg)


def test_interpret_half_width_edge_blocks_and_snake_schedule():
    """CPU interpreter, the GPU's tiles (128-key blocks, 64-row warpgroups): causal, window 128,
    sinks, GQA 2:1, S = 255, forward and gradients. The lower warpgroup runs the window's first
    block at half width, the upper one the causal diagonal's; 4 items over 3 CTAs end on a
    reversed partial round (the second item of the last CTA)."""
    cfg = FlashConfig(block_q=64, block_kv=128, num_ctas=3, interpret=True)
    shape = (1, 255, 255, 2, 1, 64)
    items, work, front = _items(shape, cfg, causal=True, window=128)
    assert [[(tile, h) for _, h, tile, _, _ in cta] for cta in items] == [[(1, 0)], [(1, 1)], [(0, 0), (0, 1)]]
    mask, halves = work.mask, set()
    for _, _, tile, lo, hi in sum(items, []):
        for wg in range(2):
            p0 = tile * 128 + wg * 64 - front
            full = mask.full_range(p0, p0 + 63, 128, lo, hi)
            halves.add((wg, *(int(x) for x in mask.half_edges(p0, p0 + 63, 128, lo, *full, hi))))
    assert {(1, 1, 0), (0, 0, 1)} <= halves  # (warpgroup, up, down), as `_attend` works them out
    _check(shape, jnp.bfloat16, causal=True, window=128, with_sinks=True, config=cfg)


def test_interpret_two_q_slots(monkeypatch):
    """CPU interpreter, the Q / output double buffer that head dim 128 gets on the GPU (2 slots,
    not 3): the producer loads the next item's Q into the slot of the item before once each
    compute warpgroup has released its half, in its first step, after that item's output left.
    One CTA runs all 4 items of both heads; the last two have one KV block each, where a release
    after the step's turn wait would deadlock (the turn waits for the other warpgroup's next
    Q K^T, whose K the producer loads only after that Q). Forward only: the Q slots are the
    forward's, and test_interpret_causal_front_padding runs this shape's backward."""
    from tessera.lower.kernels import flash_attention_fwd as fwd
    monkeypatch.setattr(fwd, "_q_slots", lambda *_: 2)
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    shape = (1, 190, 190, 2, 2, 64)
    (items,), _, _ = _items(shape, cfg, causal=True, window=None)
    assert [hi - lo for *_, lo, hi in items] == [3, 3, 1, 1]
    _check_forward(shape, jnp.bfloat16, causal=True, window=None, with_sinks=True, config=cfg)


@pytest.mark.parametrize("n_tiles,bsz,hq,grid", [(32, 4, 64, 132), (3, 1, 5, 4), (5, 2, 3, 7), (2, 1, 1, 2)])
def test_snake_schedule_runs_each_item_once_and_balances_causal_work(n_tiles, bsz, hq, grid):
    """Every (tile, batch, head) item goes to exactly one CTA; with causal weights (tile t holds
    t + 1 key blocks) no CTA gets more than one item's weight above another."""
    mask = MaskSpec(causal=True, window=None, q_offset=0, kv_len=n_tiles * 128)
    work = _Work(n_tiles, bsz, hq, grid, 128, 128, mask)
    ctas, slots = jnp.arange(grid, dtype=jnp.int32), jnp.arange(-(-n_tiles * bsz * hq // grid), dtype=jnp.int32)
    # every (CTA, list position) at once: one dispatch, not one per item
    counts, (b, h, row, lo, hi) = jax.device_get(jax.jit(lambda c, i: (
        jax.vmap(work.count)(c), jax.vmap(jax.vmap(work.item, (None, 0)), (0, None))(c, i)))(ctas, slots))
    mine = np.arange(slots.shape[0])[None, :] < counts[:, None]  # [grid, slots]: the CTA's own items
    seen = sorted(zip(row[mine] // 128, b[mine], h[mine]))
    loads = np.where(mine, hi - lo, 0).sum(axis=1)
    assert seen == [(t, b, h) for t in range(n_tiles) for b in range(bsz) for h in range(hq)]
    assert max(loads) - min(loads) <= n_tiles
    if (n_tiles, bsz, hq, grid) == (32, 4, 64, 132):
        assert max(loads) == min(loads) == 1024  # in CTA order every round: 1040 and 1008


def test_interpret_full_attention_fp16():
    """CPU interpreter: not causal, no sinks, fp16, keys longer than queries."""
    cfg = FlashConfig(block_q=64, block_kv=64, interpret=True)
    _check((1, 64, 100, 1, 1, 64), jnp.float16, causal=False, window=None, with_sinks=False,
           config=cfg, seed=1)


def test_interpret_query_offset_chunked_prefill():
    """CPU interpreter: 64 queries at positions 128..191 of 192 keys (a prefill chunk), window 100;
    one CTA runs both heads, so the 2-slot K/V ring wraps within and across items."""
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    shape = (1, 64, 192, 2, 1, 64)
    (items,), _, _ = _items(shape, cfg, causal=True, window=100, q_offset=128)
    assert [hi - lo for *_, lo, hi in items] == [3, 3]  # blocks an item > the ring's 2 stages
    _check(shape, jnp.bfloat16, causal=True, window=100, with_sinks=True, config=cfg, seed=2, q_offset=128)


def test_interpret_window_split_into_masked_and_full_runs(monkeypatch):
    """CPU interpreter: a window wide enough (here forced to one block) that the backward splits
    its loops into masked / fully visible / masked stretches (keys 64..127 are fully visible to
    rows 128..191), with GQA 2:1 so dK/dV runs its stretches once per query head of the group."""
    import tessera.lower.kernels.flash_attention_bwd as bwd
    monkeypatch.setattr(bwd, "_SPLIT_MIN_WINDOW_BLOCKS", 1)
    cfg = FlashConfig(block_q=64, block_kv=64, num_ctas=1, interpret=True)
    _check((1, 64, 192, 2, 1, 64), jnp.bfloat16, causal=True, window=130, with_sinks=True,
           config=cfg, seed=3, q_offset=128)


@pytest.mark.parametrize("d,window", [(64, 300), (128, 300), (64, 128)])
def test_forward_lowers_for_hopper(d, window):
    """The real Mosaic GPU lowering (no GPU needed) accepts the kernel: register layouts of loop
    carries, accumulators and row vectors are checked here, which the interpreter does not do.
    Window 128 (GPT-OSS's) runs each item as one masked loop between the half-width edge blocks."""
    cfg = FlashConfig(block_kv=128, stages=4 if d == 64 else 2, num_ctas=132)
    q = jax.ShapeDtypeStruct((1, 512, 8, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 1, d), jnp.bfloat16)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, config=cfg)
    text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,window", [(64, None), (64, 300), (128, None), (128, 300)])
def test_backward_lowers_for_hopper(d, window):
    """The dQ and dK/dV kernels pass the real Mosaic GPU lowering (paired wgmma groups, waits on
    the first of two products, accumulators updated in place), which the interpreter skips;
    causal loops run split into masked and full stretches, a 300 window as one masked loop."""
    cfg = FlashConfig(block_kv=128, stages=2, block_q_bwd=128 if d == 64 else 64, num_ctas=132)
    q = jax.ShapeDtypeStruct((1, 512, 8, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 1, d), jnp.bfloat16)
    loss = lambda q, k, v: flash_attention(q, k, v, causal=True, window=window, config=cfg).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3  # forward, dQ, dK/dV


def test_remat_dots_keeps_the_forward_residuals():
    """In the layer scan under remat `dots` (as `repeat` lowers it), the backward reads the forward's
    output and statistics (named residuals) instead of running the forward kernel a second time: three
    kernels, not four."""
    from tessera.lower.interpret import REMAT_POLICIES

    cfg = FlashConfig(block_kv=128, stages=2, block_q_bwd=128, num_ctas=132)

    def layer(h, w):
        q = jnp.sin(h @ w)
        kv = q[:, :, :1]
        return flash_attention(q, kv, kv, causal=True, config=cfg) @ w + h, None

    body = jax.checkpoint(layer, policy=REMAT_POLICIES["dots"], prevent_cse=False)
    loss = lambda h, ws: jax.lax.scan(body, h, ws)[0].astype(jnp.float32).sum()
    h, ws = jax.ShapeDtypeStruct((1, 512, 8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((2, 64, 64), jnp.bfloat16)
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(h, ws).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3  # forward, dQ, dK/dV


def test_unsupported_shapes_fall_back():
    """Head dim 96, fp32 and mismatched heads are refused, so the lowering keeps the reference."""
    cfg = FlashConfig(interpret=True)
    x = jnp.zeros((1, 64, 2, 96), jnp.bfloat16)
    assert not supported(x, x, x, config=cfg)
    y = jnp.zeros((1, 64, 2, 64), jnp.float32)
    assert not supported(y, y, y, config=cfg)
    q, kv = jnp.zeros((1, 64, 3, 64), jnp.bfloat16), jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    assert not supported(q, kv, kv, config=cfg)


GPU_CASES = [
    # (b, s, t, hq, hkv, d), dtype, causal, window, sinks, config (None: the default)
    ((2, 256, 256, 8, 2, 64), jnp.bfloat16, True, None, True, None),
    ((1, 300, 300, 4, 1, 128), jnp.float16, True, 40, True, None),
    ((1, 520, 520, 4, 4, 64), jnp.bfloat16, True, 200, False, None),
    ((2, 256, 256, 4, 1, 128), jnp.bfloat16, False, None, True, None),
    ((1, 1000, 1000, 8, 1, 64), jnp.bfloat16, True, 128, True, None),
    ((1, 128, 384, 2, 1, 64), jnp.bfloat16, False, 100, False, None),
    ((2, 1000, 1000, 8, 2, 64), jnp.bfloat16, True, None, True, FlashConfig(stages=3)),
    ((1, 700, 700, 4, 1, 64), jnp.float16, True, 100, False, FlashConfig(block_kv=64, stages=4,
                                                                        num_ctas=5)),
    ((1, 640, 640, 4, 2, 128), jnp.bfloat16, True, None, True, FlashConfig(num_ctas=3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,causal,window,with_sinks,config", GPU_CASES)
def test_gpu_matches_reference(shape, dtype, causal, window, with_sinks, config):
    """On a Hopper GPU: several shapes, windows smaller and larger than a block, both dtypes,
    deeper K/V rings, persistent grids much smaller than the work (2 and 3 Q slots)."""
    _check(shape, dtype, causal=causal, window=window, with_sinks=with_sinks, config=config,
           seed=sum(shape) % 97)
