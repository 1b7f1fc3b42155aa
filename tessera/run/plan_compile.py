"""`tessera plan`'s ahead-of-time compile: the program lowered and compiled for abstract inputs (no parameter is
allocated), the compiler's memory figures beside the plan's own count of the same program (`plan.py`). A model
too large to compile here is compiled with 2 and 4 layers and extrapolated per layer."""

from __future__ import annotations

import time

from tessera.ir import cost
from tessera.run.plan import activation_memory, array_bits, one_device, param_memory, run_sizes
from tessera.spec.tasks import trains

COMPILE_PARAMS_LIMIT = 2e9  # above this, compile two shallow copies and extrapolate per layer
_PROBE_LAYERS = (2, 4)      # even, so layers that alternate (sliding / full attention) stay balanced


def _with_layers(exp, layers: int):
    """A copy of `exp` whose model has `layers` layers (the repeat count; one scan, so memory is linear)."""
    model = exp.model.model_copy(update={"args": {**exp.model.args, "layers": layers}})
    return exp.model_copy(update={"model": model})


def _sharded_compile(exp) -> bool:
    """Whether this machine has the mesh's devices (as `build_mesh` takes them), so the sharded program itself
    can compile."""
    import jax

    n = len(jax.devices())
    return exp.mesh.size > 1 and (n == exp.mesh.size or (exp.mesh.size < n and jax.process_count() == 1))


def _abstract(tree, shardings: dict):
    """ShapeDtypeStructs of `tree`; a leaf under a parameter's path with its shape gets that parameter's sharding."""
    import jax

    def leaf(path, x):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        sharding = next((shardings[n] for n in names if n in shardings), None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def _lowered(exp, train: bool):
    """The jitted step of exp's program lowered for abstract arguments (no parameter is allocated)."""
    import jax
    import jax.numpy as jnp

    from tessera.lower.program import compile_experiment
    from tessera.lower.sampling import SamplingRule

    sizes, sds = cost.task_dims(exp), jax.ShapeDtypeStruct
    optimizer = None
    if train:
        from tessera.run.optim import build_optimizer

        optimizer = build_optimizer(exp)
    prog = compile_experiment(exp, optimizer=optimizer)
    shardings = {} if prog.plan is None else prog.plan.param_shardings()
    params = _abstract(prog.param_shapes(), shardings)
    tokens = sds((sizes["batch"], sizes["seq"]), jnp.int32)
    if train:
        state = _abstract(jax.eval_shape(prog.init_train_state, params), shardings)
        batch = {"tokens": tokens, "targets": tokens, "mask": sds(tokens.shape, jnp.float32)}
        if prog.graph.losses:  # the loss entries' inputs at the task data's sizes
            from tessera.lower.context import jnp_dtype

            batch = {k: sds(shape, jnp_dtype(dtype))
                     for k, (shape, dtype) in cost.loss_inputs(cost.loss_sizes(prog.graph, exp)).items()}
        return prog.lower("train_step", state, batch)  # as `tessera run` compiles it: state donated
    if exp.task.kind == "generate":
        t, new = exp.task, exp.task.max_new_tokens
        rule = SamplingRule(float(t.sampling.temperature), int(t.sampling.top_k) or None,
                            float(t.sampling.top_p) if t.sampling.top_p < 1.0 else None)
        stop = tuple(int(x) for x in t.stop_tokens)
        prompts = sds((sizes["batch"], sizes["seq"] - new), jnp.int32)
        split = _abstract(prog.param_shapes(split_layers=True), {})  # as the generate task holds them
        fn = jax.jit(prog.generate_fn(split, sizes["batch"], new, rule, stop))
        return fn.lower(split, prompts, sds((), jnp.uint32), sds((), jnp.int32))
    return jax.jit(prog.forward_fn("forward")).lower(params, tokens)


COMPILER_FIGURES = ("argument", "output", "alias", "temp")  # the compiler's memory analysis, as `tessera plan` shows it


def _compiled_bytes(exp, train: bool) -> dict | None:
    """The compiler's memory figures {argument, output, alias, temp, total} in bytes (None if not reported).

    total = arguments + outputs - aliased + temporaries: the peak the compiled step needs.
    """
    stats = _lowered(exp, train).compile().memory_analysis()
    if stats is None:
        return None
    out = {k: float(getattr(stats, f"{k}_size_in_bytes")) for k in COMPILER_FIGURES}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _ours_as_compiled(exp, train: bool) -> float:
    """Our per-device total for the program as it compiles: params as it holds them (`array_bits`)."""
    from tessera.lower.program import program_graph

    graph = program_graph(exp)
    sizes, losses = run_sizes(graph, exp, train)
    layout = cost.Layout.of(exp)
    memory = {**activation_memory(graph, exp, sizes, layout, train, losses),
              **param_memory(graph, layout, exp, train, bits=array_bits)}
    return sum(memory.values())


def _scope(exp, sharded: bool) -> str:
    if sharded:
        return "per device, the sharded program"
    import jax

    if exp.mesh.size == 1:
        return "the whole program on one device"
    return f"the whole program on one device (the mesh needs {exp.mesh.size}, this machine has {len(jax.devices())})"


def _figures(exp, train: bool, total_params: int) -> tuple[dict | None, float, dict]:
    """(compiler figures, our total, what was compiled): the whole model, or 2 and 4 layers extrapolated."""
    layers = exp.model.args.get("layers")
    if total_params <= COMPILE_PARAMS_LIMIT:
        return _compiled_bytes(exp, train), _ours_as_compiled(exp, train), {"layers_compiled": layers}
    if not (isinstance(layers, int) and layers > _PROBE_LAYERS[1]):
        raise _Skip("too large to compile here and no `layers` model argument to shrink it by")
    (a, b), probes = _PROBE_LAYERS, [_with_layers(exp, n) for n in _PROBE_LAYERS]
    ca, cb = (_compiled_bytes(e, train) for e in probes)
    compiler = None if ca is None else {k: ca[k] + (layers - a) * (cb[k] - ca[k]) / (b - a) for k in ca}
    oa, ob = (_ours_as_compiled(e, train) for e in probes)
    return compiler, oa + (layers - a) * (ob - oa) / (b - a), {
        "layers_compiled": list(_PROBE_LAYERS), "note": f"compiled with {a} and {b} layers, extrapolated to {layers}"}


class _Skip(Exception):
    """The compile cannot be attempted here (the reason is the message)."""


def aot_compile(exp, plan: dict) -> dict:
    """Compile the program against abstract inputs; the compiler's memory figures beside ours."""
    import jax

    from tessera.diagnostics import TesseraError

    sharded, started = _sharded_compile(exp), time.perf_counter()
    target = exp if sharded or exp.mesh.size == 1 else one_device(exp)
    out = {"status": "ok", "backend": jax.default_backend(), "note": "", "scope": _scope(exp, sharded)}
    try:
        compiler, ours, what = _figures(target, trains(exp.task), plan["params"]["total"])
    except _Skip as exc:
        return {"status": "skipped", "note": str(exc)}
    except TesseraError as exc:  # the program cannot lower this layout yet (the plan above still holds)
        return {"status": "skipped", "note": exc.diagnostics[0].message}
    except Exception as exc:  # a valid spec whose program does not compile: what this check is for
        return {"status": "failed", "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                "seconds": time.perf_counter() - started}
    out.update(what, seconds=time.perf_counter() - started, compiler_bytes=compiler, ours_bytes=ours)
    if compiler is None:
        out["note"] = (out["note"] + "; " if out["note"] else "") + "the backend gives no memory analysis"
    return out
