"""The Burgers data generator: its solver against the exact Cole-Hopf solution, its random field's
covariance, determinism per (seed, index), and the on-disk cache."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tessera.run import pde


def test_the_solver_reaches_the_exact_cole_hopf_solution():
    x = np.arange(256) / 256
    with jax.enable_x64(True):
        modes = jnp.fft.rfft(jnp.asarray(pde.cole_hopf(x, 0.0)))
        for t in (0.25, 1.0):
            got = np.asarray(jnp.fft.irfft(pde.solve_burgers(modes, t_end=t), n=256))
            want = pde.cole_hopf(x, t)
            assert np.abs(got - want).max() < 1e-9 * np.abs(want).max(), (t, np.abs(got - want).max())
        # without the advection term the answer would be the heat equation's: the test can tell them apart
        heat = np.asarray(jnp.fft.irfft(modes * jnp.exp(-pde.NU * (2 * math.pi * jnp.arange(129)) ** 2), n=256))
        assert np.abs(heat - pde.cole_hopf(x, 1.0)).max() > 1e-4


def test_the_initial_field_has_the_stated_covariance():
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(3), 4000)
        modes = np.asarray(jax.vmap(lambda k: pde.grf_modes(k, 64))(keys))
    k = np.arange(33)
    lam = 625.0 * (4 * math.pi ** 2 * k ** 2 + 25.0) ** -2.0
    var = np.mean(np.abs(modes / 64) ** 2, axis=0)  # E|u_k|^2 of the field's Fourier coefficients
    assert var[0] == 0.0
    np.testing.assert_allclose(var[1:5], lam[1:5], rtol=0.08)  # 4,000 draws: a few % of sampling error
    u = np.fft.irfft(modes, n=64)
    np.testing.assert_allclose(u.var(), 2 * lam[1:32].sum() + lam[32], rtol=0.05)


def test_pairs_depend_on_seed_and_index_only_and_are_cached(tmp_path):
    u0, u1 = pde.burgers_pairs(3, 64, seed=7, cache=tmp_path)
    assert u0.shape == u1.shape == (3, 64) and u0.dtype == np.float32
    (file,) = tmp_path.iterdir()
    again = pde.burgers_pairs(3, 64, seed=7, cache=tmp_path)  # read back, not solved
    np.testing.assert_array_equal(again[1], u1)
    first_two = pde.burgers_pairs(2, 64, seed=7, cache=tmp_path / "other")
    np.testing.assert_array_equal(first_two[1], u1[:2])        # pair i is pair i whatever the set's size
    other = pde.burgers_pairs(2, 64, seed=8, cache=tmp_path / "other")
    assert not np.allclose(other[0], u0[:2])
    assert np.abs(u1).max() < np.abs(u0).max()                   # viscosity: the solution is smoother, smaller
    # mean zero, conserved by the equation (up to the modes at multiples of 64 that subsampling folds in)
    assert np.abs(u0.mean(axis=1)).max() < 1e-3 * u0.std() * 10 and np.abs(u1.mean(axis=1)).max() < 1e-2 * u1.std()
    with pytest.raises(ValueError, match="must divide"):
        pde.burgers_pairs(1, 100, seed=0, cache=tmp_path)
