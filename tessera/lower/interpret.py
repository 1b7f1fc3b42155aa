"""Evaluate a Graph IR region with JAX: each op through its lowering, `repeat` as one `lax.scan`.

`repeat(n, block, x)` keeps its parameters stacked [n, ...]. Attributes that differ per layer
(`PerLayer` tables, e.g. GPT-OSS's window on even layers only) are periodic in practice, so the scan
runs n / p iterations of p unrolled layers, p the smallest period of every table: each unrolled layer
sees static attributes (a kernel can specialise on its window, a sliding-window layer's KV cache can
hold only its window) and the program still compiles as fast for 36 layers as for 2.

Generation (`LowerCtx.unroll`) runs every layer unrolled instead, over per-layer parameters
(`split_layers`: each stacked parameter a list of its n layers) and per-layer KV caches. Inside a
scan XLA copies a layer's slice of every stacked weight that a GEMM or a kernel reads, and of its
cache, before using it: at decode that is the whole model copied per token (GPT-OSS 20b on an
H200: 7.3 of 12.9 ms a token), while the step itself reads each weight once. The unrolled layers are
traced and lowered once per period (a jitted function per phase, which XLA inlines): a 24-layer generate
program on the CPU traced in 1.3 s instead of 8.8 and lowered in 1.2 s instead of 3.0; on a GPU every
layer's kernels were lowered again before (GPT-OSS-20B: 8.2 s of tracing and 19.6 s of lowering, H200).
Deterministic training runs its canonical shards' layers unrolled too (tessera/lower/shard/layerwise.py), each
layer rematerialised as the scan's body is and fenced (tessera/lower/fence.py): a computation of its own, as the
scan's body was. A fast-mode train step on one device unrolls its stacked layers, each reading its slice of the
stacks (`_unrolls_stacked` says why).

A weight-shared repeat (`axis = none`) reads its one set of parameters at every step; with `grad = "last"` its
first n - 1 steps run on stop_gradient'ed inputs and parameters and only the last keeps residuals. `loop` is
lowered in tessera/lower/loop.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tessera.ir.ops_recurrence import invariant
from tessera.ir.passes.numerics import FP8_OPS, fp8_op
from tessera.ir.registry import get_op
from tessera.ir.types import Op, ParamRef, PerLayer, Region, Value
from tessera.lower.context import REMAT_SAVED, LowerCtx
from tessera.lower.fence import fenced
from tessera.lower.fp8_delayed import HISTORY
from tessera.lower.fp8_held import HELD, held_weights
from tessera.lower.table import get_lowering

State = dict[str, Any]

REMAT_POLICIES = {  # parallel.remat -> the jax.checkpoint policy of a `repeat` body in training (none: below)
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*REMAT_SAVED)),
    "full": jax.checkpoint_policies.nothing_saveable,
}

# `remat: none` in a repeat's layers: every IR op's results kept (a train step names them OP_RESULT, `eval_region`),
# and what `dots` keeps (the products with weights, attention's kernel residuals), as the plan counts them
# (tessera/ir/cost.py `activation_bytes`); what an op computes inside itself from those (an fp32 upcast, a norm's
# statistics, an activation's sigmoid; the reference attention's scores) is recomputed by the backward. Without a
# policy JAX kept every such value: the Llama-1B step (batch 8 x 2048, one H100, session 45) asked for one 70.8 GiB
# allocation where the plan's total, parameters and optimizer included, was 43.0 GiB.
OP_RESULT = "tessera_op_result"
KEEP_RESULTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(OP_RESULT, *REMAT_SAVED))


def param_bindings(op: Op) -> list[tuple[str, str]]:
    """(local name, path) of each parameter operand, in the order the op's definition declares them."""
    refs = [o.path for o in op.operands if isinstance(o, ParamRef)]
    if not refs:
        return []
    decls = get_op(op.name).params(op.attrs, [v.type for v in op.values])
    if len(decls) != len(refs):
        raise ValueError(f"op `{op.name}` declares {len(decls)} params but has {len(refs)} param operands")
    return [(d.name, path) for d, path in zip(decls, refs)]


