"""Property test: whatever a valid spec is mutated into, the loader answers with success or a clean TesseraError."""

from __future__ import annotations

import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.diagnostics import TesseraError
from tessera.spec import load_experiment

from .conftest import VALID

# Fragments a mutation may splice in: YAML syntax, odd scalars, keys that exist elsewhere, hostile bits.
FRAGMENTS = [":", "- ", "[", "]", "{", "}", "\t", "&a ", "*a", "!!str ", "!!python/object ", "'", '"', "#", "\n",
             "  ", "1e-3", "yes", "1:30", "-1", "0", "null", "~", "true", "3.5", ".inf", "kind", "tp", "mesh",
             "bf16 @accum(", "mxfp4", "extends: x.yaml", "task:", "<<: *a", "? ", "%YAML 1.1\n", "---\n", "\x00",
             "[[[[[[", "@scale(per_block(0))", "steps", "microbatches", "é"]


@st.composite
def mutated(draw: st.DrawFn) -> str:
    text = VALID
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace", "swap_lines"]))
        frag = draw(st.sampled_from(FRAGMENTS) | st.text(max_size=4))
        if op == "insert":
            text = text[:pos] + frag + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 8)):]
        elif op == "replace":
            text = text[:pos] + frag + text[pos + len(frag):]
        else:
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=mutated(), overrides=st.lists(st.sampled_from(
    ["mesh.tp=2", "task.steps=0", "task.kind=bench", "numerics.default=bf17", "a..b=1", "x", "task=[1",
     "model.args.heads=3", "parallel.rules.heads=null"]), max_size=2))
def test_mutated_specs_fail_cleanly(spec_dir: Path, text: str, overrides: list[str]) -> None:
    path = spec_dir / "mutated.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_experiment(path, overrides=overrides)
    except TesseraError as exc:
        assert exc.diagnostics, "a TesseraError must carry at least one diagnostic"
        for d in exc.diagnostics:
            text = d.render()  # rendering never fails either
            assert d.message and "Traceback" not in text
            if d.span is not None:
                assert d.span.line >= 1 and d.span.col >= 1


def test_random_byte_soup_fails_cleanly(spec_dir: Path) -> None:
    rng = random.Random(0)
    for _ in range(50):
        path = spec_dir / "soup.yaml"
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        try:
            load_experiment(path)
        except TesseraError as exc:
            assert exc.diagnostics
