"""The jaxprs of the small functions the tracer writes out, made once per shape.

Writing out a scan (``sbpjax.compiler.trace``) slices each stacked operand once
per iteration and stacks each result: a 32-layer scanned decoder's train step
asked ``jax.make_jaxpr`` for 1,347 of them, most of the trace's time, though
they repeat a few shapes (each weight of a layer, per iteration index): 363
distinct ones. A slice's jaxpr for each index is index 0's with the slice
moved (:func:`index_jaxpr`), so a fresh process traces one per shape.
A jaxpr depends only on what it computes, named by the caller (``what``: the
function and its static arguments, as the slice's index), and on the operands'
shapes and dtypes; it is immutable, and inlining reads its equations without
changing them, so one is shared by every use (the unrolled iterations of a
scan already share their body's equations).
"""

from __future__ import annotations

import jax

# Entries are small (a handful of equations); the bound keeps a long session's
# table from growing with every shape it ever traced.
KEPT = 4096
_JAXPRS: dict = {}


def jaxpr_of(what, fn, atoms):
    """``jax.make_jaxpr(fn)`` on ``atoms``' shapes and dtypes, kept under
    ``what`` (hashable; None: made afresh and not kept)."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in atoms]
    if what is None:
        return jax.make_jaxpr(fn)(*avals)
    return _kept(_key(what, atoms), lambda: jax.make_jaxpr(fn)(*avals))


def index_jaxpr(atom, i: int):
    """The jaxpr of ``lax.index_in_dim(x, i, 0, keepdims=False)`` on ``atom``.

    A fresh process writing out a scan asks for one per stacked operand and
    iteration (1,280 in the compiler benchmark's 32-layer scanned GPT step,
    0.8 s of ``jax.make_jaxpr``), and they differ only in the slice's bounds:
    JAX is asked once per shape (index 0), and the slice's ``start_indices``
    and ``limit_indices`` are moved to ``i`` (the equations are immutable:
    new ones, ``replace``d). Where JAX spells the indexing other than one
    ``slice`` and one ``squeeze``, every index is traced as before."""

    def index(x, i=i):
        return jax.lax.index_in_dim(x, i, 0, keepdims=False)

    def made():
        first = jaxpr_of(("index_in_dim", 0), lambda x: index(x, 0), [atom])
        if i == 0:
            return first
        moved = _moved_slice(first, i)
        if moved is not None:
            return moved
        return jax.make_jaxpr(index)(jax.ShapeDtypeStruct(atom.shape, atom.dtype))

    return _kept(_key(("index_in_dim", i), [atom]), made)


def _moved_slice(closed, i: int):
    """``closed`` (index 0's slice and squeeze) with the slice at index ``i``,
    or None where its equations are not that pair."""
    eqns = closed.jaxpr.eqns
    if [e.primitive.name for e in eqns] != ["slice", "squeeze"]:
        return None
    params = eqns[0].params
    start, limit = tuple(params["start_indices"]), tuple(params["limit_indices"])
    if start[0] != 0 or limit[0] != 1 or params.get("strides") not in (None, (1,) * len(start)):
        return None
    sliced = eqns[0].replace(
        params=dict(params, start_indices=(i, *start[1:]), limit_indices=(i + 1, *limit[1:]))
    )
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=[sliced, eqns[1]]))


def _key(what, atoms) -> tuple:
    return (
        what,
        bool(jax.config.read("jax_enable_x64")),
        # str, not np.dtype(...).str: a typed PRNG key's dtype (key<fry>) is no numpy dtype
        tuple((tuple(a.shape), str(a.dtype)) for a in atoms),
    )


def _kept(key, make):
    closed = _JAXPRS.get(key)
    if closed is None:
        if len(_JAXPRS) >= KEPT:
            _JAXPRS.clear()
        closed = _JAXPRS[key] = make()
    return closed


def clear() -> None:
    _JAXPRS.clear()
