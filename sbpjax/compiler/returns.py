"""What the function ``sj.jit`` traces returned: JAX values only.

A string or another Python object among a compiled program's outputs is the
user's mistake, and JAX's own error names the tracer's wrapper (sbpjax's
``flat_fn``), not the user's function. Checked on the function's own result,
so a non-array returned by a ``jax.jit`` or ``lax.cond`` inside it keeps
JAX's error, which names that call.
"""

from __future__ import annotations

import inspect

import jax
import jax.extend.core as jcore

from sbpjax._errors import SBPError


def named(fn) -> str:
    """``fn`` as a user reads it: its name and where it is defined."""
    inner = inspect.unwrap(fn)
    inner = getattr(inner, "func", inner)  # a functools.partial: the function it wraps
    code = getattr(inner, "__code__", None)
    name = getattr(inner, "__qualname__", None) or repr(inner)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def checked_returns(fn, out):
    """``out``, ``fn``'s result, if every leaf is a JAX value; else an
    SBPError naming ``fn`` and the output's place."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not jcore.valid_jaxtype(leaf):
            raise SBPError(
                f"sj.jit: {named(fn)} returned a {type(leaf).__name__} at output{jax.tree_util.keystr(path)}; "
                "return arrays or pytrees of them (a string or other Python object cannot be an output "
                "of a compiled program: return it from a function around the sj.jit call)."
            )
    return out


__all__ = ["checked_returns", "named"]
