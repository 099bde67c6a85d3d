"""Typed PRNG keys (``jax.random.key``) at the ``sj.jit`` boundary.

A global tensor holds an array of a plain dtype; a typed key has an extended
one (``key<fry>``). So a typed key argument travels as its key data
(``jax.random.key_data``: uint32, with a trailing dim of the implementation's
size) and is wrapped again inside the traced function: the program sees the
key the caller passed, as under ``jax.jit``. Its ``in_sbp`` splits the key
array's own dims (B by default); the data's trailing dim is never split. A
typed key result leaves the program as key data and is returned as a typed
key ``jax.Array`` (not a GlobalTensor: a key is a few bytes, and the array
can be passed to the next call as it is).
"""

from __future__ import annotations

import functools

import jax

from sbpjax._errors import SBPError
from sbpjax.dtypes import check_partial_dtype, key_impl
from sbpjax.sbp import Partial, format_sbp


def check_layout(dtype, nd, is_key: bool, where: str) -> None:
    """An SBPError unless nd-SBP ``nd`` suits a value of ``dtype`` (a typed
    key's data when ``is_key``): a partial its dtype supports, and none at
    all for keys, which are neither summed nor compared."""
    if is_key and any(isinstance(q, Partial) for q in nd):
        raise SBPError(
            f"{where} {format_sbp(nd)} is partial, and a PRNG key array cannot be (keys are not summed, "
            "nor their max taken): give S (over the key array's dims) or B."
        )
    check_partial_dtype(dtype, nd, where)


def unwrapped(leaves: list) -> tuple[list, tuple]:
    """The leaves with each typed key replaced by its key data, and per leaf
    its implementation's name (None for the other leaves)."""
    impls = tuple(key_impl(v) for v in leaves)
    if not any(impls):
        return leaves, impls
    return [jax.random.key_data(v) if impl else v for v, impl in zip(leaves, impls)], impls


def keyed(fn, in_tree, in_impls: tuple, out_impls: list):
    """``fn`` taking key data where the call had typed keys (wrapped again
    before ``fn`` sees them) and returning key data where ``fn`` returns
    typed keys; ``out_impls`` is filled, when it is traced, with each output
    leaf's implementation (None for the others)."""

    @functools.wraps(fn)  # errors and debug names read the user's function
    def with_keys(*args, **kwargs):
        if any(in_impls):
            leaves = in_tree.flatten_up_to((args, kwargs))
            leaves = [
                v if impl is None else jax.random.wrap_key_data(v, impl=impl)
                for v, impl in zip(leaves, in_impls)
            ]
            args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = fn(*args, **kwargs)
        flat, tree = jax.tree_util.tree_flatten(out)
        flat, impls = unwrapped(flat)
        out_impls[:] = impls
        return jax.tree_util.tree_unflatten(tree, flat)

    return with_keys


def rewrapped(results: list, impls: tuple) -> list:
    """Results (GlobalTensors) with those that carry key data as typed keys."""
    if not any(impls):
        return results
    return [
        r if impl is None else jax.random.wrap_key_data(r.to_jax(), impl=impl)
        for r, impl in zip(results, impls)
    ]


__all__ = ["check_layout", "keyed", "rewrapped", "unwrapped"]
