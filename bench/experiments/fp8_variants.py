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
- "fp8 unembedding": the unembedding's product in fp8 too, per_tensor while the rest runs under the
  spec's scaling (delayed(16) here). Session 44 (one H100): 193.1 against base's 205.6 ms (1.065x). Built since as
  a spec rule, `numerics.compute: {"*unembed": <the default's fp8 type>}`, with the unembedding then scaled as the
  rest (delayed: its own amax history); bench.e2e "llama-8b-layers train fp8 delayed unembedding".
`--hlo` prints the transposes each compiled step holds, by element type: as landed before 9a3940e the 8B-shape
per_tensor step held seven of fp32 weight stacks (6.5 GiB written a step) beside 0.8 GiB of fp8 ones.
"""

from __future__ import annotations

from bench.experiments.train_variants import main as time_variants
from tessera.lower import fp8_held
from tessera.lower.table import LOWERINGS, Lowering, get_lowering

BUILT_UNEMBED = get_lowering("unembed")


def fp8_unembed(ctx, op, attrs, ins, params):
    """The built unembedding with its product in fp8 under per-tensor current scaling, whatever the rest runs under
    (the lowering multiplies in fp8 whenever its context carries a scaling)."""
    return BUILT_UNEMBED.fn(ctx.replace(fp8="per_tensor", fp8_history=None), op, attrs, ins, params)


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
