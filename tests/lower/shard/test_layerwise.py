"""Deterministic mode's per-layer gathers (tessera/lower/shard/layerwise.py): which parameters are gathered where
their op reads them, the interleaved shard order, and each device's blocks. The gathers' bit-identity across meshes
is checked end to end in test_train_meshes.py."""

from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tessera.lower.interpret import stacked_layers
from tessera.lower.program import program_graph
from tessera.lower.shard import layerwise
from tessera.spec import load_experiment
from tests.lower.shard.make_snapshots import ROOT


def _graph(spec: str):
    graph = program_graph(load_experiment(ROOT / spec))
    shapes = {p: types.SimpleNamespace(shape=tuple(d.size for d in v.type.dims)) for p, v in graph.params.items()}
    return graph, stacked_layers(graph.body, shapes)


def test_a_tied_embedding_and_pp_split_layers_are_gathered_once_per_shard_the_rest_at_their_use():
    graph, stacked = _graph("specs/llama_tiny.yaml")
    specs = {p: P(None, "fsdp") for p in graph.params}
    at_use = layerwise.use_plan(graph, specs, stacked)
    assert "embed/table" not in at_use  # read by the embedding and the tied unembedding: summed within a shard
    assert "layers/attention/q" in at_use and "final_norm/scale" in at_use
    assert set(stacked) <= at_use
    over_pp = {p: P("pp") if p in stacked else P() for p in graph.params}  # each device holds some layers
    assert not set(stacked) & layerwise.use_plan(graph, over_pp, stacked)


def test_device_d_runs_shards_d_n_plus_d_and_results_return_to_canonical_order():
    n, m = 4, 3
    ran = np.array([j * n + d for d in range(n) for j in range(m)])  # gathered device by device: the shard each ran
    assert np.asarray(layerwise.canonical_order(jnp.asarray(ran), n, m)).tolist() == list(range(n * m))


def test_each_devices_block_as_shard_map_lays_them_out():
    x = jnp.arange(4 * 6).reshape(4, 6)
    sizes = {"fsdp": 2, "tp": 2}
    rows = layerwise.blocks_of_all(x, P("fsdp", "tp"), ("fsdp", "tp"), sizes)
    assert rows.shape == (4, 2, 3)
    np.testing.assert_array_equal(rows[1], x[:2, 3:])  # device 1 = (fsdp 0, tp 1)
    np.testing.assert_array_equal(rows[2], x[2:, :3])
    rep = layerwise.blocks_of_all(x, P(None, "tp"), ("fsdp", "tp"), sizes)  # replicated over fsdp
    np.testing.assert_array_equal(rep[0], rep[2])
    np.testing.assert_array_equal(rep[3], x[:, 3:])
    # the replicated block cut into chunks over fsdp (block_sum's rows): device (fsdp f, tp t) holds chunk f of block
    # t, flattened, so the rows hold the tensor once and the chunks rejoin the block in fsdp order
    cut = layerwise.blocks_of_all(x, P(None, "tp"), ("fsdp", "tp"), sizes, chunk_over=("fsdp",))
    assert cut.shape == (4, 6)
    np.testing.assert_array_equal(np.concatenate([cut[1], cut[3]]).reshape(4, 3), x[:, 3:])
    odd = layerwise.blocks_of_all(jnp.arange(5.0), P(), ("fsdp",), {"fsdp": 2}, chunk_over=("fsdp",))
    np.testing.assert_array_equal(odd, [[0, 1, 2], [3, 4, 0]])  # zero-padded to equal chunks


def test_the_plan_counts_gathered_layers_and_gradient_blocks():
    held = [{"numel": 800, "block": 100, "wide": 4, "narrow": 2, "at_use": True, "layers": 8},
            {"numel": 80, "block": 10, "wide": 4, "narrow": 0, "at_use": False, "layers": 1}]
    got = layerwise.planned_bytes(held, m=2)
    assert got["gradients"] == 3 * (100 * 4 + 10 * 4)  # each iteration's blocks and their sum
    assert got["params"] == 100 * 2 + 80 * 4 + 2.5 * (800 * 4 / 8)  # narrow blocks, the tied whole, a layer
    # held whole on each of 4 devices: the cross-device sum's four gradients where fewer than three shards ran
    whole = [{"numel": 80, "block": 80, "wide": 4, "narrow": 0, "at_use": False, "layers": 1}]
    assert layerwise.planned_bytes(whole, m=1, devices=4)["gradients"] == 4 * 80 * 4
    assert layerwise.planned_bytes(whole, m=8, devices=4)["gradients"] == 9 * 80 * 4
    assert layerwise.planned_bytes(whole, m=1)["gradients"] == 2 * 80 * 4  # one device: no exchange


