"""Spectral ops (tessera/ir/ops_spectral.py) against numpy.fft: forward, inverse, real, 2-D, mode truncation,
complex mode mixing, gradients by finite differences, FLOPs, IR round-trip and refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.ir import parse_graph, verify
from tessera.ir.flops import op_flops
from tessera.ir.printer import print_graph
from tessera.diagnostics import TesseraError
from tessera.lower.context import LowerCtx
from tessera.lower.interpret import eval_region


@pytest.fixture(autouse=True, scope="module")
def _x64():
    """The checks run in f64 (finite differences need it); the setting is restored for the next module."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def _graph(body: str, inputs: str, params: str = "") -> str:
    return f"graph g {{\n{inputs}{params}{body}}}\n"


def _run(text: str, args: list, params: dict | None = None):
    graph = verify(parse_graph(text))
    outs, _ = eval_region(graph.body, [jnp.asarray(a) for a in args], params or {}, LowerCtx())
    return graph, [np.asarray(o) for o in outs]


RNG = np.random.default_rng(0)


@pytest.mark.parametrize("norm", ["backward", "ortho", "forward"])
def test_real_transform_and_back_match_numpy(norm):
    x = RNG.standard_normal((3, 16, 5))
    text = _graph(f"""  %0 = rfft(%x) {{over = [space], norm = "{norm}", to = [freq]}} : c128[batch=3, freq=9, width=5]
  %1 = irfft(%0) {{over = [freq], norm = "{norm}", to = [space=16]}} : f64[batch=3, space=16, width=5]
  return %0, %1
""", "  input %x : f64[batch=3, space=16, width=5]\n")
    graph, (f, back) = _run(text, [x])
    np.testing.assert_allclose(f, np.fft.rfft(x, axis=1, norm=norm), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)  # the IR text round-trips


def test_complex_and_two_dimensional_transforms_match_numpy():
    x = RNG.standard_normal((2, 8, 6)) + 1j * RNG.standard_normal((2, 8, 6))
    text = _graph("""  %0 = fft(%x) {over = [h, w], norm = "backward", to = none} : c128[batch=2, h=8, w=6]
  %1 = ifft(%0) {over = [h], norm = "ortho", to = [kh]} : c128[batch=2, kh=8, w=6]
  %2 = rfft(%r) {over = [h, w], norm = "backward", to = [fh, fw]} : c128[batch=2, fh=8, fw=4]
  %3 = irfft(%2) {over = [fh, fw], norm = "backward", to = [h=8, w=6]} : f64[batch=2, h=8, w=6]
  %4 = real(%x) : f64[batch=2, h=8, w=6]
  %5 = imag(%x) : f64[batch=2, h=8, w=6]
  %6 = complex(%4, %5) : c128[batch=2, h=8, w=6]
  return %0, %1, %2, %3, %6
""", "  input %x : c128[batch=2, h=8, w=6]\n  input %r : f64[batch=2, h=8, w=6]\n")
    r = RNG.standard_normal((2, 8, 6))
    _, (f2, f1, rf2, back, same) = _run(text, [x, r])
    np.testing.assert_allclose(f2, np.fft.fftn(x, axes=(1, 2)), atol=1e-12)
    np.testing.assert_allclose(f1, np.fft.ifftn(np.fft.fftn(x, axes=(1, 2)), axes=(1,), norm="ortho"), atol=1e-12)
    np.testing.assert_allclose(rf2, np.fft.rfftn(r, axes=(1, 2)), atol=1e-12)
    np.testing.assert_allclose(back, r, atol=1e-12)
    np.testing.assert_array_equal(same, x)


SPECTRAL_CONV = _graph("""  %0 = rfft(%x) {over = [space], norm = "backward", to = [freq]} : c128[batch=2, freq=17, width=3]
  %1 = modes(%0) {dim = freq, keep = 5, to = kmodes} : c128[batch=2, kmodes=5, width=3]
  %2 = complex(%w_re, %w_im) : c128[kmodes=5, width=3, out=4]
  %3 = dot(%1, %2) {over = [width]} : c128[batch=2, kmodes=5, out=4]
  %4 = irfft(%3) {over = [kmodes], norm = "backward", to = [space=32]} : f64[batch=2, space=32, out=4]
  return %4
""", "  input %x : f64[batch=2, space=32, width=3]\n  input %w_re : f64[kmodes=5, width=3, out=4]\n"
                         "  input %w_im : f64[kmodes=5, width=3, out=4]\n")


def _conv_numpy(x, w):
    f = np.fft.rfft(x, axis=1)[:, :5]                       # the 5 lowest modes
    y = np.einsum("bkw,kwo->bko", f, w)                     # mixed per mode
    return np.fft.irfft(y, n=32, axis=1)                    # modes above 5 are zero


def test_a_spectral_convolution_matches_numpy_and_its_gradients_finite_differences():
    x = RNG.standard_normal((2, 32, 3))
    params = {"w_re": RNG.standard_normal((5, 3, 4)), "w_im": RNG.standard_normal((5, 3, 4))}
    graph, (y,) = _run(SPECTRAL_CONV, [x, params["w_re"], params["w_im"]])
    np.testing.assert_allclose(y, _conv_numpy(x, params["w_re"] + 1j * params["w_im"]), atol=1e-12)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)

    probe = RNG.standard_normal(y.shape)

    def loss(p, x):
        (out,), _ = eval_region(graph.body, [x, p["w_re"], p["w_im"]], {}, LowerCtx())
        return jnp.sum(out * probe)

    p = {k: jnp.asarray(v) for k, v in params.items()}
    grads = jax.grad(loss, argnums=(0, 1))(p, jnp.asarray(x))
    eps = 1e-6
    for name, index in [("w_re", (1, 2, 3)), ("w_im", (4, 0, 1)), ("w_im", (0, 1, 2))]:
        bump = np.zeros(params[name].shape)
        bump[index] = eps
        up = {**p, name: p[name] + bump}
        down = {**p, name: p[name] - bump}
        fd = (loss(up, x) - loss(down, x)) / (2 * eps)
        np.testing.assert_allclose(grads[0][name][index], fd, rtol=1e-6)
    bump = np.zeros(x.shape)
    bump[1, 7, 2] = eps
    fd = (loss(p, jnp.asarray(x + bump)) - loss(p, jnp.asarray(x - bump))) / (2 * eps)
    np.testing.assert_allclose(grads[1][1, 7, 2], fd, rtol=1e-6)


