"""Weights split into layers for generation: made one layer at a time, bitwise the stacked ones, held once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.lower.program import compile_experiment
from tessera.run.manifest import params_checksum
from tessera.spec import load_experiment

SPEC = "specs/gpt_oss_tiny.yaml"
# MXFP4 experts (the 120b's storage), four layers, a generate task
GENERATE = {"model.args.layers": 4, "numerics.rules": {"*/moe/experts/*": "mxfp4", "*/moe/experts/*_bias": "fp32"},
            "task.kind": "generate", "task.prompts": [[1, 2, 3]], "task.max_new_tokens": 8}


@pytest.fixture(scope="module")
def prog():
    return compile_experiment(load_experiment(SPEC, overrides=GENERATE))


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_split_init_is_the_stacked_init_layer_by_layer(prog):
    stacked, split = prog.init(3), prog.init(3, split_layers=True)
    assert set(split) == set(stacked) and set(prog.stacked()) == {p for p in split if isinstance(split[p], list)}
    assert all(len(split[p]) == 4 for p in prog.stacked())
    for path, value in split.items():
        whole = jax.tree.map(lambda *xs: jnp.stack(xs), *value) if isinstance(value, list) else value
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(stacked[path])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    assert params_checksum(split) == params_checksum(stacked)  # the manifest's checksum does not see the layout
    assert params_checksum(prog.init(4, split_layers=True)) != params_checksum(split)


def test_split_init_peak_is_params_plus_one_layer(prog):
    shapes = prog.param_shapes(split_layers=True)
    total = _bytes(shapes)
    one_layer = sum(_bytes(v[0]) for v in shapes.values() if isinstance(v, list))
    before = {id(x) for x in jax.live_arrays()}
    live = []
    params = prog.init(5, split_layers=True,
                       on_layer=lambda i: live.append(sum(x.nbytes for x in jax.live_arrays() if id(x) not in before)))
    assert len(live) == 4 and _bytes(params) == total
    # after layer i: the shared params and i + 1 layers (and the 4-byte seed), nothing stacked nor a second copy
    shared = total - 4 * one_layer
    assert live == [shared + (i + 1) * one_layer + 4 for i in range(4)]


def _temp(prog, params, new: int) -> float:
    prompts = jax.ShapeDtypeStruct((1, 3), jnp.int32)
    fn = jax.jit(prog.generate_fn(params, prompts.shape[0], new, prog_rule()))
    return fn.lower(params, prompts, jax.ShapeDtypeStruct((), jnp.uint32),
                    jax.ShapeDtypeStruct((), jnp.int32)).compile().memory_analysis().temp_size_in_bytes


def prog_rule():
    from tessera.lower.sampling import SamplingRule

    return SamplingRule(0.0, None, None)


def test_generation_from_split_weights_holds_them_once():
    # plain fp32 weights: the CPU reference dequantises MXFP4 ones, and XLA hoists that out of the token loop
    prog = compile_experiment(load_experiment(SPEC, overrides={**GENERATE, "numerics.rules": {}}))
    stacked, split = prog.param_shapes(), prog.param_shapes(split_layers=True)
    layers = sum(_bytes(v) for v in split.values() if isinstance(v, list))
    # from stacked weights the program copies every layer's slice before its token loop; from split ones it
    # reads them where they are. (XLA's CPU backend also re-lays out the expert and output matrices for its
    # dots, hoisted out of the token loop, in both programs: ~0.9x the layers here. Not on the GPU: the 120b
    # generating on one H100 peaked at 65.50 GB against the plan's 65.26 GB, weights 65.25 GB.)
    assert _temp(prog, stacked, 8) - _temp(prog, split, 8) >= layers


def test_one_generation_program_serves_every_length_up_to_its_capacity(prog):
    """The generate task times a full call and a one-token call (the first token's latency): one compile."""
    params = prog.init(0, split_layers=True)
    prompts = np.asarray([[1, 2, 3], [4, 5, 6]], np.int32)
    full = np.asarray(prog.generate(params, prompts, max_new_tokens=8, temperature=0.7, seed=2))
    before = len(prog._cache)
    for n in (1, 3):
        part = np.asarray(prog.generate(params, prompts, max_new_tokens=n, temperature=0.7, seed=2, capacity=8))
        assert part.shape == (2, 3 + n)
        np.testing.assert_array_equal(part, full[:, :3 + n])  # the same tokens, the loop stopped early
    fn = prog._cache[prog.last_key]
    assert len(prog._cache) == before and fn.__wrapped__._cache_size() == 1
    assert not np.array_equal(full[:, 3:], np.zeros_like(full[:, 3:]))


def test_prefill_projects_only_the_last_position_onto_the_vocabulary(prog):
    """Generation samples from the prompt's last position: a long prompt's [batch, seq, vocab] logits (1.6 GB
    in fp32 for GPT-OSS-20B's 2,048 tokens) are never made; the tokens are those of the full forward."""
    params = prog.init(0, split_layers=True)
    prompts = np.random.default_rng(0).integers(1, prog.vocab, (2, 40)).astype(np.int32)
    fn = prog.generate_fn(params, 2, 4, prog_rule())
    text = str(jax.make_jaxpr(fn)(params, prompts, jnp.uint32(0), jnp.int32(4))).replace(" ", "")
    assert f"[2,40,{prog.vocab}]" not in text and f"[2,1,{prog.vocab}]" in text
    stacked = {k: jax.tree.map(lambda *xs: jnp.stack(xs), *v) if isinstance(v, list) else v for k, v in params.items()}
    want = np.asarray(prog.forward(stacked, prompts))[:, -1].argmax(-1)
    for capacity in (1, 4):  # a one-token program (no decode loop) and a longer one
        out = np.asarray(prog.generate(params, prompts, max_new_tokens=1, capacity=capacity))
        assert out.shape == (2, 41)
        np.testing.assert_array_equal(out[:, -1], want)


def test_init_draws_each_parameter_by_shared_programs_bitwise_the_whole_draw(prog):
    """`init` (a small program per kind of parameter) gives the bits of `init_fn` jitted as one program, MXFP4
    experts included; parameters of one kind share a program, and another seed compiles nothing new."""
    from tessera.lower import param_init

    as_bits = lambda x: np.asarray(x).view(np.uint8)  # noqa: E731
    each, whole = prog.init(5), jax.jit(prog.init_fn())(jnp.uint32(5))
    assert jax.tree.structure(each) == jax.tree.structure(whole)
    for a, b in zip(jax.tree.leaves(each), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(as_bits(a), as_bits(b))
    before = param_init._drawer.cache_info()
    again = prog.init(6)
    after = param_init._drawer.cache_info()
    assert after.misses == before.misses and after.hits - before.hits == len(prog.param_shapes())
    kinds = {(str(prog.graph.params[p].init), param_init._held_key(h), prog.stacked().get(p))
             for p, h in prog.param_shapes().items()}
    assert len(kinds) < len(prog.param_shapes())  # q/k/v/o-like shapes share
    assert params_checksum(again) != params_checksum(each)  # the seed is an argument, not baked in
