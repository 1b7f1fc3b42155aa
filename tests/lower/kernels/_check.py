"""Comparison helpers for kernel tests: relative L2 error of outputs and gradients vs a reference."""

from __future__ import annotations

import numpy as np


def rel_err(got, want) -> float:
    """||got - want|| / ||want|| in float64; NaN anywhere fails."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in kernel output"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_close(got, want, tol: float, name: str = "") -> None:
    """Relative L2 error under tol (bf16 operands land between 1e-3 and 1e-2)."""
    err = rel_err(got, want)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"
