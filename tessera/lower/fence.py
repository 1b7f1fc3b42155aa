"""A computation of its own: what deterministic mode compiles apart so that its arithmetic does not depend on what
surrounds it (a mesh's gathers and collectives, or nothing on one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fenced(fn, *args, when=True):
    """fn(*args) as a computation of its own: the branch of a conditional whose predicate XLA cannot know, so
    nothing outside is fused with what fn computes, and fn's arithmetic (where XLA:CPU contracts a product and a
    sum into an fma, in which order elementwise work runs) is the same whatever surrounds it: the gathers of a
    mesh's blocks before it, the slices of them after it, or neither on one device. The branch never taken
    returns zeros (never run; the taken branch adds no copies to the one-device program). A conditional rather
    than `opaque_map`'s loop: a loop of one over inputs it does not change would invite XLA's loop-invariant code
    motion to move the work back out. `when`: a predicate (a traced one included: a pipeline stage's) under which
    fn runs at all; otherwise the zeros (its VJP, a conditional on the same predicate, skips the backward too)."""
    fn = jax.jit(fn)  # traced once: the branch reuses the trace that gives the shapes (XLA inlines it)
    shapes = jax.eval_shape(fn, *args)
    zeros = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    pred = jnp.bool_(True) if when is True else jnp.asarray(when, jnp.bool_)
    return jax.lax.cond(jax.lax.optimization_barrier(pred), fn, zeros, *args)
