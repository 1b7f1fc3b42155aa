"""`numerics.compute`: per-op compute rules, checked before anything lowers.

A rule maps a glob on an op's label (`Op.label`: the directory its parameters share, as profiles and HLO name scopes
name it: `layers/attention`, `layers/mlp`, `embed/unembed`) to the type its products with weights run in. Two kinds
take effect (tessera/ir/passes/numerics.py lists the op's label in the graph attribute `fp8_out` or `fp8_in`, and
`fp8_op` tells the lowering):

- the program's compute type (`bf16` under an fp8 default) keeps the op's products out of fp8;
- the fp8 default's own type (`fp8_e4m3 @scale(per_tensor)` or `@scale(delayed(H))`, its amax history then kept
  like a layer's) puts the unembedding's product in fp8, which the default leaves in bf16 as Transformer Engine's,
  torchtitan's and DeepSeek-V3's recipes do.

Anything else would not be the arithmetic done, so it is refused here with the rule's position: a rule that names no
op whose products can run in fp8, fp8 under a default that is not fp8 (the default chooses fp8 and its scaling), a
scaling other than the default's, an fp8 unembedding under per-block scaling (its blocks are not built), and any
other per-op type.
"""

from __future__ import annotations

import fnmatch

from tessera.diagnostics import Diagnostic
from tessera.ir.passes.numerics import FP8_OPS, fp8_op_labels
from tessera.ir.types import Graph


def compute_rule_problems(exp, graph: Graph) -> list[Diagnostic]:
    """A positioned refusal for each `numerics.compute` rule that would not take effect as written."""
    rules = exp.numerics.compute or {}
    if not rules:
        return []
    default = exp.numerics.default
    fp8 = default.base == "fp8_e4m3"
    compute = "bf16" if fp8 else default.base
    accum = (None, default.accum or "fp32")  # a rule's @accum: none, or the program's (fp32 unless written)
    ops = fp8_op_labels(graph)
    out = []
    for glob, t in rules.items():
        span, key = exp.span(f"numerics.compute.{glob}") or exp.span("numerics.compute"), "numerics.compute"

        def refuse(message, hint):
            out.append(Diagnostic(f"compute rule `{glob}`: {message}", span=span, key=key, hint=hint))

        named = [label for label in ops if fnmatch.fnmatchcase(label, glob)]
        if not named:
            refuse(f"matches no op whose products with weights can run in fp8 ({', '.join(FP8_OPS)}) in model "
                   f"`{graph.name}`", "such ops here: " + ", ".join(list(ops)[:4]))
        elif t.base == compute and t.scale is None and t.loss_scale is None and t.accum in accum:
            continue  # the op's products in the program's compute type
        elif t.base != "fp8_e4m3":
            refuse(f"`{t}`: an op's products run in the program's compute type (`{compute}`) or, under an fp8 "
                   "numerics.default, in its fp8 type; other per-op compute types are not implemented",
                   f"write `{compute}`" + (f" or `{default}`" if fp8 else ""))
        elif not fp8:
            refuse(f"`{t}` under numerics.default `{default}`: the default chooses fp8 compute and its scaling; a "
                   "rule keeps ops out of it (or puts the unembedding in)",
                   f"set numerics.default to `{t}` and keep other ops out with `<op>: {compute}` rules")
        elif t.scale != default.scale or t.accum not in accum or t.loss_scale is not None:
            refuse(f"`{t}` differs from numerics.default `{default}`: one fp8 scaling and accumulation a program",
                   f"write `{default}`")
        elif getattr(default.scale, "kind", None) == "per_block" and any(ops[n] == "unembed" for n in named):
            refuse(f"the unembedding in fp8 under `@scale({default.scale})` is not implemented (its blocks are not "
                   "built); it runs in fp8 under `@scale(per_tensor)` and `@scale(delayed)`",
                   f"leave the unembedding in {compute} (no rule), or scale per_tensor or delayed")
    return out