def test_the_remat_policy_recomputes_fp8_values_it_would_otherwise_turn_to_nan():
    """`saveable_but_gathers` saves every value but gathered parameters, and fp8 ones: jax rounds a saved value with
    IEEE `reduce_precision` at its type's widths, which made e4m3fn values of 256-448 NaN (every fp8 deterministic
    step on a mesh had a NaN loss). An fp8 product under the policy: loss and gradients bitwise those without remat,
    where `everything_saveable` gives NaN."""
    import jax
    import jax.extend
    import jax.numpy as jnp

    from tessera.lower.reference import fp8
    from tessera.lower.shard.layerwise import saveable_but_gathers

    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4)) * 0.1

    def f(w, x):
        return jnp.sum(fp8.einsum("mk,kn->mn", x, w, accum=jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(w, x)
    got = jax.jit(jax.value_and_grad(jax.checkpoint(f, policy=saveable_but_gathers), argnums=(0, 1)))(w, x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), got, want))
    nan = jax.jit(jax.value_and_grad(jax.checkpoint(f, policy=jax.checkpoint_policies.everything_saveable)))(w, x)
    assert jnp.isnan(nan[0])  # the jax behaviour the policy works around; if this fails, jax fixed it


def test_split_cuts_whole_stacks_into_layers_and_restack_undoes_it():
    stack = jnp.arange(24.0).reshape(4, 3, 2)
    packed = {"codes": jnp.arange(8).reshape(4, 2), "scales": jnp.arange(4.0)}  # a pytree stacked alike
    out = layerwise.split({"w": stack, "p": packed, "half": stack[:2], "shared": jnp.ones(3)},
                          {"w": 4, "p": 4, "half": 4})
    assert isinstance(out["w"], list) and len(out["w"]) == 4 and out["w"][2].shape == (3, 2)
    np.testing.assert_array_equal(np.asarray(out["w"][3]), np.asarray(stack[3]))
    assert np.asarray(out["p"][1]["codes"]).tolist() == [2, 3] and float(out["p"][1]["scales"]) == 1.0
    assert not isinstance(out["half"], list)  # its layers dim split over a mesh: a block, split where it is read
    assert out["shared"].shape == (3,)
    np.testing.assert_array_equal(np.asarray(layerwise.restack(out["w"])), np.asarray(stack))
    assert layerwise.restack(out["shared"]) is out["shared"]
    held = layerwise.held(out["w"], out["w"])
    assert len(held) == 4 and all(isinstance(h, layerwise.Held) for h in held)


@pytest.mark.parametrize("shards", [4, 2])
def test_the_deterministic_step_runs_no_layer_scan_in_its_shard_loop(shards):
    """One device's deterministic step over C >= UNROLL_FROM canonical shards reads each layer's weights as their
    own buffers (the layers unrolled over split weights): no scan over stacked weights is left inside the canonical
    shards' loop. Under it, the layer scan (its per-shard weight copies cost less than a split and a restacking)."""
    from bench.experiments.step_primitives import equations, step_jaxpr
    from tessera.lower.program import compile_experiment
    from tessera.lower.shard.layerwise import UNROLL_FROM

    over = ["parallel.deterministic=true", f"task.batch={shards}", "task.seq_len=16",
            f"parallel.canonical_shards={shards}"]
    prog = compile_experiment(load_experiment(ROOT / "specs/llama_tiny.yaml", over))
    unrolled = shards >= UNROLL_FROM
    assert prog.deterministic_executor().unrolls(shards) is unrolled
    stacks = {tuple(v.shape) for k, v in prog.param_shapes().items() if k in prog.stacked()}

    every = list(equations(step_jaxpr(str(ROOT / "specs/llama_tiny.yaml"), over)))
    prims = {e.primitive.name for e in every}
    assert "while" in prims and "cond" in prims  # the shard loop; each layer fenced (or the embedding and head)
    scanned = [tuple(v.aval.shape) for e in every if e.primitive.name == "scan" for v in e.invars]
    assert stacks and bool(stacks & set(scanned)) is not unrolled  # the embedding's own scan stays either way


