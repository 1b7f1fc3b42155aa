"""Runs sharded training / generation on 8 CPU devices in a subprocess and prints the results as JSON.

python -m tests.lower.shard.worker JOB_JSON  (the parent test sets XLA_FLAGS before jax is imported here)
"""

from __future__ import annotations

import hashlib
import json
import sys

# small enough to compile fast, large enough that every mesh below divides what it splits
SMALL = {"model.args.layers": 4, "parallel.pipeline.microbatches": 2, "model.args.d_model": 32, "model.args.heads": 4, "model.args.kv_heads": 4,
         "model.args.head_dim": 8, "model.args.d_ff": 32, "task.batch": 8, "task.seq_len": 8,
         "task.schedule.warmup_steps": 0}
GPT_OSS_EXTRA = {"model.args.experts": 4, "model.args.window": 4}


def overrides(spec: str, extra: dict) -> dict:
    """The test's overrides of a shipped spec: SMALL, per-model extras, then the mesh and mode."""
    out = dict(SMALL)
    if "gpt_oss" in spec:
        out.update(GPT_OSS_EXTRA)
    out.update(extra)
    return out


def batches(steps: int, batch: int, seq: int):
    """Deterministic random token batches."""
    import numpy as np

    rng = np.random.default_rng(0)
    for _ in range(steps):
        toks = rng.integers(0, 256, (batch, seq + 1)).astype(np.int32)
        yield {"tokens": toks[:, :-1], "targets": toks[:, 1:]}


def host(x):
    """x as a numpy array on this host (gathered from every process in a multi-process run)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else x)


def checksum(params) -> str:
    """sha256 over every parameter's bytes, in path order."""
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(host(params[k]).tobytes())
    return h.hexdigest()


def state_checksum(state) -> str:
    """sha256 over every leaf of a train state (parameters, optimizer moments, counts), in tree order: a
    difference in Adam's moments shows a step before the parameters move apart."""
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state)):
        h.update(host(leaf).tobytes())
    return h.hexdigest()


def train(spec: str, extra: dict, steps: int) -> dict:
    """Loss curve, grad norms, final parameter and train state checksums of `steps` train steps."""
    import numpy as np

    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=overrides(spec, extra))
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    state = prog.init_train_state(prog.init(0))
    losses, norms = [], []
    for batch in batches(steps, exp.task.batch, exp.task.seq_len):
        state, m = prog.train_step(state, batch)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    params = {k: host(v).astype(np.float64) for k, v in state.params.items()}
    temp = prog.lower("train_step", state, batch).compile().memory_analysis().temp_size_in_bytes  # JAX's cached one
    pipeline = tensor = experts = None
    if prog.deterministic and prog.plan is not None:
        from tessera.ir.check import canonical_shards

        c = canonical_shards(exp.task.batch, prog.options.canonical_shards)
        pipeline = prog.deterministic_executor().pipeline_record(c, state.opt_state)
        tensor = prog.deterministic_executor().tensor_record(c, state.opt_state)
        experts = prog.deterministic_executor().tensor_record(c, state.opt_state, "ep")
    return {"losses": losses, "norms": norms, "checksum": checksum(state.params), "state": state_checksum(state),
            "params": {k: v.ravel()[:64].tolist() for k, v in params.items()},
            "param_bytes": int(sum(host(v).nbytes for v in state.params.values())),
            "collectives": prog.collectives, "deterministic": prog.deterministic, "temp": int(temp),
            "pipeline": pipeline, "tensor": tensor, "experts": experts}


def train_pde(spec: str, extra: dict, steps: int) -> dict:
    """A scientific model's `steps` train steps on its spec's Burgers pairs (`extra` as given): losses, grad norms,
    the parameter checksum, the whole train state's, a checksum of its held-out predictions, and how many experts
    each device holds."""
    import jax
    import numpy as np

    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.run.pde import BurgersSource
    from tessera.spec import load_experiment

    exp = load_experiment(spec, overrides=extra)
    prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
    source = BurgersSource(exp.task.data, exp.task.batch)
    state = prog.init_train_state(prog.init(0))
    losses, norms = [], []
    for n in range(steps):
        state, m = prog.train_step(state, source.batch(n))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    pred = np.asarray(jax.device_get(prog.forward(state.params, source.eval[0])))
    experts = [v for k, v in state.params.items() if k.endswith("experts/w_re")]
    return {"losses": losses, "norms": norms, "checksum": checksum(state.params), "state": state_checksum(state),
            "forward": hashlib.sha256(pred.tobytes()).hexdigest(), "collectives": prog.collectives,
            "expert_blocks": [int(v.addressable_shards[0].data.shape[1]) for v in experts]}


