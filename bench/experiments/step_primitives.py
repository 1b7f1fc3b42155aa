"""What a train step's jaxpr computes, by primitive: how many equations and how many output elements each makes,
and the source lines that make the most of chosen primitives. Abstract shapes (nothing is allocated, no device
needed), so the full-size bench specs trace on a laptop's CPU.

    python -m bench.experiments.step_primitives SPEC [--set KEY=VALUE ...] [--top 40]
        [--where concatenate,pad,is_finite,while]

A step's elements by primitive, at two commits, point at what a regression added without a GPU: session 37 ran it
in each tree `python -m bench.across_commits export` wrote (cwd the tree, PYTHONPATH the tree) for the
deterministic GPT-OSS-20B-layers step at d4cc6d1 and at bf7e59f, and found 4.2 G elements of `concatenate` in
`opaque_map` (a spare row copied onto every gradient), 2.8 G of `is_finite` no step read and a normalised copy of
every gradient (`div`): ~19 ms of traffic at the copy bandwidth against a 22 ms regression. Elements are counted
once per equation: a loop's body counts once, not once an iteration.
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.extend
import numpy as np


def step_jaxpr(spec: str, overrides: list[str]):
    """The spec's train step as `tessera run` builds it, traced at abstract shapes."""
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides)
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    state = jax.eval_shape(prog.init_train_state, jax.eval_shape(lambda: prog.init(0)))
    b, s = int(exp.task.batch), int(exp.task.seq_len)
    batch = {"tokens": jax.ShapeDtypeStruct((b, s), np.int32), "targets": jax.ShapeDtypeStruct((b, s), np.int32),
             "mask": jax.ShapeDtypeStruct((b, s), np.float32)}
    return jax.make_jaxpr(prog.train_step_fn())(state, batch).jaxpr


def equations(jaxpr):
    """Every equation, those of nested jaxprs (loops, conditionals, jits, VJPs) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def elements(eqn) -> int:
    return sum(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))


def where_made(eqn) -> str:
    """The user frame that traced the equation: file:line (function)."""
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--where", default="concatenate,pad,is_finite,while,dynamic_slice")
    args = ap.parse_args(argv)
    count, made = collections.Counter(), collections.Counter()
    by_line, example = collections.Counter(), {}
    chosen = set(args.where.split(","))
    for eqn in equations(step_jaxpr(args.spec, args.set)):
        name, n = eqn.primitive.name, elements(eqn)
        count[name] += 1
        made[name] += n
        if name in chosen:
            key = (name, where_made(eqn))
            by_line[key] += n
            example[key] = str(eqn.outvars[0].aval)
    for name, n in made.most_common(args.top):
        print(f"{name:28s} {count[name]:6d} equations {n / 1e6:12.1f} M elements")
    print()
    for (name, line), n in by_line.most_common(args.top // 2):
        print(f"{name:14s} {n / 1e6:10.1f} M  {example[(name, line)][:40]:40s} {line[-100:]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
