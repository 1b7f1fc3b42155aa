"""PDE data made in the project: input/solution pairs from a pseudo-spectral solver written in JAX.

    u0, u1 = burgers_pairs(n=1200, resolution=64, seed=0)   # [n, 64] each, float32, cached on disk

1-D viscous Burgers on the periodic unit interval, u_t + u u_x = nu u_xx (nu = 0.1), the setting of the
Fourier Neural Operator paper (Li et al., 2021): initial conditions drawn from the Gaussian random field
N(0, 625 (-Laplacian + 25 I)^-2), the solution at t = 1, solved at 1,024 points and subsampled to the
requested resolution.

The solver: Fourier modes in f64, the viscous term integrated exactly (an integrating factor), the
advection term -1/2 (u^2)_x by the classical fourth-order Runge-Kutta method in the integrating factor's
frame (Lawson RK4), with the 2/3 rule removing aliased modes of u^2. `cole_hopf` is the exact solution of
one initial condition, against which tests hold the solver.

Each pair is a pure function of (seed, its index), so the first k pairs of a larger set are the same k
pairs; a generated set is kept under the cache directory (`$TESSERA_CACHE` or ~/.cache/tessera) in a file
named by the hash of everything that makes it, written atomically (tessera/run/datacache.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tessera.run.data import STREAM_EVAL
from tessera.run.datacache import cached

VERSION = 1  # of the generator: part of the cache key, so a changed solver never reads an old set
BASE = 1024  # points the solver runs at
NU, T_END, DT = 0.1, 1.0, 1e-3
GRF = {"sigma": 25.0, "tau": 5.0, "alpha": 2.0}  # covariance sigma^2 (-Laplacian + tau^2 I)^-alpha


def _x64():
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64  # older jax

    return enable_x64()


def _wavenumbers(n: int) -> jnp.ndarray:
    return jnp.arange(n // 2 + 1, dtype=jnp.float64)


def grf_modes(key, n: int, sigma: float = GRF["sigma"], tau: float = GRF["tau"], alpha: float = GRF["alpha"]):
    """rfft coefficients (numpy's convention, length n // 2 + 1) of a mean-zero real field on n periodic points
    with covariance sigma^2 (-Laplacian + tau^2 I)^-alpha: mode k has variance sigma^2 (4 pi^2 k^2 + tau^2)^-alpha."""
    k = _wavenumbers(n)
    lam = sigma ** 2 * (4 * math.pi ** 2 * k ** 2 + tau ** 2) ** (-alpha)
    re, im = jax.random.normal(key, (2, n // 2 + 1), jnp.float64)
    coef = n * jnp.sqrt(lam / 2) * (re + 1j * im)
    coef = coef.at[0].set(0.0)  # mean zero
    if n % 2 == 0:  # the Nyquist mode of a real field is real, with the mode's whole variance
        coef = coef.at[-1].set(n * jnp.sqrt(lam[-1]) * re[-1])
    return coef


def _advection(u_hat, ik, keep):
    """-1/2 d/dx (u^2) in Fourier modes, u^2 dealiased by the 2/3 rule."""
    n = 2 * (u_hat.shape[-1] - 1)
    u = jnp.fft.irfft(u_hat * keep, n=n)
    return -0.5 * ik * jnp.fft.rfft(u * u) * keep


def solve_burgers(u0_hat, nu: float = NU, t_end: float = T_END, dt: float = DT):
    """Modes of u(t_end) from the modes of u(0) ([..., n // 2 + 1], complex128): Lawson RK4 steps of `dt`."""
    n = 2 * (u0_hat.shape[-1] - 1)
    k = _wavenumbers(n)
    ik = 2j * math.pi * k
    keep = (k <= n / 3).astype(jnp.float64)  # 2/3 rule: modes above n/3 are aliased in u^2
    steps = int(round(t_end / dt))
    if abs(steps * dt - t_end) > 1e-12 * max(t_end, 1.0):
        raise ValueError(f"dt = {dt} does not divide t_end = {t_end}")
    lin = -nu * (2 * math.pi * k) ** 2
    e, e2 = jnp.exp(lin * dt), jnp.exp(lin * dt / 2)

    def step(u, _):
        a = _advection(u, ik, keep)
        b = _advection(e2 * (u + dt / 2 * a), ik, keep)
        c = _advection(e2 * u + dt / 2 * b, ik, keep)
        d = _advection(e * u + dt * e2 * c, ik, keep)
        return e * u + dt / 6 * (e * a + 2 * e2 * (b + c) + d), None

    out, _ = jax.lax.scan(step, u0_hat, None, length=steps)
    return out


def cole_hopf(x, t: float, nu: float = NU, a: float = 0.5):
    """The exact periodic solution from phi = 1 + a exp(-4 pi^2 nu t) cos(2 pi x) (u = -2 nu phi_x / phi)."""
    decay = a * np.exp(-4 * math.pi ** 2 * nu * t)
    return 4 * math.pi * nu * decay * np.sin(2 * math.pi * x) / (1 + decay * np.cos(2 * math.pi * x))


def _pairs(seed: int, start: int, stop: int, resolution: int) -> tuple[np.ndarray, np.ndarray]:
    with _x64():
        key = jax.random.key(seed)
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(start, stop))
        modes = jax.vmap(lambda k: grf_modes(k, BASE))(keys)
        final = jax.jit(solve_burgers)(modes)
        u0, u1 = jnp.fft.irfft(modes, n=BASE), jnp.fft.irfft(final, n=BASE)
        every = BASE // resolution
        return np.asarray(u0[:, ::every], np.float32), np.asarray(u1[:, ::every], np.float32)


def burgers_pairs(n: int, resolution: int, seed: int, *, cache: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(u0, u1) [n, resolution] float32: n initial conditions and their solutions at t = 1, pair i a function
    of (seed, i) alone; read from the cache when this exact set was made before."""
    if resolution < 1 or BASE % resolution:
        raise ValueError(f"resolution {resolution} must divide the solver's {BASE} points")
    what = {"kind": "burgers", "version": VERSION, "n": n, "resolution": resolution, "seed": seed, "nu": NU,
            "t": T_END, "dt": DT, "base": BASE, **GRF}

    def make():
        chunks = [_pairs(seed, s, min(s + 256, n), resolution) for s in range(0, n, 256)]  # bounded memory
        u0, u1 = (np.concatenate(parts) for parts in zip(*chunks))
        return {"u0": u0, "u1": u1}

    pairs = cached("pde", "burgers", what, make, cache=cache)
    return pairs["u0"], pairs["u1"]


class BurgersSource:
    """Batches of (u0, u1) pairs for a train task: the first `train` pairs of `seed`, shuffled each epoch by
    (seed, epoch); evaluation batches and `eval_rel_l2` from the next `eval` pairs (held out)."""

    def __init__(self, data, batch: int):
        self.data, self.size = data, int(batch)
        u0, u1 = burgers_pairs(int(data.train) + int(data.eval), int(data.resolution), int(data.seed))
        n = int(data.train)
        self.train, self.eval = (u0[:n], u1[:n]), (u0[n:], u1[n:])
        self._last: dict = {}

    @property
    def fingerprint(self) -> str:
        # the pairs are a pure function of these settings and the generator's version
        text = json.dumps({**self.data.model_dump(mode="json"), "version": VERSION}, sort_keys=True)
        return "burgers:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def batch(self, step: int, stream: int = 0) -> dict:
        """Step `step`'s pairs {u0, u1} [batch, resolution] (stream 0: training, else the held-out pairs)."""
        u0, u1 = self.eval if stream == STREAM_EVAL else self.train
        n, b = len(u0), min(self.size, len(u0))
        per_epoch = max(n // b, 1)
        epoch, k = divmod(int(step), per_epoch)
        order = np.random.default_rng([int(self.data.seed), int(stream), epoch]).permutation(n)
        idx = order[k * b:(k + 1) * b]
        key = (stream, epoch, k)
        if self._last.get("key") != key:
            self._last.update(key=key, batch=jax.device_put({"u0": u0[idx], "u1": u1[idx]}))
        return self._last["batch"]

    def errors(self, forward) -> dict[str, float]:
        """eval_rel_l2: the mean over held-out pairs of ||forward(u0) - u1|| / ||u1||."""
        u0, u1 = self.eval
        pred = np.concatenate([np.asarray(forward(u0[i:i + 256]), np.float64) for i in range(0, len(u0), 256)])
        rel = np.linalg.norm(pred - u1, axis=1) / np.linalg.norm(u1, axis=1)
        return {"eval_rel_l2": float(rel.mean())}