def resolve_attrs(attrs: dict, layer: int | None) -> dict:
    """Attributes with every per-layer table replaced by its entry for `layer`."""
    if layer is None:
        return attrs
    return {k: (v.values[layer] if isinstance(v, PerLayer) else v) for k, v in attrs.items()}


def period(region: Region, n: int) -> int:
    """The smallest p dividing n such that every per-layer table in the region repeats every p layers."""
    tables = [v.values for op in region.walk() for v in op.attrs.values() if isinstance(v, PerLayer)]
    for p in range(1, n + 1):
        if n % p == 0 and all(all(t[i] == t[i % p] for i in range(len(t))) for t in tables):
            return p
    return n


def eval_region(region: Region, args: list, params: dict, ctx: LowerCtx, state: State | None = None,
                layer: int | None = None, remat: str = "none", scope: str = "") -> tuple[list, State | None]:
    """Run `region` on `args`; returns its outputs and, when `state` is given, the new state.

    Each op is traced inside `jax.named_scope(op.label(index, scope))`, so every HLO instruction it becomes
    carries the IR op's name (`tessera profile` groups the time by it); `scope` is the enclosing repeat's axis.
    """
    env = dict(zip(region.args, args))
    new_state: State | None = {} if state is not None else None
    for index, op in enumerate(region.ops):
        key = str(index)
        ins = [env[v] for v in op.values]
        if op.name == "repeat":
            outs, st = eval_repeat(op, ins, params, ctx, None if state is None else state[key], remat)
        elif op.name == "loop":
            from tessera.lower.loop import eval_loop

            outs, st = eval_loop(op, ins, params, ctx, layer, remat), None
        elif op.region is not None:  # jvp, vjp, grad, custom_vjp: a function of their region
            from tessera.lower.derivatives import eval_region_op

            with jax.named_scope(op.label(index, scope)):
                outs, st = eval_region_op(op, ins, params, ctx, layer), None
        else:
            if any(isinstance(o, ParamRef) for o in op.operands) and not get_op(op.name).params(
                    op.attrs, [v.type for v in op.values]):
                op, ins = _explicit_params(op, env, params, ctx)
            with jax.named_scope(op.label(index, scope)):
                outs, st = _eval_op(op, ins, params, ctx, None if state is None else state.get(key), layer)
            if ctx.mode == "train":  # what remat none keeps of a layer (KEEP_RESULTS)
                outs = [_named_result(o) for o in outs]
        if st is not None and new_state is not None:
            new_state[key] = st
        env.update(zip(op.results, outs))
    return [env[v] for v in region.outputs], new_state


def _explicit_params(op: Op, env: dict, params: dict, ctx: LowerCtx) -> tuple[Op, list]:
    """An op that declares no params but reads ones the model declares itself (`param([...]) as name`, e.g. a
    primitive `dot` the fuse pass left as it is) as the same op on values: each param an operand of its type (inside
    a stacked repeat, its layer's slice), gathered whole where a mesh splits it."""
    if ctx.param_types is None:
        raise ValueError(f"op `{op.name}` reads a `param(...)` operand: its lowering needs the graph's param types "
                         "(LowerCtx.param_types; Program.lower_ctx passes them)")
    operands, ins = [], []
    for o in op.operands:
        if isinstance(o, Value):
            operands.append(o)
            ins.append(env[o])
            continue
        w, t = _used(ctx, o.path, params[o.path]), ctx.param_types[o.path]
        if ctx.shard is not None:
            w = ctx.shard.gather_param(op.name, o.path.rsplit("/", 1)[-1], o.path, w)
        operands.append(Value(t.with_dims(t.dims[len(t.dims) - w.ndim:]), o.path.rsplit("/", 1)[-1]))
        ins.append(w)
    return dataclasses.replace(op, operands=operands), ins


