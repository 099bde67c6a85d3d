"""``sj.constrain``: an identity primitive the layout choice treats as a
boxing point.

Outside ``sj.jit`` it is the identity (its implementation and lowering return
the value). Inside, the tracer keeps it as an op named
``propagation.CONSTRAIN`` whose only signature is the layout asked for, so
the value is boxed there. Its JVP passes tangents through unconstrained and
its batching rule keeps it under ``vmap``; ``grad_sbp`` constrains the
cotangent too (a ``custom_vjp``).
"""

from __future__ import annotations

import functools

import jax
from jax.interpreters import mlir

from sbpjax._errors import SBPError
from sbpjax.compiler.arguments import broadcast_spec
from sbpjax.compiler.propagation import CONSTRAIN
from sbpjax.compiler.trace import tracing_on
from sbpjax.sbp import Broadcast, Partial, Split, as_sbp, parse_sbp

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive  # type: ignore[attr-defined,no-redef]

constrain_p = Primitive(CONSTRAIN)
constrain_p.def_impl(lambda x, *, sbp: x)
constrain_p.def_abstract_eval(lambda x, *, sbp: x)
mlir.register_lowering(constrain_p, lambda ctx, x, *, sbp: [x])


def _constrain_jvp(primals, tangents, *, sbp):
    (x,), (t,) = primals, tangents
    # the layout applies to the forward value; tangents follow freely
    return constrain_p.bind(x, sbp=sbp), t


def _constrain_batch(args, dims, *, sbp):
    return constrain_p.bind(args[0], sbp=sbp), dims[0]


jax.interpreters.ad.primitive_jvps[constrain_p] = _constrain_jvp
jax.interpreters.batching.primitive_batchers[constrain_p] = _constrain_batch


def _as_nd(sbp, name: str = "sbp") -> tuple:
    """``sbp`` as an nd-SBP tuple (its length is checked against the
    placement when the layout choice reads it: the placement is unknown here)."""
    if isinstance(sbp, str):
        return tuple(parse_sbp(sbp))
    if isinstance(sbp, (Split, Broadcast, Partial)):
        return (sbp,)
    if isinstance(sbp, (tuple, list)):
        return tuple(as_sbp(s, f"sj.constrain: {name}") for s in sbp)
    raise SBPError(
        f"sj.constrain: {name} must be an nd-SBP, one entry per placement axis (e.g. (sj.S(0), sj.B) or "
        f"'S(0), B'; one SBP such as sj.S(0) on a placement of one axis), got {sbp!r} "
        f"({type(sbp).__name__})."
    )


def constrain(x, sbp, grad_sbp=None):
    """Inside a function compiled by ``sj.jit``: force ``x`` to the nd-SBP ``sbp``
    here (a boxing point). Outside ``sj.jit`` it returns ``x`` unchanged.

    The layout applies to the value only; under ``jax.grad`` its cotangent
    takes whatever layout is cheapest. ``grad_sbp`` forces the cotangent too,
    where the backward pass passes this point (e.g. keep the gradient of
    class-split logits S(1) rather than letting it go through S(0)). It is a
    separate layout because a value's natural cotangent often differs: the
    cotangent of a B value used on split data is a partial sum.

    ``x`` may be a pytree of arrays (as ``jax.lax.with_sharding_constraint``
    takes): ``sbp`` and ``grad_sbp`` are then one nd-SBP for every leaf, or a
    pytree of them with ``x``'s structure or a prefix of it (None: that part
    left free), as ``sj.jit``'s ``out_sbp``."""
    leaves, tree = jax.tree_util.tree_flatten(x)
    if tree == _ONE_LEAF:
        return _constrain_one(x, sbp, grad_sbp)
    placement = tracing_on()
    if placement is None:
        return x  # not traced by sj.jit: nothing to lay out
    what = "sj.constrain's sbp"
    sbps = broadcast_spec(sbp, tree, what, placement.ndim)
    grads = broadcast_spec(grad_sbp, tree, "sj.constrain's grad_sbp", placement.ndim)
    out = [
        leaf if s is None else _constrain_one(leaf, s, g)
        for leaf, s, g in zip(leaves, sbps, grads, strict=True)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


_ONE_LEAF = jax.tree_util.tree_structure(0)


def _constrain_one(x, sbp, grad_sbp):
    """``constrain`` of one array."""
    sbp = _as_nd(sbp)
    grad_sbp = None if grad_sbp is None else _as_nd(grad_sbp, "grad_sbp")
    if not isinstance(x, jax.core.Tracer):
        return x  # not traced: nothing to lay out (an eager bind would hand a NumPy array back as JAX's)
    if grad_sbp is None:
        return constrain_p.bind(x, sbp=sbp)
    return _constrain_both(x, sbp, grad_sbp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _constrain_both(x, sbp, grad_sbp):
    return constrain_p.bind(x, sbp=sbp)


def _constrain_both_fwd(x, sbp, grad_sbp):
    return constrain_p.bind(x, sbp=sbp), None


def _constrain_both_bwd(sbp, grad_sbp, _, ct):
    return (constrain_p.bind(ct, sbp=grad_sbp),)


_constrain_both.defvjp(_constrain_both_fwd, _constrain_both_bwd)


__all__ = ["constrain", "constrain_p"]
