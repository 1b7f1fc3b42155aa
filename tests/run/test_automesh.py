"""`mesh: auto`: the fewest model-parallel devices whose plan fits, the rest data parallel; explicit meshes win."""

from __future__ import annotations

import pytest

from tessera.diagnostics import RunError, TesseraError
from tessera.run.automesh import choose_mesh
from tessera.run.plan import DEVICES
from tessera.spec import load_experiment

SPECS = "specs/"
H100, L40S = 0.95 * DEVICES["h100"].memory, 0.95 * DEVICES["l40s"].memory


@pytest.fixture(scope="module")
def big():
    return load_experiment(SPECS + "gpt_oss_120b.yaml")


def _axes(choice) -> dict:
    return {a: n for a, n in choice.exp.mesh.axes.items() if n > 1}


def test_the_headline_asks_for_auto(big):
    assert big.mesh.auto and big.mesh.size == 1


@pytest.mark.parametrize("devices,memory,axes,idle", [
    (1, H100, {}, 0),             # 60.8 GiB of weights fit one 80 GB card at 95 %
    (8, H100, {}, 7),             # ... so on an 8-GPU host too: one prompt splits over no replicas
    (8, L40S, {"tp": 2}, 6),      # 48 GB cards: tensor parallel over two
    (8, 0.25 * H100, {"tp": 4}, 4),
])
def test_fewest_model_parallel_devices_that_fit(big, devices, memory, axes, idle):
    choice = choose_mesh(big, devices, memory)
    assert _axes(choice) == axes and choice.exp.mesh.auto  # chosen axes, recorded beside auto
    assert choice.planned_bytes <= memory
    assert (f"{idle} of {devices} devices idle" in choice.reason) == bool(idle)
    rec = choice.record()
    assert rec["mesh"] == (axes or {"devices": 1}) and rec["devices_present"] == devices


def test_one_fewer_model_parallel_device_would_not_fit(big):
    choice = choose_mesh(big, 8, L40S)
    assert choose_mesh(big, 1, 1e15).planned_bytes > L40S  # tp=1's plan: over the card, so tp=2 it is
    assert choice.planned_bytes < L40S


def test_the_rest_is_data_parallel():
    exp = load_experiment(SPECS + "llama_tiny.yaml", overrides={"task.batch": 12})
    choice = choose_mesh(exp, 8, H100)
    assert _axes(choice) == {"dp": 4} and "dp=4 replicas" in choice.reason  # 12 rows split 4 ways, not 8
    assert "4 of 8 devices idle" in choice.reason


def test_nothing_fits(big):
    with pytest.raises(RunError, match=r"no mesh of 2 device\(s\).*smallest plan is .* with tp=2"):
        choose_mesh(big, 2, 10e9)


def test_an_explicit_axis_wins_over_auto():
    exp = load_experiment(SPECS + "gpt_oss_120b.yaml", overrides=["mesh.tp=1"])
    assert not exp.mesh.auto and exp.mesh.size == 1
    exp = load_experiment(SPECS + "gpt_oss_120b.yaml", overrides=["mesh.tp=8"])
    assert not exp.mesh.auto and exp.mesh.tp == 8
    exp = load_experiment(SPECS + "gpt_oss_20b.yaml", overrides=["mesh=auto"])
    assert exp.mesh.auto


def test_a_misspelt_auto_is_an_error_at_its_place():
    with pytest.raises(TesseraError) as info:
        load_experiment(SPECS + "gpt_oss_20b.yaml", overrides=["mesh=atuo"])
    text = info.value.render()
    assert "<--set>:1:6" in text and "neither `auto` nor a mapping" in text