def test_the_deterministic_step_copies_no_gradient_for_its_norm_and_tests_none_unscaled():
    """The canonical norm's chunk loop reads the gradients in place (opaque_map's spare row only for a loop of one:
    for any count it had copied every gradient each step) and, with no loss scaling, nothing tests every gradient
    for finiteness (only loss scaling reads it)."""
    from bench.experiments.step_primitives import elements, equations, step_jaxpr, where_made

    eqns = list(equations(step_jaxpr(str(ROOT / "specs/llama_tiny.yaml"), ["parallel.deterministic=true"])))
    copied = [e for e in eqns if e.primitive.name == "concatenate" and "shard_loop" in where_made(e)
              and elements(e) > 1024]
    tested = [e for e in eqns if e.primitive.name == "is_finite" and "all_finite_of" in where_made(e)]
    assert any("opaque_map" in where_made(e) for e in eqns)  # the chunk loops are there
    assert not copied and not tested
    scaled = list(equations(step_jaxpr(str(ROOT / "specs/llama_tiny.yaml"),
                                       ["parallel.deterministic=true", "numerics.loss_scale=dynamic"])))
    assert any(e.primitive.name == "is_finite" and "all_finite_of" in where_made(e) for e in scaled)


def test_the_layer_scan_indexes_its_periods_weights_not_splits_them():
    """GPT-OSS's period of two layers reads each layer's weights from the scanned [2, ...] slice by indexing: the
    index's gradient fuses into the scan's accumulators, where a split's (a concatenation) was a buffer of its own
    (GPT-OSS-20B's two layers: +6.1 GiB, out of memory on one H100 in deterministic mode). C = 2: the layer scan
    (under UNROLL_FROM)."""
    import jax.extend

    from bench.experiments.step_primitives import equations, step_jaxpr

    jaxpr = step_jaxpr(str(ROOT / "specs/gpt_oss_tiny.yaml"),
                       ["parallel.deterministic=true", "task.batch=2", "parallel.canonical_shards=2"])
    scans = [e for e in equations(jaxpr) if e.primitive.name == "scan"]
    periods = {tuple(v.aval.shape[1:]) for s in scans for v in s.invars if v.aval.ndim >= 3 and v.aval.shape[1] == 2}
    bodies = [e for s in scans for sub in jax.extend.core.jaxprs_in_params(s.params) for e in equations(sub)]
    assert periods and bodies  # the layer scan over its period's [2, ...] weights is there
    split = [e for e in bodies if e.primitive.name == "split" and tuple(e.invars[0].aval.shape) in periods]
    assert not split


@pytest.mark.parametrize("shards", [2, 4])
def test_two_shards_are_branches_of_their_own_more_are_stacked_in_the_loop(shards):
    """A device's two canonical shards each run as a conditional's branch (shard_loop.per_shard): their gradients
    are buffers of their own, no [2, ...] stack written (one H100, GPT-OSS-20B's two layers: 146.2 against 154.5 ms
    a step, session 39); four run in the loop, their gradients stacked and tree-summed."""
    from bench.experiments.step_primitives import equations, step_jaxpr
    from tessera.lower.program import compile_experiment

    over = ["parallel.deterministic=true", f"task.batch={shards}", f"parallel.canonical_shards={shards}"]
    shapes = {(shards, *v.shape) for v in compile_experiment(
        load_experiment(ROOT / "specs/llama_tiny.yaml", [*over])).param_shapes().values()}
    stacked = [e for e in equations(step_jaxpr(str(ROOT / "specs/llama_tiny.yaml"), over))
               if e.primitive.name == "dynamic_update_slice" and tuple(e.outvars[0].aval.shape) in shapes]
    assert bool(stacked) is (shards == 4)
