"""Partial max and min (``P(max)``, ``P(min)``): their all-reduce and the values that fill.

``lax.pmax`` has no differentiation rule and XLA's CPU max/min all-reduce
drops NaN; ``preduce_extreme`` is a max/min all-reduce with ``jnp.max``'s
gradient and NaN handling. ``fill_value`` is each partial op's identity, what
a device holds where it has no data (an uneven split's padding, a zero-filled
piece).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def _ordered_key(x, op):
    """Floats as integers of the same width whose order is IEEE's total order,
    with every NaN made the extreme that ``op`` picks (+NaN for max, -NaN for
    min). XLA's CPU max/min all-reduce drops NaN; an integer all-reduce over
    these keys keeps it, as ``jnp.max`` / ``jnp.min`` do, in one collective of
    the same bytes. (On GPU, XLA promotes a 16-bit integer all-reduce to 32
    bits for NCCL, so float16/bfloat16 max/min move twice the bytes there;
    NCCL's own float max gives no NaN guarantee either.)"""
    nan = jnp.array(jnp.nan if op == "max" else -jnp.nan, x.dtype)
    bits = lax.bitcast_convert_type(jnp.where(jnp.isnan(x), nan, x), _INT_OF_WIDTH[x.dtype.itemsize])
    return _flip_negative(bits)


def _flip_negative(bits):
    # negative floats order backwards as signed integers; flipping all but the
    # sign bit reverses them (and is its own inverse)
    return jnp.where(bits < 0, bits ^ jnp.array(jnp.iinfo(bits.dtype).max, bits.dtype), bits)


_INT_OF_WIDTH = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _preduce_extreme(x, axes, op):
    reduce = lax.pmax if op == "max" else lax.pmin
    if jnp.issubdtype(x.dtype, jnp.floating):
        key = reduce(_ordered_key(x, op), axes)
        y = lax.bitcast_convert_type(_flip_negative(key), x.dtype)
        return jnp.where(jnp.isnan(y), jnp.array(jnp.nan, x.dtype), y)  # -NaN (min's key) back to NaN
    return reduce(x, axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def preduce_extreme(x, axes, op):
    """pmax / pmin whose gradient goes to the devices holding the extreme
    (split evenly between ties, as ``jnp.max`` does). NaN propagates, as in
    ``jnp.max``; ``+0.0`` counts as larger than ``-0.0``."""
    return _preduce_extreme(x, axes, op)


def _pre_fwd(x, axes, op):
    y = _preduce_extreme(x, axes, op)
    return y, (x, y)


def _pre_bwd(axes, op, res, g):
    # Unchecked shard_map (check_vma=False) splits the cotangent of a replicated
    # value over the devices and transposes psum to psum; the total cotangent is
    # therefore the psum of the per-device ones, as in psum's own transpose.
    x, y = res
    hit = (x == y).astype(g.dtype)
    return (lax.psum(g, axes) * hit / lax.psum(hit, axes),)


preduce_extreme.defvjp(_pre_fwd, _pre_bwd)


def fill_value(op: str, dtype):
    """The identity of a partial op: what a device holds where it has no data."""
    dtype = jnp.dtype(dtype)
    if op == "sum":
        return jnp.zeros((), dtype)
    if dtype == jnp.bool_:
        return jnp.array(op == "min", dtype)  # identity of or (max) / and (min)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if op == "max" else jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.array(info.min if op == "max" else info.max, dtype)
