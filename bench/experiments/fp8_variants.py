"""The fp8 train step's levers left at the Llama-3-8B layer shape, timed in one process (train_variants' loop).

    python -m bench.experiments.fp8_variants [--spec specs/bench/llama_8b_layers_train.yaml] [--set KEY=VALUE ...]
        [--only base,...] [--steps 5] [--hlo]

The spec runs under `fp8_e4m3 @scale(delayed(16)) @accum(fp32)` unless a `--set numerics.default=...` says
otherwise. Variants (names hold no commas: `--only` splits on them):
- "base": as built (the layers' weights quantised once before their scan: tessera/lower/fp8_held.py);
- "not held": each product quantises its own weight slice, in the forward and again in remat's replay (the form
  before 9a3940e), to measure holding within one process;
- "one layout": deterministic mode's weights held before its shard loop in w_q's layout alone (as before session 44),
  where built they are held in both layouts their products read; for a spec run with
  `--set parallel.deterministic=true` (the fast step's scan holds one layout either way);
- "fp8 unembedding": the untied unembedding's product in fp8 too, per_tensor while the rest runs under the
  spec's scaling (delayed(16) here). Session 44 (one H100): 193.1 against base's 205.6 ms (1.065x). Built since as
  a spec rule, `numerics.compute: {"*unembed": <the default's fp8 type>}`, with the unembedding then scaled as the
  rest (delayed: its own amax history); bench.e2e "llama-8b-layers train fp8 delayed unembedding".
`--hlo` prints the transposes each compiled step holds, by element type: as landed before 9a3940e the 8B-shape
per_tensor step held seven of fp32 weight stacks (6.5 GiB written a step) beside 0.8 GiB of fp8 ones.
"""

from __future__ import annotations

from bench.experiments.train_variants import main as time_variants
from tessera.lower import fp8_held
from tessera.lower.context import jnp_dtype
from tessera.lower.named import einsum, names, stored_dtype
from tessera.lower.reference import packed as packed_ref
from tessera.lower.table import LOWERINGS, Lowering, get_lowering

BUILT_UNEMBED = get_lowering("unembed")


def fp8_unembed(ctx, op, attrs, ins, params):
    """The unembedding's product in fp8 with per-tensor current scaling, where its graph's products run in fp8 (an
    untied weight, one device, every position); anything else as built."""
    if ctx.fp8 is None or attrs["tied"] or ctx.shard is not None or ctx.last_only:
        return BUILT_UNEMBED.fn(ctx, op, attrs, ins, params)
    x, dt = ins[0], jnp_dtype(op.results[0].type.dtype)
    w = packed_ref.dense(params["weight"], x.dtype)
    y = einsum([names(op.values[0]), ("embed", "vocab")], names(op.results[0]), x, w, accum=ctx.accum_dtype,
               store=stored_dtype(dt, ctx.accum_dtype), fp8="per_tensor")
    return [y.astype(dt)]


def one_layout(*args, transposed=False, **kw):
    return HELD_WEIGHTS(*args, **kw)


HELD_WEIGHTS = fp8_held.held_weights
VARIANTS = {
    "base": [],
    "one layout": [(fp8_held, "held_weights", one_layout)],
    "not held": [(fp8_held, "holds", lambda ctx: False)],
    "fp8 unembedding": [(LOWERINGS, "unembed", Lowering("unembed", fp8_unembed))],
}


if __name__ == "__main__":
    raise SystemExit(time_variants(variants=VARIANTS, description=__doc__, spec="specs/bench/llama_8b_layers_train.yaml",
                                   overrides=("numerics.default=fp8_e4m3 @scale(delayed(16)) @accum(fp32)",)))
