"""Primitives every device runs on the whole value: random number generation
(every device draws the same numbers from a broadcast key), sorting and top-k along a dim;
and debug callbacks, which the first device runs on the whole value.

Control flow (``scan``, ``while``, ``cond``) is handled by the compiler: it
writes scans and conds out (``sbpjax.compiler.trace``) and plans a while loop
with a run-time trip count, or a scan too long to write out, as a loop of its
own (``sbpjax.compiler.inner_loops``).
What it cannot handle, and primitives without a rule, run whole on every
device with their operands boxed to B, with a warning naming them and their
source line.
"""

from __future__ import annotations

import functools
import operator

import jax
from jax import lax

from sbpjax._errors import SBPError
from sbpjax.dtypes import is_key_dtype
from sbpjax.rules import B, Sig, rank, register, set_local
from sbpjax.sbp import Split

RANDOM = (
    "random_bits",
    "random_seed",
    "random_wrap",
    "random_unwrap",
    "random_fold_in",
    "random_split",
    "threefry2x32",
    "random_clone",
    "rng_bit_generator",
    "rng_uniform",
)


# Primitives of typed key arrays that act on each key alone, so that an
# array of keys (``jax.random.split(key, n)`` mapped over with ``vmap``: a
# key per example) may be split on its key dims: name -> the number of key
# dims of the first operand.
# Threefry keys only: each key's numbers are a function of that key alone.
# An array of "rbg" keys draws from XLA's generator as a batch (measured: a
# device's rows drew other numbers than the same rows drawn whole).
PER_KEY = {
    "random_bits": rank,  # each key's bits: (*keys, *shape)
    "random_split": rank,  # each key's new keys: (*keys, *shape)
    "random_fold_in": rank,  # each key with its message
    "random_clone": rank,
    "random_unwrap": rank,  # each key's data: (*keys, 2)
    "random_seed": rank,  # a key per seed
    "random_wrap": lambda aval: rank(aval) - 1,  # the last dim is a key's data
}


@register(*RANDOM)
def random(eqn, in_avals):
    """``y = f(key)``: B in, B out (the same stream on every device); an
    array of keys may also be split on its key dims, each device drawing
    its own keys' numbers, which are the same numbers as drawn whole."""
    sigs = [Sig((B,) * len(in_avals), (B,) * len(eqn.outvars))]
    key_dims = PER_KEY.get(eqn.primitive.name)
    if key_dims is None or not _threefry(eqn, in_avals):
        return sigs
    keys = rank(in_avals[0])
    if any(rank(a) not in (0, keys) for a in in_avals):
        return sigs
    for d in range(key_dims(in_avals[0])):
        # a message of the keys' shape splits with them; a scalar one stays whole
        ins = tuple(Split(d) if rank(a) == keys else B for a in in_avals)
        sigs.append(Sig(ins, (Split(d),) * len(eqn.outvars)))
    return sigs


@functools.cache
def _threefry_dtype():
    return jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32")).dtype


def _threefry(eqn, in_avals) -> bool:
    """Whether the keys ``eqn`` reads or makes are threefry keys."""
    avals = [*in_avals, *(v.aval for v in eqn.outvars)]
    return any(is_key_dtype(a.dtype) and a.dtype == _threefry_dtype() for a in avals)


@register("platform_index")
def platform_index(eqn, in_avals):
    """Which branch ``lax.platform_dependent`` takes (``jnp.diag`` and other
    ops choose their lowering by platform through it): one int32 scalar made
    from no operand, the same on every device."""
    return [Sig((), (B,))]


@register("debug_callback", "debug_print")
def debug_callback(eqn, in_avals):
    """``jax.debug.print`` (``debug_print``) / ``jax.debug.callback``: the
    callback sees whole values (B) and runs on the placement's first device
    only, so it runs once per call as under ``jax.jit`` (in a ``shard_map``
    body every device would run it)."""
    return [Sig((B,) * len(in_avals), ())]


@set_local("debug_callback", "debug_print")
def local_debug_callback(eqn, ins, ctx):
    if eqn.params.get("ordered"):
        what = f"jax.debug.print({eqn.params['fmt']!r}, ...)" if "fmt" in eqn.params else "jax.debug.callback"
        raise SBPError(
            f"sj.jit: {what} asks for ordered=True, and JAX orders effects only in programs on one "
            f"device (this one runs on {ctx.placement.size} devices). Drop ordered=True: sj.jit runs "
            "each print once per call, from the first device."
        )
    first = functools.reduce(operator.and_, [lax.axis_index(n) == 0 for n in ctx.placement.axis_names])

    def call(xs):
        eqn.primitive.bind(*xs, **eqn.params)

    lax.cond(first, call, lambda xs: None, list(ins))
    return []


@register("shard_map")
def nested_shard_map(eqn, in_avals):
    """``jax.shard_map`` inside ``sj.jit``: refused. The program sj.jit writes
    is itself one shard_map over the placement's axes, and JAX nests
    shard_maps only over axes the outer one leaves automatic."""
    raise SBPError(
        "sj.jit: the function calls jax.shard_map, which sj.jit cannot hold: the program it writes is one "
        "shard_map over every axis of the placement, with its own collectives. Write the shard_map'd part "
        "as plain jax.numpy (sj.jit chooses its layouts; sj.constrain pins one), or call it outside sj.jit "
        "on the results' .to_jax() arrays."
    )


@register("sort")
def sort(eqn, in_avals):
    """``y_i = sort(x_i, dim)`` for splits off the sorted dim."""
    dim = eqn.params["dimension"]
    n_in, n_out = len(in_avals), len(eqn.outvars)
    return [Sig((Split(d),) * n_in, (Split(d),) * n_out) for d in range(rank(in_avals[0])) if d != dim] + [
        Sig((B,) * n_in, (B,) * n_out)
    ]


@register("top_k", "approx_top_k")
def top_k(eqn, in_avals):
    """``values_i, indices_i = top_k(x_i)`` for splits off the searched dim
    (the last one for ``lax.top_k``; ``reduction_dimension`` for
    ``approx_max_k``): each row is searched whole where it lives, so a top-2
    MoE router with tokens split stays split."""
    r = rank(in_avals[0])
    dim = eqn.params.get("axis", eqn.params.get("reduction_dimension", -1))
    dim = dim % r if r else 0
    n_out = len(eqn.outvars)
    return [Sig((Split(d),), (Split(d),) * n_out) for d in range(r) if d != dim] + [Sig((B,), (B,) * n_out)]