def _used(ctx: LowerCtx, path: str, w):
    """Parameter `path` as an op reads it: through `ctx.param_use`'s function for it where there is one."""
    use = ctx.param_use.get(path) if ctx.param_use else None
    return w if use is None else use(w)


def _eval_op(op: Op, ins: list, params: dict, ctx: LowerCtx, state, layer):
    lowering = get_lowering(op.name)
    attrs = resolve_attrs(op.attrs, layer)
    bindings = param_bindings(op)
    local = {name: _used(ctx, path, params[path]) for name, path in bindings}
    if ctx.fp8 is not None and op.name in FP8_OPS and not fp8_op(op, ctx.fp8_ops):  # numerics.compute's rules
        ctx = ctx.replace(fp8=None)
    if ctx.fp8 is not None and ctx.fp8.startswith("delayed("):  # the train step's amax histories (fp8_delayed.py)
        history = {name: params[path + HISTORY] for name, path in bindings if path + HISTORY in params}
        ctx = ctx.replace(fp8_history=history or None)
    if ctx.fp8 is not None:  # weights quantised before the repeat's scan (fp8_held.py)
        held = {name: params[path + HELD] for name, path in bindings if path + HELD in params}
        ctx = ctx.replace(fp8_held=held or None)
    if ctx.shard is not None:  # FSDP: gather what the op does not handle split, per layer inside the scan
        local = {name: ctx.shard.gather_param(op.name, name, path, params[path]) for name, path in bindings}
    if lowering.stateful:
        outs, st = lowering.fn(ctx, op, attrs, ins, local, state)
        return list(outs), st
    return list(lowering.fn(ctx, op, attrs, ins, local)), None


def region_param_paths(region: Region) -> list[str]:
    """Every parameter path read inside `region` (nested regions included), in first-use order."""
    seen: dict[str, None] = {}
    for op in region.walk():
        for o in op.operands:
            if isinstance(o, ParamRef):
                seen.setdefault(o.path)
    return list(seen)


def _stacked_paths(op: Op, params: dict) -> list[str]:
    """The parameters of a `repeat` op held stacked, one slice per layer ([n, ...]); with them the amax histories
    of delayed fp8 scaling that a train step adds beside its stacked weights (`<path>#amax_history`, [n, ...]) and
    the fp8 copies of them quantised before the scan (`<path>#fp8_held`, fp8_held.py)."""
    n = op.attrs["n"]
    if op.attrs.get("axis") is None:  # weight-shared: every iteration reads the same params
        return []
    paths = [path for path in region_param_paths(op.region)
             if not isinstance(params[path], list) and params[path].ndim and params[path].shape[0] == n]
    return paths + [path + extra for extra in (HISTORY, HELD) for path in paths if path + extra in params]


def stacked_layers(region: Region, shapes: dict) -> dict[str, int]:
    """{path: n} of the parameters a `repeat` of `region` holds stacked ([n, ...]); `shapes` maps each path to
    anything with a `.shape` (arrays, ShapeDtypeStructs, packed MXFP4)."""
    out = {}
    for op in region.ops:
        if op.name == "repeat" and op.attrs.get("axis") is not None:  # a weight-shared repeat stacks nothing
            n = op.attrs["n"]
            out.update({path: n for path in region_param_paths(op.region)
                        if tuple(shapes[path].shape)[:1] == (n,)})
    return out


def split_layers(region: Region, params: dict) -> dict:
    """`params` with every parameter a `repeat` of `region` stacks turned into the list of its n layers.

    Parameters already held split (lists: `Program.init(split_layers=True)`, `load_weights(...)`) pass as
    they are. Inside a jitted program the slices of a stacked parameter are copies, taken once before the
    token loop: generation from stacked parameters holds them twice, from split ones once.
    """
    out = dict(params)
    for op in region.ops:
        if op.name == "repeat":
            for path in _stacked_paths(op, params):
                out[path] = [jax.tree.map(lambda a, i=i: a[i], params[path]) for i in range(op.attrs["n"])]
    return out


