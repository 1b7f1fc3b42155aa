"""`tessera profile` of a spec with one of decode_variants' or train_variants' variants patched in: where a variant's
time goes, kernel by kernel, next to the landed lowering's profile.

    python -m bench.experiments.profile_variant VARIANT [--spec specs/gpt_oss_20b.yaml] [--set KEY=VALUE ...] [--top 45]
"""

from __future__ import annotations

import argparse

from bench.experiments.decode_variants import VARIANTS as DECODE  # configures the allocator before JAX starts
from bench.experiments.train_variants import VARIANTS as TRAIN
from bench.experiments.lowering_variants import patched
from tessera.lower import program
from tessera.run.profile import profile_experiment
from tessera.run.environment import configure_process
from tessera.spec import load_experiment

VARIANTS = {**TRAIN, **DECODE}  # "base" (as built) is in both


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=sorted(VARIANTS))
    ap.add_argument("--spec", default="specs/gpt_oss_20b.yaml")
    ap.add_argument("--set", action="append", default=[], help="a spec override, as `tessera profile --set`")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    exp = load_experiment(args.spec, overrides=args.set)
    configure_process(exp)  # as `tessera profile` does before JAX starts its backend (fp8: XLA's Triton GEMM off)
    with patched(VARIANTS[args.variant]):
        program._PROGRAMS.clear()  # programs are cached on the spec's hash
        profile_experiment(exp, out=args.out, top=args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