def generate(spec: str, extra: dict, steps: int) -> dict:
    """Greedy tokens for 4 fixed prompts, and the devices the parameters are on."""
    import jax
    import numpy as np

    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    extra = dict(extra)
    split = extra.pop("split_layers", False)  # the weights as the generate task holds them: split into layers
    exp = load_experiment(spec, overrides=overrides(spec, extra))
    prog = compile_experiment(exp)
    prompts = np.random.default_rng(1).integers(0, 256, (4, 5)).astype(np.int32)
    params = prog.init(0, split_layers=split)
    devices = sorted({d.id for v in jax.tree.leaves(params) for d in v.devices()})
    return {"tokens": np.asarray(prog.generate(params, prompts, max_new_tokens=steps)).tolist(), "devices": devices}


def error(spec: str, extra: dict, steps: int) -> dict:
    """The rendered TesseraError compiling the spec raises (or none)."""
    from tessera.diagnostics import TesseraError
    from tessera.lower.program import compile_experiment
    from tessera.spec import load_experiment

    try:
        compile_experiment(load_experiment(spec, overrides=overrides(spec, extra)))
    except TesseraError as e:
        return {"error": e.render()}
    return {"error": None}


def gather(spec: str, extra: dict, steps: int) -> dict:
    """Deterministic mode's gather_full on 2 x 4 devices, each dtype: whether every bit of the whole tensor (a
    -0.0, a NaN payload, subnormals among random values) comes back, from blocks split over one axis and two."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tessera.lower.shard.collectives import gather_full

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("ep", "dp"))
    bits = np.random.default_rng(0).integers(0, 2 ** 32, (4, 8, 6), dtype=np.uint64).astype(np.uint32)
    bits[0, 0, :3] = [0x80000000, 0x7FC01234, 0x00000001]  # -0.0, a NaN with a payload, the smallest subnormal
    out = {}
    for dtype in ("float32", "bfloat16"):
        if dtype == "float32":
            x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.float32)
        else:
            x = jax.lax.bitcast_convert_type(jnp.asarray((bits & 0xFFFF).astype(np.uint16)), jnp.bfloat16)
        for spec in (P(None, "ep"), P("dp", ("ep",))):
            fn = jax.shard_map(lambda v, spec=spec: gather_full(v, spec), mesh=mesh, in_specs=spec, out_specs=P(),
                               check_vma=False)
            got = fn(jax.device_put(x, NamedSharding(mesh, spec)))
            same = np.array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16 if dtype == "bfloat16"
                                                                          else jnp.uint32)),
                                  np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16 if dtype == "bfloat16"
                                                                          else jnp.uint32)))
            out[f"{dtype} {spec}"] = bool(same)
    return out


def ordered_sum(spec: str, extra: dict, steps: int) -> dict:
    """Deterministic mode's gradient reduction on 8 devices (as one axis, 2 x 4 and 2 x 2 x 2) for C = 8 and 16
    canonical shards: each device's tree_sum of its own shards, then ordered_sum over the devices, against
    tree_sum over all C shards' values in canonical order on one device. {case: (bitwise equal, the naive
    left-to-right sum differs)}: values of mixed magnitudes whose sum depends on the order of the adds, sizes that
    do not split evenly over 8 devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from tessera.lower.shard.deterministic import ordered_sum, tree_sum

    rng = np.random.default_rng(1)
    out = {}
    for shape in ((8,), (2, 4), (2, 2, 2)):
        names = ("a", "b", "c")[: len(shape)]
        mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(shape), names)
        for c in (8, 16):
            x = (rng.standard_normal((c, 5, 7)) * 10.0 ** rng.integers(-4, 8, (c, 5, 7))).astype(np.float32)

            def body(local, names=names):
                return ordered_sum(tree_sum(local), names)

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(), check_vma=False))
            got = np.asarray(fn(jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(names)))))
            want = np.asarray(tree_sum(jnp.asarray(x)))
            naive = np.add.reduce(x, axis=0, dtype=np.float32)
            out[f"{shape} C={c}"] = [bool(np.array_equal(got.view(np.uint32), want.view(np.uint32))),
                                         bool(not np.array_equal(naive, want))]
    return out


KINDS = {"train": train, "train_pde": train_pde, "generate": generate, "error": error, "gather": gather,
         "ordered_sum": ordered_sum}


def main() -> None:
    from tessera.run.distributed import is_main_process, join

    join()  # TESSERA_* set: one of several processes
    jobs = json.loads(sys.argv[1])
    out = [KINDS[j["kind"]](j["spec"], j["overrides"], j.get("steps", 2)) for j in jobs]
    if is_main_process():
        print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
