"""Training under every mesh the issue names: bit-identical to one device in deterministic mode, within
1e-5 relative otherwise; greedy generation under tensor parallelism gives the single-device tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.lower.shard.conftest import assert_trained_close, finish_jobs, start_jobs

pytestmark = pytest.mark.slow  # compiles on 8 devices: scheduled first (tests/conftest.py)

GPT_OSS, LLAMA = "specs/gpt_oss_tiny.yaml", "specs/llama_tiny.yaml"
MESHES = {
    "dp=8": {"mesh.dp": 8},
    "fsdp=8": {"mesh.fsdp": 8},
    "tp=4,dp=2": {"mesh.tp": 4, "mesh.dp": 2},
    "ep=4,dp=2": {"mesh.ep": 4, "mesh.dp": 2},
    "pp=2,tp=2,dp=2": {"mesh.pp": 2, "mesh.tp": 2, "mesh.dp": 2},
    "sp+tp=2,dp=4": {"mesh.tp": 2, "mesh.dp": 4, "parallel.sequence_parallel": True},
    "fsdp=2,tp=2,ep=2": {"mesh.fsdp": 2, "mesh.tp": 2, "mesh.ep": 2},
    "fsdp=2,tp=2": {"mesh.fsdp": 2, "mesh.tp": 2},
}
# Each compile costs ~10-20 s of CPU, so the matrix is chosen per what a mesh changes. Deterministic mode
# computes every mesh the same way (all axes share canonical shards; parameters gathered), so it runs the
# meshes that split parameters differently: embed+heads+experts (fsdp×tp×ep), layers (pp); on 8 devices
# each holds one canonical shard, the loop-of-one case; fsdp=2,tp=2 (4 of the 8 devices) runs two shards a device,
# interleaved (device d shards d and 4 + d: tessera/lower/shard/layerwise.py), each iteration's gradients summed over
# the devices inside the step's per-layer gathers. (The full issue matrix was measured once: docs/parallel.md.)
# Fast mode runs every mesh whose lowering differs; llama adds its own paths (tied vocab-parallel unembedding).
# fsdp=2,tp=2,ep=2 holds the three parameter-splitting axes in one program (fsdp gathers, tp's head/mlp/vocab
# partial sums, ep's all_to_all beside a data axis), sp+tp=2,dp=4 sequence parallelism; tp alone runs as llama's
# tp=4,dp=2 here in both modes. Fast mode on the meshes the other files train on is not repeated here (each
# costs ~20 s of CPU): ep=4 by itself (ep=4,dp=2, batch over ep) and with a capacity in test_expert_dispatch.py,
# pp=2,tp=2,dp=2 (GPipe, the default schedule) against 1F1B and one device in test_pipeline_1f1b.py.
# pp=2,tp=2,dp=2 runs both ways in deterministic mode: llama's 4 layers as 2 stages of 2 (the layers' compute split
# over pp: tessera/lower/shard/det_pipeline.py), gpt_oss's as pp acting as a data axis (its layers' scan runs one step
# a stage at this size, too few for the pipelined step).
DET_MESHES = {"gpt_oss": ("fsdp=2,tp=2,ep=2", "pp=2,tp=2,dp=2", "fsdp=2,tp=2"), "llama": ("tp=4,dp=2", "pp=2,tp=2,dp=2")}
FAST_MESHES = {"gpt_oss": ("sp+tp=2,dp=4", "fsdp=2,tp=2,ep=2"), "llama": ("tp=4,dp=2",)}
STEPS = 2


def _train_jobs(spec: str, meshes, det: bool) -> list[dict]:
    return [{"kind": "train", "spec": spec, "steps": STEPS, "name": name, "det": det,
             "overrides": {"parallel.deterministic": det, **MESHES.get(name, {})}}
            for name in ("1 device",) + tuple(meshes)]


def _gen_jobs(spec: str) -> list[dict]:
    # the reference splits stacked weights inside the program; the meshes get them split as made (the generate
    # task's way); `mesh: auto`'s choice of tp=2 on 2 of the 8 devices (a batch it does not split) runs there
    # pp=2×tp=2×dp=2 from the stacked parameters training leaves, split over pp (its post-training sample
    # once crashed: the layers were never gathered over pp)
    meshes = {"1 device": {}, "tp=4,dp=2": {**MESHES["tp=4,dp=2"], "split_layers": True},
              "auto: tp=2 of 8": {"mesh.auto": True, "mesh.tp": 2, "split_layers": True},
              "pp=2,tp=2,dp=2": MESHES["pp=2,tp=2,dp=2"]}
    return [{"kind": "generate", "spec": spec, "steps": 6, "name": n,
             "overrides": {"parallel.deterministic": False, **o}} for n, o in meshes.items()]


# past the default's 8 canonical shards: 16 of them (parallel.canonical_shards), one device against 16, with the
# parameters split over fsdp (gathered whole for each shard) and the gradients summed over two axes
WIDE = {"parallel.canonical_shards": 16, "task.batch": 16}


# fp8 compute with delayed scaling, deterministic, on a mesh: its loss was NaN until the per-layer step's remat policy
# stopped saving fp8 values (tessera/lower/shard/layerwise.py `saveable_but_gathers`)
FP8 = {"numerics.default": "fp8_e4m3 @scale(delayed(4)) @accum(fp32)"}


def _fp8_jobs() -> list[dict]:
    return [{"kind": "train", "spec": LLAMA, "steps": 3, "name": f"fp8 {name}", "det": True,
             "overrides": {"parallel.deterministic": True, **FP8, **mesh}}
            for name, mesh in (("1 device", {}), ("fsdp=4,dp=2", {"mesh.fsdp": 4, "mesh.dp": 2}),
                               ("pp=2,tp=2,dp=2", MESHES["pp=2,tp=2,dp=2"]))]


# bf16 through the pipelined pp step: one device's bits only since both compute a shard's loss as fenced(embed) |
# layers | fenced(head) (det_pipeline.pieces); before, the stages drifted from one device within a few steps. With
# canonical_tp, tp splits each stage's attention and MLP compute as well (det_pipeline.pipelined_grads' `tensor`)
def _bf16_pp_jobs() -> list[dict]:
    return [{"kind": "train", "spec": LLAMA, "steps": 3, "name": f"bf16 {name}", "det": True,
             "overrides": {"parallel.deterministic": True, "numerics.default": "bf16", "parallel.canonical_tp": 2,
                           **mesh}}
            for name, mesh in (("1 device", {}), ("pp=2,tp=2,dp=2", MESHES["pp=2,tp=2,dp=2"]))]


# deterministic tp splitting the attention and MLP compute (parallel.canonical_tp: tessera/lower/shard/det_tensor.py):
# gpt_oss (sinks, biases, windows, experts beside a tp split) in bf16 over tp=2 with ep and fsdp, one device's bits
TP = {"parallel.deterministic": True, "parallel.canonical_tp": 2, "numerics.default": "bf16 @accum(fp32)"}


# and, with deterministic ep splitting the experts' compute as well (parallel.canonical_ep:
# tessera/lower/shard/det_expert.py), each expert chunk's hidden dim in tp's chunks inside it
EP = {**TP, "parallel.canonical_ep": 2}


def _tp_jobs() -> list[dict]:
    return [{"kind": "train", "spec": GPT_OSS, "steps": 3, "name": f"canonical {kind} {name}", "det": True,
             "overrides": {**over, **mesh}}
            for kind, over in (("tp", TP), ("tp+ep", EP))
            for name, mesh in (("1 device", {}), ("fsdp=2,tp=2,ep=2", MESHES["fsdp=2,tp=2,ep=2"]))]


# four canonical shards on one device, in the shard loop (their gradients stacked, then tree-summed), against dp=2,
# where each device's two shards run as conditionals' branches (shard_loop.per_shard) and the devices' sums meet in
# `ordered_sum`; bf16 (the shard gradients narrow, widened before the adds). One shard a device (a branch) against
# the loop: the 8-device meshes of C = 8 above.
def _four_shard_jobs() -> list[dict]:
    return [{"kind": "train", "spec": LLAMA, "steps": 3, "name": f"C=4 {name}", "det": True,
             "overrides": {"parallel.deterministic": True, "parallel.canonical_shards": 4, "numerics.default": "bf16",
                           **mesh}}
            for name, mesh in (("1 device", {}), ("dp=2", {"mesh.dp": 2}))]


def _wide_jobs() -> list[dict]:
    return [{"kind": "train", "spec": LLAMA, "steps": STEPS, "name": f"C=16 {name}", "det": True,
             "overrides": {"parallel.deterministic": True, **WIDE, **mesh}}
            for name, mesh in (("1 device", {}), ("fsdp=4,tp=4", {"mesh.fsdp": 4, "mesh.tp": 4}))]


@pytest.fixture(scope="module")
def results():
    """{(model, kind, det, mesh): result}: two 8-device subprocesses and a 16-device one side by side."""
    plans = {"deterministic": _train_jobs(GPT_OSS, DET_MESHES["gpt_oss"], True)
             + _train_jobs(LLAMA, DET_MESHES["llama"], True) + _tp_jobs(),  # ~100 s of CPU each
             "fast": _train_jobs(LLAMA, FAST_MESHES["llama"], False)
             + _train_jobs(GPT_OSS, FAST_MESHES["gpt_oss"], False) + _gen_jobs(GPT_OSS),
             "wide": _wide_jobs() + _fp8_jobs() + _bf16_pp_jobs() + _four_shard_jobs()}
    procs = {model: start_jobs(jobs, devices=16 if model == "wide" else 8) for model, jobs in plans.items()}
    out = {}
    for model, proc in procs.items():
        for job, res in zip(plans[model], finish_jobs(proc)):
            name = "llama" if job["spec"] == LLAMA else "gpt_oss"
            out[(name, job["kind"], job.get("det"), job["name"])] = res
    return out


DET_CASES = [(model, m) for model, meshes in DET_MESHES.items() for m in meshes]
FAST_CASES = [(model, m) for model, meshes in FAST_MESHES.items() for m in meshes]


@pytest.mark.parametrize("model,mesh", DET_CASES)
def test_deterministic_is_bit_identical(results, model, mesh):
    ref, got = results[(model, "train", True, "1 device")], results[(model, "train", True, mesh)]
    assert got["deterministic"] is True
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert got["checksum"] == ref["checksum"]


def test_deterministic_pp_splits_the_layers_where_the_stages_allow(results):
    """llama's 4 layers in 2 stages of 2 scan steps: the pipelined step (bit-identical above); gpt_oss's period-2
    layers give stages of one scan step: pp acts as a data axis, and the record says why."""
    llama, gpt_oss = results[("llama", "train", True, "pp=2,tp=2,dp=2")], results[("gpt_oss", "train", True,
                                                                                    "pp=2,tp=2,dp=2")]
    assert llama["pipeline"] == {"stages": 2, "split_compute": True, "why_not": None}
    assert gpt_oss["pipeline"]["split_compute"] is False
    assert gpt_oss["pipeline"]["why_not"].startswith("stages of 2 layer(s) run the layers' scan 1 step(s)")
    assert results[("llama", "train", True, "1 device")]["pipeline"] is None


def test_bf16_through_the_pipelined_pp_step_is_bit_identical_to_one_device(results):
    ref, got = results[("llama", "train", True, "bf16 1 device")], results[("llama", "train", True,
                                                                           "bf16 pp=2,tp=2,dp=2")]
    assert got["pipeline"]["split_compute"] is True  # pp splits the layers, tp each stage's heads and hidden dims
    assert got["tensor"] == {"tp": 2, "split_compute": True, "why_not": None}
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert got["checksum"] == ref["checksum"] and got["state"] == ref["state"]


@pytest.mark.parametrize("mesh", ["fsdp=4,dp=2", "pp=2,tp=2,dp=2"])  # the latter through the pipelined step
def test_fp8_delayed_scaling_on_a_mesh_is_bit_identical_to_one_device(results, mesh):
    ref, got = results[("llama", "train", True, "fp8 1 device")], results[("llama", "train", True, f"fp8 {mesh}")]
    assert all(np.isfinite(ref["losses"])) and ref["losses"][0] != ref["losses"][-1]
    assert (got["pipeline"] or {}).get("split_compute", False) == mesh.startswith("pp")
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert got["checksum"] == ref["checksum"] and got["state"] == ref["state"]  # the amax histories included


def test_sixteen_canonical_shards_on_sixteen_devices_are_bit_identical_to_one_device(results):
    ref, got = results[("llama", "train", True, "C=16 1 device")], results[("llama", "train", True, "C=16 fsdp=4,tp=4")]
    assert got["deterministic"] is True and got["losses"][0] != got["losses"][1]
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert got["checksum"] == ref["checksum"] and got["state"] == ref["state"]


def test_the_shard_loop_and_branched_shards_give_the_same_bits(results):
    ref, got = results[("llama", "train", True, "C=4 dp=2")], results[("llama", "train", True, "C=4 1 device")]
    assert got["losses"][0] != got["losses"][-1]
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert got["checksum"] == ref["checksum"] and got["state"] == ref["state"]


@pytest.mark.parametrize("model,mesh", DET_CASES)
def test_a_mesh_device_holds_one_summed_gradient_not_every_shards(results, model, mesh):
    """On 8 devices each runs one canonical shard of 8 and its gradient is summed with the others' in the canonical
    tree by an all-to-all of chunks (lower/shard/deterministic.py `ordered_sum`), so a device's step needs less
    memory than one device's, which keeps its 8 shards' gradients for the tree. Gathering every shard's gradient to
    every device took more (temporaries, quick compile: llama tp=4,dp=2 2.07 MB against 1.66 on one device, now
    1.04; gpt_oss fsdp=2,tp=2,ep=2 4.70 against 3.66, now 2.34)."""
    one, got = results[(model, "train", True, "1 device")], results[(model, "train", True, mesh)]
    assert got["temp"] < 0.8 * one["temp"], (got["temp"], one["temp"])


@pytest.mark.parametrize("model,mesh", FAST_CASES)
def test_fast_mode_agrees_within_1e5(results, model, mesh):
    ref, got = results[(model, "train", False, "1 device")], results[(model, "train", False, mesh)]
    assert got["deterministic"] is False and got["collectives"]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trained_close(got["params"], ref["params"])


def test_training_moves_the_parameters(results):
    a, b = results[("gpt_oss", "train", True, "1 device")], results[("gpt_oss", "train", False, "1 device")]
    assert a["losses"][0] == pytest.approx(b["losses"][0], rel=1e-6)  # same model, same first batch
    assert a["losses"][1] != a["losses"][0]


@pytest.mark.parametrize("mesh,devices", [("tp=4,dp=2", list(range(8))), ("auto: tp=2 of 8", [0, 1]),
                                          ("pp=2,tp=2,dp=2", list(range(8)))])
def test_generation_under_tp_matches_one_device(results, mesh, devices):
    ref, got = results[("gpt_oss", "generate", None, "1 device")], results[("gpt_oss", "generate", None, mesh)]
    assert np.asarray(got["tokens"]).shape == (4, 11)
    assert got["tokens"] == ref["tokens"]
    assert got["devices"] == devices


def test_fast_mode_names_its_collectives(results):
    got = results[("gpt_oss", "train", False, "fsdp=2,tp=2,ep=2")]["collectives"]
    assert any(c.startswith("all_gather(params over fsdp)") for c in got)
    assert "psum(heads partials over tp)" in got and "all_to_all(expert dispatch and return over ep)" in got
    sp = results[("gpt_oss", "train", False, "sp+tp=2,dp=4")]["collectives"]
    assert "psum_scatter(heads partials over tp)" in sp and "all_gather(seq over tp)" in sp


def test_deterministic_tp_splits_the_layers_compute_with_one_devices_bits(results):
    ref = results[("gpt_oss", "train", True, "canonical tp 1 device")]
    got = results[("gpt_oss", "train", True, "canonical tp fsdp=2,tp=2,ep=2")]
    assert got["tensor"] == {"tp": 2, "split_compute": True, "why_not": None} and ref["tensor"] is None
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"] and got["checksum"] == ref["checksum"]
    plain = results[("gpt_oss", "train", True, "1 device")]  # the chunks change the one-device numbers
    assert got["checksum"] != plain["checksum"]
    assert np.allclose(got["losses"][:STEPS], plain["losses"], rtol=1e-2)  # bf16 beside fp32
    # without canonical_tp, tp stays a data axis, and says so
    assert results[("gpt_oss", "train", True, "fsdp=2,tp=2,ep=2")]["tensor"]["why_not"].startswith(
        "parallel.canonical_tp is not set")


def test_deterministic_tp_and_ep_split_the_compute_together_with_one_devices_bits(results):
    """canonical_tp and canonical_ep: attention and MLP by tp's chunks, the experts by ep's chunks and each expert
    chunk's hidden dim by tp's inside it, on fsdp=2 x tp=2 x ep=2: one device's bits."""
    ref = results[("gpt_oss", "train", True, "canonical tp+ep 1 device")]
    got = results[("gpt_oss", "train", True, "canonical tp+ep fsdp=2,tp=2,ep=2")]
    assert got["experts"] == {"ep": 2, "split_compute": True, "why_not": None} and ref["experts"] is None
    assert got["tensor"] == {"tp": 2, "split_compute": True, "why_not": None}
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"] and got["checksum"] == ref["checksum"]
    assert got["checksum"] != results[("gpt_oss", "train", True, "canonical tp 1 device")]["checksum"]
    # with canonical_tp alone, ep stays a data axis, and says so
    alone = results[("gpt_oss", "train", True, "canonical tp fsdp=2,tp=2,ep=2")]["experts"]
    assert alone["split_compute"] is False and alone["why_not"].startswith("parallel.canonical_ep is not set")
    assert got["checksum"] != results[("gpt_oss", "train", True, "canonical tp 1 device")]["checksum"]
