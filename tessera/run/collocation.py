"""Collocation points for models with `loss` entries: samplers over a box, exact solutions and their errors.

A batch is `{set name: float64 [n, d] points, "<set>_target": [n, k] exact values}` (targets only for sets
with `target: exact`), a pure function of (seed, step // resample_every, stream) like the token sources.
Samplers map a draw of the unit cube onto the box: uniform, Latin hypercube, or a Sobol sequence (Joe and
Kuo's direction numbers) scrambled by a random digital shift (XOR), which keeps its low discrepancy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Callable

import numpy as np

from tessera.run.data import STREAM_TRAIN

# Joe & Kuo (new-joe-kuo-6.21201) for dimensions 2..6: (s, a, m_1..m_s); dimension 1 is van der Corput.
_JOE_KUO = [(1, 0, (1,)), (2, 1, (1, 3)), (3, 1, (1, 3, 1)), (3, 2, (1, 1, 1)), (4, 1, (1, 1, 3, 3))]
_BITS = 32


def _directions(dim: int) -> np.ndarray:
    """Direction numbers V[j, k] (uint64 holding 32-bit values) for dimensions j < dim, bits k < 32."""
    if dim > len(_JOE_KUO) + 1:
        raise ValueError(f"the Sobol sampler has direction numbers for up to {len(_JOE_KUO) + 1} dimensions")
    v = np.zeros((dim, _BITS), dtype=np.uint64)
    v[0] = [1 << (_BITS - 1 - k) for k in range(_BITS)]
    for j in range(1, dim):
        s, a, m = _JOE_KUO[j - 1]
        for k in range(_BITS):
            if k < s:
                v[j, k] = m[k] << (_BITS - 1 - k)
            else:
                x = v[j, k - s] ^ (v[j, k - s] >> s)
                for i in range(1, s):
                    if (a >> (s - 1 - i)) & 1:
                        x ^= v[j, k - i]
                v[j, k] = x
    return v


def sobol(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """The first n points of the Sobol sequence in [0, 1)^dim, scrambled by a random digital shift."""
    v = _directions(dim)
    idx = np.arange(n, dtype=np.uint64)  # an aligned block of 2^m indices is a (t, m, d)-net
    x = np.zeros((n, dim), dtype=np.uint64)
    for k in range(_BITS):
        bit = (idx >> np.uint64(k)) & np.uint64(1)
        x ^= bit[:, None] * v[:, k][None, :]
    shift = rng.integers(0, 1 << _BITS, size=dim, dtype=np.uint64)
    return ((x ^ shift[None, :]).astype(np.float64) + 0.5) / float(1 << _BITS)


def latin(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """A Latin hypercube: each coordinate's n strata [i/n, (i+1)/n) hold one point each."""
    strata = np.stack([rng.permutation(n) for _ in range(dim)], axis=1)
    return (strata + rng.random((n, dim))) / n


