"""Which dtypes a partial value may have: one table, checked wherever a layout is made.

A ``P(op)`` layout keeps one term per device and promises that reducing them
with ``op`` gives the logical tensor. That promise only holds where the
reduction exists and stays in the dtype:

============  =========  ==========================================================
dtype class   partials   why
============  =========  ==========================================================
bool          max, min   max is logical or, min logical and. A sum of bools counts:
                         it is not a bool (``psum`` returns int32).
int, uint     sum, max,  sums wrap around in the dtype's own width (int8: 100 + 100
              min        = -56), as ``jnp.sum(x, dtype=x.dtype)`` and every
                         device collective do; the result does not depend on order.
float16,      sum, max,  max / min propagate NaN as ``jnp.max`` / ``jnp.min`` do.
bfloat16,     min        Sums are reduced by the device collective (XLA's CPU
float32,                 all-reduce accumulates bfloat16 in float32, GPU rings
float64                  in their own order), so ``numpy()`` of a partial asks the
                         devices rather than re-adding on the host.
complex       sum        complex numbers have no order.
float8, int4  none       no collective reduces them reliably on every backend.
others        none       (PRNG keys, strings, objects)
============  =========  ==========================================================

S and B take any dtype. :func:`check_partial_dtype` is called by ``to_global``,
``from_local_tensors``, boxing (``GlobalTensor.to_global``) and ``sj.jit``'s
``in_sbp`` / ``out_sbp``, so an unsupported pair is an :class:`SBPError` where
the layout is made, never a raw XLA error later.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.sbp import Partial

# the reducing float dtypes (float8 variants are deliberately absent)
_FLOATS = {np.dtype(np.float16), np.dtype(jax.numpy.bfloat16), np.dtype(np.float32), np.dtype(np.float64)}
_COMPLEX = {np.dtype(np.complex64), np.dtype(np.complex128)}

PARTIAL_OPS_BY_CLASS = {
    "bool": ("max", "min"),
    "int": ("sum", "max", "min"),
    "uint": ("sum", "max", "min"),
    "float": ("sum", "max", "min"),
    "complex": ("sum",),
    "other": (),
}

_ALTERNATIVE = {
    ("bool", "sum"): "a sum of bools is a count, not a bool: cast to an integer dtype first "
    "(x.astype(jnp.int32)), or use P(max) for 'any' / P(min) for 'all'",
    ("complex", "max"): "complex numbers have no order: use P(sum), or lay out a real value "
    "(jnp.abs(x) or x.real) as P(max)",
    ("complex", "min"): "complex numbers have no order: use P(sum), or lay out a real value "
    "(jnp.abs(x) or x.real) as P(min)",
}


def canonical_dtype(dtype) -> np.dtype:
    """The dtype the devices hold for values given as ``dtype``: JAX narrows
    64-bit types to 32 bits unless ``jax_enable_x64`` is set."""
    try:
        if np.dtype(dtype).kind in "USOMm":  # text, objects, dates: no JAX array holds them
            raise TypeError(dtype)
        return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    except TypeError:
        if is_key_dtype(dtype):
            raise SBPError(
                f"dtype {dtype} is a PRNG key's, which a global tensor does not hold: lay out its key data "
                "(jax.random.key_data(k), uint32) and wrap it again with jax.random.wrap_key_data, or pass "
                "the key to sj.jit, which lays typed keys out itself."
            ) from None
        raise SBPError(
            f"dtype {dtype} is not one a JAX array holds (bool, integers, floats, complex); convert the "
            "data first, e.g. np.asarray(x, np.float32)."
        ) from None


def dtype_class(dtype) -> str:
    """The row of the table above that ``dtype`` falls in."""
    try:
        dt = np.dtype(dtype)
    except TypeError:  # JAX extended dtypes (PRNG keys)
        return "other"
    if dt == np.bool_:
        return "bool"
    if dt in _FLOATS:
        return "float"
    if dt in _COMPLEX:
        return "complex"
    if dt.kind in "iu" and dt.itemsize >= 1 and dt.name in np.sctypeDict:
        return "int" if dt.kind == "i" else "uint"
    return "other"


@functools.cache  # a handful of dtypes per process
def dtype_name(dtype) -> str:
    """``str(dtype)``, remembered: numpy makes the name afresh on every call
    (about 25 us), and the planner names the dtype of every value of a
    program in its keys (a 32-layer step: some 40,000 times per plan)."""
    return str(dtype)


def partial_supported(dtype, op: str) -> bool:
    """Whether a ``P(op)`` tensor of ``dtype`` is allowed."""
    return op in PARTIAL_OPS_BY_CLASS[dtype_class(dtype)]


def check_partial_dtype(dtype, sbp, where: str) -> None:
    """Raise :class:`SBPError` if ``sbp`` (an nd-SBP) has a partial that
    ``dtype`` does not support, naming the dtype, the partial and what to use."""
    cls = dtype_class(dtype)
    for axis, s in enumerate(sbp):
        if isinstance(s, Partial) and s.op not in PARTIAL_OPS_BY_CLASS[cls]:
            name = np.dtype(dtype).name
            alt = _ALTERNATIVE.get((cls, s.op))
            if alt is None:
                ok = PARTIAL_OPS_BY_CLASS[cls]
                alt = (
                    f"{name} supports {', '.join(f'P({o})' for o in ok)}"
                    if ok
                    else f"{name} cannot be partial at all: cast to float32/bfloat16 (or an integer dtype) "
                    "before making it partial, or keep it S/B"
                )
            raise SBPError(
                f"{where}: {s} (placement axis {axis}) is not supported for dtype {name}; {alt}. "
                "Supported pairs: sbpjax.dtypes.PARTIAL_OPS_BY_CLASS."
            )


def is_key(v) -> bool:
    """A typed PRNG key array (``jax.random.key``) or its abstract value: an
    extended dtype, which global tensors do not hold (``sbpjax.compiler.keys``
    and ``sbpjax.checkpoint`` carry its key data instead)."""
    return is_key_dtype(getattr(v, "dtype", None))


def is_key_dtype(dtype) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (an extended dtype)."""
    # an extended dtype is no numpy dtype: the common case answers without jax's issubdtype
    return (
        dtype is not None
        and not isinstance(dtype, np.dtype)
        and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    )


def constant_bits(value) -> np.ndarray:
    """A program constant as a NumPy array, to compare or fingerprint: a typed
    key closed over by the user's function is its key data (NumPy cannot hold
    a key), which names it as well as its value would."""
    return np.asarray(jax.random.key_data(value)) if is_key(value) else np.asarray(value)


@functools.cache  # one entry per key implementation and shape
def key_data_shape(shape: tuple, dtype) -> tuple:
    """The shape of the key data (uint32) of a typed key array of ``shape``
    and key ``dtype``: ``shape`` and the implementation's trailing dims
    (threefry: 2). Collectives move a key array as its key data."""
    return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(tuple(shape), dtype)).shape


def key_impl(v) -> str | None:
    """The implementation's name of a typed key (``"threefry2x32"``), else None."""
    return str(jax.random.key_impl(v)) if is_key(v) else None


__all__ = [
    "PARTIAL_OPS_BY_CLASS",
    "canonical_dtype",
    "constant_bits",
    "check_partial_dtype",
    "dtype_class",
    "dtype_name",
    "partial_supported",
    "is_key",
    "is_key_dtype",
    "key_data_shape",
    "key_impl",
]
