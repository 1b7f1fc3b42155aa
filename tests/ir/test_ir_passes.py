"""Pass tests written as IR text: tests/data/ir/passes/<pass>_<case>.in.ir → <pass>_<case>.out.ir.

Also: a Llama written in primitives is fused back into the composite ops and equals models/llama.tsl.
"""

import pytest

from tessera.diagnostics import TesseraError
from tessera.ir import build_graph, parse_graph, print_graph, verify
from tessera.ir.passes import PassContext, run_pass, run_pipeline
from tests.ir.conftest import DATA, LLAMA, MODELS, POLICY

CASES = sorted(p.name[: -len(".in.ir")] for p in (DATA / "passes").glob("*.in.ir"))


def test_every_pass_has_a_case():
    assert {c.split("_")[0] for c in CASES} == {"canonicalize", "decompose", "fuse", "numerics"}


@pytest.mark.parametrize("case", CASES)
def test_pass_case(case):
    src = DATA / "passes" / f"{case}.in.ir"
    expected = (DATA / "passes" / f"{case}.out.ir").read_text()
    graph = verify(parse_graph(src.read_text(), str(src)))
    out = run_pass(case.split("_")[0], graph, PassContext(numerics=POLICY))
    assert print_graph(out) == expected
    assert print_graph(graph) == print_graph(parse_graph(src.read_text()))  # passes do not mutate their input


def test_decomposed_moe_fuses_back():
    src = (DATA / "passes" / "decompose_moe.in.ir").read_text()
    decomposed = parse_graph((DATA / "passes" / "decompose_moe.out.ir").read_text())
    assert print_graph(run_pass("fuse", decomposed)) == print_graph(parse_graph(src))


def test_decomposed_attention_fuses_back():
    src = (DATA / "passes" / "decompose_attention.in.ir").read_text()
    decomposed = parse_graph((DATA / "passes" / "decompose_attention.out.ir").read_text())
    assert print_graph(run_pass("fuse", decomposed)) == print_graph(parse_graph(src))


@pytest.mark.parametrize("tied", [False, True])
def test_primitive_llama_fuses_into_the_composite_graph(tied):
    args = {**LLAMA, "tie_embeddings": tied}
    composite = build_graph(MODELS / "llama.tsl", args)
    primitive = build_graph(DATA / "llama_primitive.tsl", args)
    names = {op.name for op in primitive.walk()}
    assert "attention" not in names and {"dot", "softmax", "mask"} <= names
    assert print_graph(run_pipeline(primitive, "fuse")) == print_graph(run_pipeline(composite, "fuse"))
    # already after decompose the two are the same primitives in the same order
    assert run_pipeline(primitive, "decompose") == run_pipeline(composite, "decompose")


def test_unknown_pass_is_a_diagnostic():
    g = build_graph(MODELS / "llama.tsl", LLAMA)
    with pytest.raises(TesseraError, match=r"unknown pass `fusee`; did you mean `fuse`\?"):
        run_pipeline(g, "fusee")