def eval_repeat(op: Op, ins: list, params: dict, ctx: LowerCtx, state: State | None, remat: str):
    """One `repeat` op on its carried inputs: a lax.scan over its stacked parameters (n / period steps),
    or with `ctx.unroll` its n layers one after another over per-layer parameters and states."""
    # a train step unrolls only a stacked repeat whose parameters come split (deterministic mode's shard loop); a
    # weight-shared recurrence (its one-step gradient included) or a stack left whole stays a scan
    if ctx.unroll and (ctx.mode != "train" or (op.attrs.get("axis") is not None and not _stacked_paths(op, params))):
        return _eval_unrolled(op, ins, params, ctx, state, remat)
    if _unrolls_stacked(op, ctx, state):
        return _eval_unrolled(op, ins, params, ctx, state, remat)
    if op.attrs.get("grad") == "last" and state is None:
        return _last_step_grad(op, ins, params, ctx, remat), None
    n, region, axis = op.attrs["n"], op.region, op.scope_name
    p = period(region, n)
    params, stacked = _with_held(op, params, ctx)
    xs_params = {path: jax.tree.map(lambda a: a.reshape((n // p, p) + a.shape[1:]), params[path])
                 for path in stacked}  # a packed (MXFP4) parameter is a pytree of two stacked arrays
    shared = {path: v for path, v in params.items() if path not in xs_params}

    def body(carry, xs):
        it, layer_params, layer_state = xs
        new_states = []
        inner = ctx if ctx.aux is None else ctx.replace(aux={})  # counters leave the scan as its outputs
        for j in range(p):
            here = dict(shared)
            # indexed, not split: the index's gradient (a zero-padded [p, ...] per layer, added) fuses into the
            # scan's gradient accumulators, where a split's concatenated one is a buffer of its own (GPT-OSS-20B's
            # two layers: +6.1 GiB, out of memory on one H100)
            here.update({path: jax.tree.map(lambda a: a[j], v) for path, v in layer_params.items()})
            index = (it * p + j).astype(jnp.int32)
            st = None if layer_state is None else layer_state[j]
            carry, st = eval_region(region, [index, *carry], here, inner, st, layer=j, scope=axis)
            carry = tuple(carry)
            new_states.append(st)
        return carry, ((None if layer_state is None else new_states), inner.aux)

    body = _rematerialised(body, ctx, remat)
    xs = (jnp.arange(n // p, dtype=jnp.int32), xs_params, state)
    carry, (new_state, aux) = jax.lax.scan(body, tuple(ins), xs, unroll=bool(ctx.scan_unroll))
    for name, per_step in (aux or {}).items():
        ctx.aux[name] = ctx.aux.get(name, 0) + jnp.sum(per_step)
    return list(carry), new_state


def _with_held(op: Op, params: dict, ctx: LowerCtx) -> tuple[dict, list[str]]:
    """(params with the fp8 copies of a `repeat`'s stacked weights held before its layers (fp8_held.py), the stacked
    paths among them, those copies included)."""
    held = held_weights(op.region, params, _stacked_paths(op, params), ctx, param_bindings)
    params = {**params, **held} if held else params
    return params, _stacked_paths(op, params)


def _named_result(x):
    """An op's result named for KEEP_RESULTS (fp8 values unnamed: jax would round a saved e4m3fn value through IEEE
    `reduce_precision`, making its largest values inf; layerwise.saveable_but_gathers says more)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits > 8:
        return checkpoint_name(x, OP_RESULT)
    return x


def _rematerialised(fn, ctx: LowerCtx, remat: str, prevent_cse: bool = False):
    """A train step's layer (the scan's body, or an unrolled layer) under the spec's remat policy (dots, full; none:
    KEEP_RESULTS in fast mode), else `ctx.layer_remat`; fn itself where none applies. `prevent_cse`: the
    recomputation's inputs behind an optimization barrier, for a layer that is not a scan's body (there XLA would
    merge the backward's recomputation with the forward's identical computation, keeping what remat recomputes).

    Deterministic mode keeps none as JAX does without a policy: its steps are bit for bit the same on every mesh
    because each computes the same values in the same fusions, and values recomputed in the backward's fusions came
    out a rounding apart between one device and a mesh on XLA:CPU (test_train_meshes)."""
    if ctx.mode != "train":
        return fn
    policy = REMAT_POLICIES.get(remat)
    if policy is None:
        policy = KEEP_RESULTS if remat == "none" and not ctx.deterministic else ctx.layer_remat
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def _last_step_grad(op: Op, ins: list, params: dict, ctx: LowerCtx, remat: str) -> list:
    """A weight-shared repeat's one-step gradient (`grad = "last"`): its first n - 1 steps on stop_gradient'ed
    inputs and params, which keeps no residuals, then step n - 1 with the gradient. Carried values the region
    yields unchanged enter that step as they came in, with their gradient."""
    n, sg = op.attrs["n"], jax.lax.stop_gradient
    carry = list(ins)
    if n > 1:
        head = dataclasses.replace(op, attrs={**op.attrs, "n": n - 1, "grad": "all"})
        carry, _ = eval_repeat(head, [sg(x) for x in ins], jax.tree.map(sg, params), ctx, None, remat)
    carry = [x if inv else c for x, c, inv in zip(ins, carry, invariant(op))]
    out, _ = eval_region(op.region, [jnp.int32(n - 1), *carry], params, ctx, scope=op.scope_name)
    return out


def _unrolls_stacked(op: Op, ctx: LowerCtx, state) -> bool:
    """Whether a fast-mode train step runs this `repeat`'s layers unrolled over its stacked parameters
    (`LowerCtx.unroll_layers`, one device): layer i reads slice i of each. In the scan each residual the backward
    keeps is written into a stack [n, ...], and where a GEMM computed it XLA:GPU copies it there (the Llama-1B step:
    288 copies, 736 MiB a layer); unrolled, each is a buffer of its own (one H100, session 49: fp8 219.1 -> 203.2 ms
    a step at the scan's peak, bf16 268.5 -> 261.0 ms, peak 34.8 -> 37.5 GiB). A weight-shared repeat, a one-step
    gradient (`grad = "last"`), a mesh's step (its per-layer gathers would all be free to run first) and a scan of
    one step (its layers are its body's, unrolled already; GPT-OSS-20B's two layers: 115.9 ms a step as the scan,
    122.1 unrolled, where the barrier below costs the recomputation XLA's CSE had saved) stay scans."""
    return (ctx.unroll_layers and ctx.mode == "train" and not ctx.deterministic and ctx.shard is None
            and state is None and op.attrs.get("axis") is not None and op.attrs.get("grad") != "last"
            and op.attrs["n"] > period(op.region, op.attrs["n"]))


def _eval_unrolled(op: Op, ins: list, params: dict, ctx: LowerCtx, state: list | None, remat: str = "none"):
    """`repeat` as n unrolled layers; layer i reads `params[path][i]` for a split parameter (a list), slice i of a
    stacked one in a fast-mode train step (`_unrolls_stacked`), and `state[i]`, and gets its static attributes. In a
    train step each layer is rematerialised as the scan's body is (the spec's remat policy, else `ctx.layer_remat`)."""
    n, region, axis = op.attrs["n"], op.region, op.scope_name
    sliced = _unrolls_stacked(op, ctx, state)
    if sliced:
        params, stacked = _with_held(op, params, ctx)
    elif _stacked_paths(op, params):
        raise ValueError(f"an unrolled repeat needs its stacked parameters split first (split_layers): "
                         f"{_stacked_paths(op, params)[:3]}")
    else:
        stacked = []
    p = period(region, n)
    phases: dict[int, Any] = {}

    def phase(j: int):
        # layers i and i + p have the same static attributes: one jitted function traces and lowers them
        # (kernels included) once, and XLA inlines its calls, so the program is the same as written out
        if j not in phases:
            def layer(index, carry, here, st):  # the name a jaxpr's per-layer call carries
                inner = ctx if ctx.aux is None else ctx.replace(aux={})  # counters leave the layer as outputs
                out, st = eval_region(region, [index, *carry], here, inner, st, layer=j, scope=axis)
                return out, st, inner.aux

            # sliced, the recomputation goes behind JAX's optimization barrier: without it XLA:GPU's CSE merged the
            # backward's recomputation with the forward's same fusions and kept what remat recomputes (the Llama-1B
            # step in bf16: 42.7 GiB where the scan peaks at 34.8)
            fn = _rematerialised(layer, ctx, remat, prevent_cse=sliced)
            # deterministic mode's unrolled train step: each layer (its VJP too) a computation of its own, whose
            # arithmetic then does not depend on its neighbours, a mesh's gathers or their absence; unfenced,
            # XLA:CPU computed attention's q and k gradients a bit apart on dp=2 and one device (the scan's body
            # kept them apart as a fence does)
            fenced_train = ctx.mode == "train" and not sliced
            phases[j] = functools.partial(fenced, jax.jit(fn)) if fenced_train else jax.jit(fn)
        return phases[j]

    carry, new_states = list(ins), []
    paths = region_param_paths(region)  # this repeat's params; a weight-shared one's are whole, not per layer
    split = op.attrs.get("axis") is not None
    for i in range(n):
        here = {path: (params[path][i] if split and isinstance(params[path], list) else params[path]) for path in paths}
        here.update({path + HELD: params[path + HELD][i] for path in paths  # held before a deterministic shard loop
                     if split and isinstance(params.get(path + HELD), list)})
        here.update({path: jax.tree.map(lambda a: a[i], params[path]) for path in stacked})
        carry, st, aux = phase(i % p)(jnp.int32(i), carry, here, None if state is None else state[i])
        for name, value in (aux or {}).items():
            ctx.aux[name] = ctx.aux.get(name, 0) + value
        new_states.append(st)
    return carry, (None if state is None else new_states)


def init_state(region: Region, ctx: LowerCtx, batch: int, max_len: int) -> State:
    """The empty state (KV caches) of every stateful op in `region`: stacked as `repeat` scans it, or
    with `ctx.unroll` a list of one state per layer."""
    state: State = {}
    for index, op in enumerate(region.ops):
        if op.name == "repeat":
            n = op.attrs["n"]
            if ctx.unroll:
                state[str(index)] = [_init_layer(op.region, ctx, batch, max_len, i) for i in range(n)]
                continue
            p = period(op.region, n)
            per_layer = [_init_layer(op.region, ctx, batch, max_len, j) for j in range(p)]
            state[str(index)] = jax.tree.map(lambda a: jnp.broadcast_to(a, (n // p,) + a.shape), per_layer)
            continue
        st = None if op.region is not None else _init_op(op, ctx, batch, max_len, None)  # loops keep none
        if st is not None:
            state[str(index)] = st
    return state


def _init_layer(region: Region, ctx: LowerCtx, batch: int, max_len: int, layer: int) -> State:
    state: State = {}
    for index, op in enumerate(region.ops):
        if op.name == "repeat":
            raise NotImplementedError("a stateful op inside a nested repeat")
        st = None if op.region is not None else _init_op(op, ctx, batch, max_len, layer)
        if st is not None:
            state[str(index)] = st
    return state


def _init_op(op: Op, ctx: LowerCtx, batch: int, max_len: int, layer: int | None):
    lowering = get_lowering(op.name)
    if not lowering.stateful:
        return None
    return lowering.init_state(ctx, op, resolve_attrs(op.attrs, layer), batch, max_len)