def uniform(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Independent uniform points."""
    return rng.random((n, dim))


SAMPLERS: dict[str, Callable[[int, int, np.random.Generator], np.ndarray]] = {
    "uniform": uniform, "sobol": sobol, "latin": latin}


# ---- exact solutions: points [n, d] -> (u, v, p) [n, 3] ---------------------------------------------

def kovasznay(points: np.ndarray, exact) -> np.ndarray:
    """Kovasznay flow at Reynolds number re: λ = re/2 − sqrt(re²/4 + 4π²)."""
    x, y = points[:, 0], points[:, 1]
    lam = exact.re / 2 - math.sqrt(exact.re ** 2 / 4 + 4 * math.pi ** 2)
    u = 1 - np.exp(lam * x) * np.cos(2 * np.pi * y)
    v = lam / (2 * np.pi) * np.exp(lam * x) * np.sin(2 * np.pi * y)
    p = 0.5 * (1 - np.exp(2 * lam * x))
    return np.stack([u, v, p], axis=1)


def taylor_green(points: np.ndarray, exact) -> np.ndarray:
    """The decaying 2-D Taylor–Green vortex at viscosity nu (points x, y, t)."""
    x, y, t = points[:, 0], points[:, 1], points[:, 2]
    decay = np.exp(-2 * exact.nu * t)
    u = -np.cos(x) * np.sin(y) * decay
    v = np.sin(x) * np.cos(y) * decay
    p = -0.25 * (np.cos(2 * x) + np.cos(2 * y)) * decay ** 2
    return np.stack([u, v, p], axis=1)


EXACT: dict[str, Callable[[np.ndarray, object], np.ndarray]] = {"kovasznay": kovasznay, "taylor_green": taylor_green}


def relative_errors(pred: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    """rel_l2_u, rel_l2_v: ||pred − exact|| / ||exact||; rel_l2_p with each pressure's mean removed
    (pressure is determined up to a constant)."""
    out = {}
    for k, name in enumerate(("u", "v")):
        out[f"rel_l2_{name}"] = float(np.linalg.norm(pred[:, k] - exact[:, k]) / np.linalg.norm(exact[:, k]))
    p, q = pred[:, 2] - pred[:, 2].mean(), exact[:, 2] - exact[:, 2].mean()
    out["rel_l2_p"] = float(np.linalg.norm(p - q) / np.linalg.norm(q))
    return out


@dataclasses.dataclass(frozen=True)
class CollocationSource:
    """Point sets over the box of `data` (a CollocationData spec section), redrawn every resample_every steps."""

    data: object
    _last: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # the last draw, on the device

    @property
    def coords(self) -> list[str]:
        return list(self.data.domain)

    @property
    def fingerprint(self) -> str:
        text = json.dumps(self.data.model_dump(mode="json"), sort_keys=True)
        return "collocation:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def _box(self, unit: np.ndarray) -> np.ndarray:
        lo = np.array([b[0] for b in self.data.domain.values()])
        hi = np.array([b[1] for b in self.data.domain.values()])
        return lo + unit * (hi - lo)

    def points(self, name: str, draw: int, stream: int = STREAM_TRAIN) -> np.ndarray:
        """Set `name`'s points [n, d] of draw `draw`."""
        spec, coords = self.data.sets[name], self.coords
        index = list(self.data.sets).index(name)
        rng = np.random.default_rng([int(self.data.seed), int(stream), int(draw), index])
        unit = SAMPLERS[spec.method](spec.n, len(coords), rng)
        time = coords.index(self.data.time) if self.data.time is not None else None
        if spec.where == "initial":
            unit[:, time] = 0.0
        elif spec.where == "boundary":  # a face of the spatial box, chosen with probability ∝ its measure
            bounds = list(self.data.domain.values())
            spatial = [c for c in range(len(coords)) if c != time]
            extent = np.array([bounds[c][1] - bounds[c][0] for c in spatial])
            area = np.array([np.prod(np.delete(extent, i)) for i in range(len(spatial))])
            face = rng.choice(len(spatial), size=spec.n, p=area / area.sum())
            side = rng.integers(0, 2, size=spec.n).astype(np.float64)
            unit[np.arange(spec.n), np.asarray(spatial)[face]] = side
        return self._box(unit)

    def batch(self, step: int, stream: int = STREAM_TRAIN) -> dict:
        """Every set's points (and exact targets) for optimizer step `step`, as device arrays: the last draw is
        kept, since a numpy batch cost more to pass into the jitted step (0.16 s on the CPU) than the step."""
        every = int(self.data.resample_every)
        draw = step // every if every else 0
        if self._last.get("key") != (draw, stream):
            import jax

            self._last.update(key=(draw, stream), batch=jax.device_put(self.draw(draw, stream)))
        return self._last["batch"]

    def draw(self, draw: int, stream: int = STREAM_TRAIN) -> dict[str, np.ndarray]:
        """Draw number `draw` of every set (and the exact targets) as float64 numpy arrays."""
        out = {}
        for name, spec in self.data.sets.items():
            pts = self.points(name, draw, stream)
            out[name] = pts
            if spec.target == "exact":
                out[f"{name}_target"] = self.exact(pts)
        return out

    def exact(self, points: np.ndarray) -> np.ndarray:
        """The exact solution at `points`."""
        return EXACT[self.data.exact.kind](points, self.data.exact)

    def held_out(self) -> np.ndarray:
        """The fixed held-out evaluation points: uniform in the box, from their own stream."""
        rng = np.random.default_rng([int(self.data.seed), 7919])
        return self._box(rng.random((int(self.data.eval_points), len(self.coords))))

    def errors(self, forward) -> dict[str, float]:
        """rel_l2_u/v/p of `forward(points) -> [n, 3]` on the held-out points ({} without an exact solution)."""
        if self.data.exact is None:
            return {}
        pts = self.held_out()
        return relative_errors(np.asarray(forward(pts), np.float64), self.exact(pts))
