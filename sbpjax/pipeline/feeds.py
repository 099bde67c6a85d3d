"""A step's data feeds: the batch split into microbatches, and a microbatch
placed on its stage.

``inputs`` (the first stage's ``x``) is one array; ``targets`` (what
``loss_fn`` reads beside the last stage's output) is an array or a pytree of
arrays with the same rows, e.g. labels with per-example weights or a mask.
Either may be a function ``k -> microbatch k`` instead, returning the same.

Decision: inputs stay one array. Every stage passes one activation to the
next, and the first stage's input is the first such value; a mask the model
needs beside its input goes through the stages as part of that value, or is
read from the targets by the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.tensor import host_values, is_global, to_global


def rows(data) -> int | None:
    """The rows (dim 0) every array of ``data`` (``on_host``) has, or None for a function."""
    if callable(data):
        return None
    return np.shape(jax.tree.leaves(data)[0])[0]


def on_host(data):
    """``data`` with global tensors as their host arrays (the batch is split on
    the host, then each microbatch placed), and a nested list of numbers as
    one array, as numpy reads it."""
    if isinstance(data, list) and not any(hasattr(a, "shape") for a in jax.tree.leaves(data)):
        return np.asarray(data)
    return host_values(data)


def feed(name: str, data, m: int) -> Callable[[int], Any]:
    """``k -> microbatch k`` of ``data`` (``on_host``) split into ``m`` equal
    microbatches (``data`` itself where it is that function already)."""
    if callable(data):
        return data
    leaves = jax.tree.leaves(data)
    one_array = len(leaves) == 1 and leaves[0] is data
    if not leaves or not all(hasattr(a, "shape") for a in leaves) or (name == "inputs" and not one_array):
        what = "an array" if name == "inputs" else "an array or a tuple / dict of arrays"
        raise SBPError(
            f"Pipeline.step: {name} is {_described(data)}; give {what} whose dim 0 splits into the "
            "microbatches, or a function k -> microbatch k."
            + (
                " Per-example extras the loss reads (weights, masks) go in targets, which may be a "
                "tuple or dict of arrays."
                if name == "inputs"
                else ""
            )
        )
    shapes = [tuple(a.shape) for a in leaves]
    if any(not s for s in shapes) or len({s[0] for s in shapes}) > 1:
        raise SBPError(
            f"Pipeline.step: the arrays of {name} have shapes {shapes}; each needs the same rows "
            "(dim 0), one row per example, so that microbatch k of each holds the same examples."
        )
    n = shapes[0][0]
    if n % m:
        raise SBPError(
            f"Pipeline.step: {name} has {n} rows (dim 0 of shape {shapes[0]}) which do not split into "
            f"{m} equal microbatches; equal microbatches make the accumulated gradient the whole "
            f"batch's gradient. Use a batch that is a multiple of {m}, or pass a function k -> "
            "microbatch."
        )
    size = n // m
    return lambda k: jax.tree.map(lambda a: np.asarray(a[k * size : (k + 1) * size]), data)


def microbatch_shapes(data, m: int):
    """A hashable key of the shapes and dtypes of one microbatch of ``data``
    (``on_host`` arrays split into ``m``), or None where a function gives some of it."""
    leaves = jax.tree.leaves(data, is_leaf=callable)
    if any(callable(a) for a in leaves):
        return None
    return (
        jax.tree.structure(data),
        tuple(((np.shape(a)[0] // m, *np.shape(a)[1:]), str(getattr(a, "dtype", None))) for a in leaves),
    )


def placed(microbatch, placement, sbp):
    """Each array of ``microbatch`` as a global tensor laid out by ``sbp``."""
    return jax.tree.map(lambda a: to_global(np.asarray(a), placement, sbp), microbatch, is_leaf=is_global)


def _described(data) -> str:
    if isinstance(data, (tuple, list, dict)):
        return f"a {type(data).__name__} of {len(data)}"
    return f"a {type(data).__name__}"
