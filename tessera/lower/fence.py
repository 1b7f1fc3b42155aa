"""A computation of its own: what deterministic mode compiles apart so that its arithmetic does not depend on what
surrounds it (a mesh's gathers and collectives, or nothing on one device)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def fenced(fn, *args, when=True):
    """fn(*args) as a computation of its own: the branch of a conditional whose predicate XLA cannot know, so
    nothing outside is fused with what fn computes, and fn's arithmetic (where XLA:CPU contracts a product and a
    sum into an fma, in which order elementwise work runs) is the same whatever surrounds it: the gathers of a
    mesh's blocks before it, the slices of them after it, or neither on one device. The branch never taken
    returns zeros (never run; the taken branch adds no copies to the one-device program). A conditional rather
    than `opaque_map`'s loop: a loop of one over inputs it does not change would invite XLA's loop-invariant code
    motion to move the work back out. `when`: a predicate (a traced one included: a pipeline stage's) under which
    fn runs at all; otherwise the zeros (its VJP, a conditional on the same predicate, skips the backward too).

    Differentiated, the forward is a conditional returning fn's outputs and the residuals its backward needs, the
    backward another. A residual that is one of fn's inputs (a layer's weight, which its backward's GEMMs read) is
    not returned by the forward's conditional but handed to the backward's as the input it is: a conditional's
    result is a buffer of its own, so returning a weight copied it (on one H100 1,500 copies, 12.4 ms, of the
    Llama-1B deterministic step's 16 layers x 8 canonical shards)."""
    fn = jax.jit(fn)  # traced once: the branch reuses the trace that gives the shapes (XLA inlines it)
    pred = jnp.bool_(True) if when is True else jnp.asarray(when, jnp.bool_)
    forwarded: dict = {}  # how the backward rebuilds fn's VJP: its pytree, and which leaves are fn's inputs

    def forward(*a):
        out, pull = jax.vjp(fn, *a)
        leaves, tree = jax.tree.flatten(pull)
        inputs = {id(x): i for i, x in enumerate(jax.tree.leaves(a))}
        where = [inputs.get(id(leaf)) for leaf in leaves]
        forwarded.update(tree=tree, where=where)
        return out, [leaf for leaf, w in zip(leaves, where) if w is None]

    def backward(a, res, ct):
        a_leaves, kept = jax.tree.leaves(a), iter(res)
        leaves = [a_leaves[w] if w is not None else next(kept) for w in forwarded["where"]]
        grads = jax.tree.unflatten(forwarded["tree"], leaves)(_restore(ct))
        return jax.tree.map(lambda g: None if _is_float0(g) else g, grads)

    @jax.custom_vjp
    def run(pred, *a):
        return _branch(pred, fn, *a)

    def run_fwd(pred, *a):
        out, res = _branch(pred, forward, *a)
        return out, (pred, a, res)

    def run_bwd(saved, ct):
        pred, a, res = saved
        return (None, *_branch(pred, backward, a, res, _dropped(ct)))

    run_bwd.exact_transpose = True  # is_fence: this VJP is fn's own (precast.py may see through it)
    run.defvjp(run_fwd, run_bwd)
    return run(pred, *args)


def is_fence(eqn) -> bool:
    """Whether a jaxpr equation is a `fenced` call (a `custom_vjp_call` whose backward is fenced's): its VJP is
    the one of the function it wraps, so what holds for that function's jaxpr (`call_jaxpr`) holds for it."""
    bwd = eqn.params.get("bwd")
    return eqn.primitive.name == "custom_vjp_call" and getattr(getattr(bwd, "f", None), "exact_transpose", False)


def _branch(pred, fn, *args):
    """fn(*args) under `pred`, as the taken branch of a conditional XLA cannot see through; zeros otherwise."""
    shapes = jax.eval_shape(fn, *args)
    zeros = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # noqa: E731
    return jax.lax.cond(jax.lax.optimization_barrier(pred), fn, zeros, *args)


# A cotangent of an integer output (a token count) is float0, which a conditional does not carry: it crosses as
# None and is made again inside, and an integer input's gradient (None) leaves as None.
def _is_float0(x) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _dropped(ct):
    return jax.tree.map(lambda c: _Float0(c.shape) if _is_float0(c) else c, ct)


def _restore(ct):
    return jax.tree.map(lambda c: np.zeros(c.shape, jax.dtypes.float0) if isinstance(c, _Float0) else c, ct,
                        is_leaf=lambda c: isinstance(c, _Float0))


@jax.tree_util.register_static
class _Float0:
    """The shape of a float0 cotangent, carried through a conditional as static data."""

    def __init__(self, shape):
        self.shape = tuple(shape)

    def __hash__(self):
        return hash(self.shape)

    def __eq__(self, other):
        return isinstance(other, _Float0) and other.shape == self.shape