def test_flops_count_five_n_log_n_per_complex_transform_and_four_products_per_complex_product():
    graph = verify(parse_graph(SPECTRAL_CONV))
    ops = {op.name: op for op in graph.body.ops}
    sizes = {}
    assert op_flops(ops["rfft"], graph, sizes) == 2 * 3 * 0.5 * 5 * 32 * 5      # 6 real transforms of 32 points
    assert op_flops(ops["irfft"], graph, sizes) == 2 * 4 * 0.5 * 5 * 32 * 5     # 8 back to 32 points
    assert op_flops(ops["dot"], graph, sizes) == 4 * 2 * (2 * 5 * 4) * 3        # complex: 4 real products each


@pytest.mark.parametrize("line, message", [
    ("%0 = rfft(%b) {over = [space], norm = \"backward\", to = [freq]} : c64[batch=2, freq=9]",
     "XLA has no FFT in bf16"),
    ("%0 = fft(%x) {over = [space], norm = \"backward\", to = none} : c128[batch=2, space=16]",
     "operand must be complex"),
    ("%0 = rfft(%x) {over = [space], norm = \"sideways\", to = [freq]} : c128[batch=2, freq=9]",
     "norm must be one of"),
    ("%0 = rfft(%x) {over = [time], norm = \"backward\", to = [freq]} : c128[batch=2, freq=9]",
     "has no dimension `time`"),
    ("%0 = modes(%c) {dim = space, keep = 20, to = k} : c128[batch=2, k=20]", "keep 1 to 16"),
    ("%0 = irfft(%c) {over = [space], norm = \"backward\", to = [t=8]} : f64[batch=2, t=8]",
     "16 modes along `space` are more than 8 real points hold"),
    ("%0 = complex(%x, %b) : c128[batch=2, space=16]", "both be f32 or both f64"),
])
def test_misuse_is_refused_with_the_reason(line, message):
    text = _graph(f"  {line}\n  return %0\n", "  input %x : f64[batch=2, space=16]\n"
                  "  input %b : bf16[batch=2, space=16]\n  input %c : c128[batch=2, space=16]\n")
    with pytest.raises(TesseraError, match=message):
        verify(parse_graph(text))


def test_a_mesh_splitting_a_transformed_dim_is_refused_at_check():
    from tessera.ir.check import check_whole_dims
    from tessera.spec import load_experiment
    from tests.lower.shard.make_snapshots import ROOT

    graph = verify(parse_graph(_graph(
        "  %0 = rfft(%x) {over = [seq], norm = \"backward\", to = [freq]} : c64[batch, freq=9, embed=4]\n"
        "  return %0\n", "  input %x : f32[batch, seq=16, embed=4]\n")))
    spec = ROOT / "specs" / "llama_tiny.yaml"
    split = load_experiment(spec, overrides={"mesh.sp": 2, "mesh.dp": 2, "parallel.deterministic": False})
    (problem,) = check_whole_dims(split, graph)
    assert problem.key == "mesh.sp" and "`rfft` transforms `seq` whole on each device, but sp=2 splits" in \
        problem.message and problem.span is not None
    assert check_whole_dims(load_experiment(spec, overrides={"mesh.dp": 2}), graph) == []


CONV_LAYER = _graph("""  %0 = spectral_conv(%x, @fno/w_re, @fno/w_im) {over = space, modes = 5, channels = width} : f64[batch=2, space=32, width=3]
  return %0
""", "  input %x : f64[batch=2, space=32, width=3]\n",
                    "  param @fno/w_re : f64[modes=5, width=3, width_out=3] = normal(0.408)\n"
                    "  param @fno/w_im : f64[modes=5, width=3, width_out=3] = normal(0.408)\n")


def test_the_spectral_convolution_layer_is_the_composition_of_its_primitives():
    graph = verify(parse_graph(CONV_LAYER))
    (param,) = [p for p in graph.params.values() if p.path == "fno/w_re"]
    assert param.type.names == ("modes", "width", "width_out")
    x = RNG.standard_normal((2, 32, 3))
    w = {"fno/w_re": RNG.standard_normal((5, 3, 3)), "fno/w_im": RNG.standard_normal((5, 3, 3))}
    (y,), _ = eval_region(graph.body, [jnp.asarray(x)], {k: jnp.asarray(v) for k, v in w.items()}, LowerCtx())
    np.testing.assert_allclose(np.asarray(y), _conv_numpy(x, w["fno/w_re"] + 1j * w["fno/w_im"]).real, atol=1e-12)
    assert print_graph(parse_graph(print_graph(graph))) == print_graph(graph)
    (op,) = graph.body.ops
    assert op_flops(op, graph, {}) == 2 * (2 * 3) * 0.5 * 5 * 32 * 5 + 8 * 2 * 5 * 3 * 3
    with pytest.raises(TesseraError, match="hold 1 to 17 modes"):
        verify(parse_graph(CONV_LAYER.replace("modes = 5", "modes = 18")))
