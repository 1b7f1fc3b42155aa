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

