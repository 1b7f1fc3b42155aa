"""train_variants' reading of a compiled step: custom calls and standalone copies, outside fusions only."""

from __future__ import annotations

from bench.experiments.train_variants import hlo_calls, hlo_transposes

HLO = r'''HloModule step

%fused_copy (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(%p)
}

ENTRY %main (a: f8e4m3fn[16,8,4], i: s32[]) -> bf16[8,8] {
  %a = f8e4m3fn[16,8,4]{2,1,0} parameter(0)
  %ds = f8e4m3fn[1,8,4]{2,1,0} dynamic-slice(%a, %i, %z, %z), dynamic_slice_sizes={1,8,4}
  %gemm = (bf16[8,8]{1,0}, s8[1024]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{}}
  %k = f32[8]{0} custom-call(%x), custom_call_target="mosaic_gpu_v2", backend_config={"name":"_forward_kernel"}
  %tr = f32[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/transpose(jvp(layers))/mlp/pallas_call" source_file="x.py"}
  %t = f8e5m2[8,16]{1,0} transpose(%g), dimensions={1,0}
  %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_copy
  ROOT %cp = bf16[8,8]{1,0} copy(%g)
}
'''


def test_custom_calls_and_copies_are_counted_outside_fusions():
    calls, moves = hlo_calls(HLO)
    assert calls == {("__cublas$lt$matmul$f8", ""): 1, ("mosaic_gpu_v2", "_forward_kernel"): 1,
                     ("__gpu$xla.gpu.triton", "mlp/pallas_call"): 1}
    assert moves == {"dynamic-slice": (1, 32), "copy": (1, 128)}  # the fusion's copy is not one of its own
    assert hlo_transposes(HLO) == {"f8e5m2": (1, 128)}


def test_layers_unrolled_trains_as_the_scan_does():
    """The unrolled variant runs every layer (the layers' scan gone from the step's jaxpr) and trains a tiny Llama in fast mode
    as the scan does: the same losses and parameters to fp32 rounding."""
    import jax
    import numpy as np

    from bench.experiments.lowering_variants import layers_unrolled, patched
    from tessera.lower import interpret, program
    from tessera.lower.program import compile_experiment
    from tessera.run.optim import build_optimizer, current_lr
    from tessera.spec import load_experiment

    exp = load_experiment("specs/llama_tiny.yaml", ["parallel.deterministic=false", "task.batch=2", "task.seq_len=16"])
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16), dtype=np.int32)
    batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "mask": np.ones((2, 16), np.float32)}
    runs = {}
    for name, patches in (("scan", []), ("unrolled", [(interpret, "eval_repeat", layers_unrolled)])):
        with patched(patches):
            program._PROGRAMS.clear()
            prog = compile_experiment(exp, optimizer=build_optimizer(exp), lr_fn=current_lr)
            state = prog.init_train_state(prog.init(0))
            jaxpr = str(jax.make_jaxpr(lambda s: prog.train_step(s, batch))(state))
            losses = []
            for _ in range(2):
                state, metrics = prog.train_step(state, batch)
                losses.append(float(metrics["loss"]))
            runs[name] = (jaxpr.count(" scan["), losses, jax.tree.leaves(state))
    program._PROGRAMS.clear()
    assert runs["unrolled"][0] < runs["scan"][0]
    np.testing.assert_allclose(runs["unrolled"][1], runs["scan"][1], rtol=1e-6)
    for a, b in zip(runs["unrolled"][2], runs["scan"][2]):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-6)
