"""A stage's backward split into B (input cotangents) and W (weight cotangents) from one VJP.

Zero-bubble schedules run a stage's backward as two actions: **B** computes the
cotangent of the stage input, which the previous stage waits for, and **W**
computes the parameters' cotangents, which only the optimizer update waits
for, so W can fill the pipeline's idle time. Both come from one ``jax.vjp`` of
the stage, traced once into a jaxpr::

    forward equations      -> the output, and the residuals the VJP keeps
    backward equations     -> every cotangent, reading only residuals, inputs
                              and the output cotangent

The forward equations are those the output and JAX's residuals need; F runs
them and keeps the residuals the backward reads (no recompute of the forward,
beyond what the user's own ``jax.checkpoint`` asks for: a checkpointed region's
residuals are its inputs, and its recompute is a backward equation). The
backward equations are flattened (nested ``jit`` / ``checkpoint`` calls
inlined, short scans written out) and partitioned: B is every equation the
input cotangent needs; W is the rest of what the parameter cotangents need.
Each equation runs exactly once, in B or in W, so B then W does the work of
the full backward and no more. What W reads from B (cotangents of inner
values, a recomputed activation) is **kept**: B returns it, W takes it.

Decision: partition the traced backward rather than differentiate twice (one
VJP for the input, one for the weights): two VJPs run the shared part of the
transposed program twice. The jaxpr is the program JAX would run anyway; the
partition only decides which of the two actions runs each equation.

An equation that cannot be split (a long scan, a while loop, a custom call)
goes whole to B if B needs any of its results; its parameter cotangents are
then kept values W only adds up. Results are the same, W is just smaller.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

try:  # the public home moved across JAX versions
    from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
except ImportError:  # pragma: no cover
    from jax.core import ClosedJaxpr, Jaxpr, Literal  # type: ignore[attr-defined,no-redef]

try:  # where an equation came from; private, so optional
    from jax._src.source_info_util import user_context as _user_context
except ImportError:  # pragma: no cover
    import contextlib

    def _user_context(traceback):  # type: ignore[no-redef]
        return contextlib.nullcontext()


# calls whose body is inlined into the backward so that B and W can take its parts
_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "checkpoint": "jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
}
# A backward scan is written out (one body per iteration) while it stays this
# many equations or fewer, so B and W each take their part of every
# iteration; longer scans stay one equation (whole in B). The same bound as the
# compiler's own unrolling (sbpjax.compiler.trace.UNROLL_LIMIT), which rolls
# alike iterations back into a loop, so the written-out form costs nothing more.
UNROLL_LIMIT = 20_000


class _Ref:
    """A value of the flattened backward (fresh per inlined call, so a jaxpr
    inlined twice gets two sets)."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


@dataclasses.dataclass(frozen=True)
class _Const:
    """A literal or a closed-over constant."""

    value: object


@dataclasses.dataclass(frozen=True, eq=False)
class _Op:
    """One step of a flattened program: ``run(*inputs) -> outputs``."""

    run: Callable
    ins: tuple
    outs: tuple
    effectful: bool = False


def _bind(eqn) -> Callable:
    """Apply the equation's primitive again, as ``jax.core.eval_jaxpr`` does,
    under its source location (errors and sj.jit's reports name the user's line)."""
    prim = eqn.primitive
    params = prim.get_bind_params(eqn.params)
    traceback, ctx = eqn.source_info.traceback, eqn.ctx.manager

    def run(*args):
        with _user_context(traceback), ctx:
            out = prim.bind(*args, **params)
        return list(out) if prim.multiple_results else [out]

    return run


def _read(env: dict, v):
    if isinstance(v, Literal):
        return _Const(v.val)
    return env[v]


def _flatten(eqns, env: dict, ops: list, inline: bool) -> None:
    """Append ``eqns`` to ``ops``; ``env`` maps each jaxpr variable to its ref.
    With ``inline``, call bodies and short scans are written out."""
    for eqn in eqns:
        ins = [_read(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if inline and name in _CALLS and _CALLS[name] in eqn.params:
            _inline(eqn.params[_CALLS[name]], ins, eqn.outvars, env, ops)
            continue
        if inline and name == "scan" and _scan_size(eqn) <= UNROLL_LIMIT:
            _unroll_scan(eqn, ins, env, ops)
            continue
        outs = tuple(_Ref(v.aval) for v in eqn.outvars)
        for v, r in zip(eqn.outvars, outs):
            env[v] = r
        ops.append(_Op(_bind(eqn), tuple(ins), outs, bool(eqn.effects)))


def _inline(body, ins, outvars, env, ops) -> list:
    """Write ``body`` (a Jaxpr or ClosedJaxpr) out with inputs ``ins``; bind its
    results to ``outvars`` (outer variables) when given and return their refs."""
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
    inner: dict = {v: _Const(c) for v, c in zip(jaxpr.constvars, consts)}
    inner.update(zip(jaxpr.invars, ins))
    _flatten(jaxpr.eqns, inner, ops, True)
    results = [_read(inner, v) for v in jaxpr.outvars]
    for v, r in zip(outvars, results):
        env[v] = r
    return results


def _scan_size(eqn) -> int:
    return eqn.params["length"] * max(len(eqn.params["jaxpr"].jaxpr.eqns), 1)


def _scan_parts(params, values) -> tuple[list, list, list]:
    """A scan's operands as (constants, carries, stacked ones); jax >= 0.12
    groups them as flat trees (``ft_in``), older versions give counts."""
    if "ft_in" in params:
        consts, carry, xs = (list(g) for g in params["ft_in"].update(values).unpack())
        return consts, carry, xs
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    return values[:n_consts], values[n_consts : n_consts + n_carry], values[n_consts + n_carry :]


def _scan_results(params, values, n_carry: int) -> tuple[list, list]:
    """A scan body's results as (carries, per-iteration outputs)."""
    if "ft_out" in params:
        carry, ys = (list(g) for g in params["ft_out"].update(values).unpack())
        return carry, ys
    return list(values[:n_carry]), list(values[n_carry:])


def _unroll_scan(eqn, ins, env, ops) -> None:
    """A scan as its iterations: slice each ``xs`` row, run the body, stack ``ys``."""
    p = eqn.params
    consts, carry, xs = _scan_parts(p, list(ins))
    body, length, n_carry = p["jaxpr"], p["length"], len(carry)
    row_avals = _scan_parts(p, [v.aval for v in body.jaxpr.invars])[2]
    ys_avals = _scan_results(p, [v.aval for v in eqn.outvars], n_carry)[1]
    ys_rows: list[list[tuple[int, _Ref]]] = [[] for _ in ys_avals]
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        rows = []
        for x, aval in zip(xs, row_avals):
            row = _Ref(aval)
            ops.append(_Op(lambda a, i=i: [lax.index_in_dim(a, i, keepdims=False)], (x,), (row,)))
            rows.append(row)
        carry, ys = _scan_results(p, _inline(body, [*consts, *carry, *rows], (), env, ops), n_carry)
        for k, y in enumerate(ys):
            ys_rows[k].append((i, y))
    stacked = []
    for per_iteration, aval in zip(ys_rows, ys_avals):
        ref = _Ref(aval)
        ordered = tuple(y for _, y in sorted(per_iteration, key=lambda t: t[0]))
        ops.append(_Op(lambda *a: [jnp.stack(a)], ordered, (ref,)))
        stacked.append(ref)
    for v, r in zip(eqn.outvars, [*carry, *stacked]):
        env[v] = r


def _live(ops: Sequence[_Op], wanted) -> list[bool]:
    """Which ops the ``wanted`` refs need (dead-code elimination), effectful ones kept."""
    need = {id(r) for r in wanted if isinstance(r, _Ref)}
    live = [False] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.effectful or any(id(o) in need for o in op.outs):
            live[i] = True
            need.update(id(r) for r in op.ins if isinstance(r, _Ref))
    return live


def _run(ops: Sequence[_Op], values: dict) -> None:
    """Evaluate ``ops`` in order; ``values`` maps ``id(ref)`` to its value."""
    for op in ops:
        args = [r.value if isinstance(r, _Const) else values[id(r)] for r in op.ins]
        for r, v in zip(op.outs, op.run(*args)):
            values[id(r)] = v


def _value(values: dict, r):
    return r.value if isinstance(r, _Const) else values[id(r)]


def _defined(ops: Sequence[_Op]) -> set:
    return {id(o) for op in ops for o in op.outs}


def _reads(ops: Sequence[_Op]) -> dict:
    """Refs read by ``ops`` and not defined by them, by id (in first-read order)."""
    defined: set = set()
    read: dict = {}
    for op in ops:
        for r in op.ins:
            if isinstance(r, _Ref) and id(r) not in defined:
                read.setdefault(id(r), r)
        defined.update(id(o) for o in op.outs)
    return read


@dataclasses.dataclass(frozen=True)
class SplitVJP:
    """One stage's VJP as three programs over flat leaves (see the module docstring).

    Arguments of every program: ``args``, the flat leaves of ``(params, x, *rest)``.
    ``forward(args) -> (outputs, saved)``; ``backward_input(args, saved_b, ct)
    -> (input cotangents, kept)``; ``backward_weight(args, saved_w, ct, kept) ->
    parameter cotangents``; ``backward(args, saved, ct)`` both at once (B then W
    in one program). ``saved_b`` / ``saved_w`` are the entries of ``saved``
    at ``saved_for_input`` / ``saved_for_weight``."""

    out_tree: object  # the treedef of fn's output
    forward_ops: tuple
    input_ops: tuple
    weight_ops: tuple
    arg_refs: tuple
    ct_refs: tuple
    out_refs: tuple
    saved_refs: tuple
    saved_for_input: tuple[int, ...]
    saved_for_weight: tuple[int, ...]
    kept_refs: tuple
    dparam_refs: tuple
    dinput_refs: tuple
    weight_reads_ct: bool  # whether W reads the output cotangent

    def forward(self, args):
        values = dict(zip(map(id, self.arg_refs), args))
        _run(self.forward_ops, values)
        return [_value(values, r) for r in self.out_refs], [_value(values, r) for r in self.saved_refs]

    def _start(self, args, saved_refs, saved, ct):
        values = dict(zip(map(id, self.arg_refs), args))
        values.update(zip(map(id, saved_refs), saved))
        values.update(zip(map(id, self.ct_refs), ct))
        return values

    def backward_input(self, args, saved_b, ct):
        refs = [self.saved_refs[i] for i in self.saved_for_input]
        values = self._start(args, refs, saved_b, ct)
        _run(self.input_ops, values)
        return [_value(values, r) for r in self.dinput_refs], [_value(values, r) for r in self.kept_refs]

    def backward_weight(self, args, saved_w, ct, kept):
        refs = [self.saved_refs[i] for i in self.saved_for_weight]
        values = self._start(args, refs, saved_w, ct)
        values.update(zip(map(id, self.kept_refs), kept))
        _run(self.weight_ops, values)
        return [_value(values, r) for r in self.dparam_refs]

    def backward(self, args, saved, ct):
        values = self._start(args, self.saved_refs, saved, ct)
        _run(self.input_ops, values)
        _run(self.weight_ops, values)
        return [_value(values, r) for r in self.dinput_refs], [_value(values, r) for r in self.dparam_refs]

    @property
    def kept_nbytes(self) -> int:
        """Bytes of the values B computes for W (logical; W also reads saved residuals)."""
        return sum(_nbytes(r.aval) for r in self.kept_refs if isinstance(r, _Ref))


def _nbytes(aval) -> int:
    if aval is None or not hasattr(aval, "dtype"):
        return 0
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _from_parameters(forward_ops, param_refs, backward) -> list[_Op]:
    """The forward ops whose results the backward reads and that depend on the
    parameters alone (a weight cast to the compute dtype, a transposed or
    stacked weight): the backward computes them again instead of F keeping one
    copy per microbatch in flight. Work without a batch dimension, the same in
    every microbatch; the activations are never recomputed."""
    free = {id(r) for r in param_refs}
    for op in forward_ops:
        if not op.effectful and all(isinstance(r, _Const) or id(r) in free for r in op.ins):
            free.update(id(o) for o in op.outs)
    read = _reads(backward)
    wanted = [r for i, r in read.items() if i in free and i not in {id(p) for p in param_refs}]
    ops = [op for op in forward_ops if any(id(o) in free for o in op.outs)]
    return [op for op, keep in zip(ops, _live(ops, wanted)) if keep]


def split_vjp(fn: Callable, args: Sequence, n_params: int, n_inputs: int) -> SplitVJP:
    """Trace ``fn(*tree)`` (``args``: flat leaves as abstract values or arrays, of
    which the first ``n_params`` are parameters and the next ``n_inputs`` the
    differentiated input; the rest are not differentiated) and split its VJP."""
    args = list(args)
    n_diff = n_params + n_inputs

    def full(diff, rest, ct):
        out, vjp = jax.vjp(lambda *d: fn(*d, *rest), *diff)
        residuals = jax.tree_util.tree_leaves(vjp)
        return out, residuals, vjp(ct)

    abstract = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
    out_shape = jax.eval_shape(lambda *a: fn(*a), *abstract)
    closed, shapes = jax.make_jaxpr(full, return_shape=True)(abstract[:n_diff], abstract[n_diff:], out_shape)
    jaxpr: Jaxpr = closed.jaxpr
    n_out = len(jax.tree_util.tree_leaves(shapes[0]))
    n_res = len(shapes[1])

    env: dict = {v: _Const(c) for v, c in zip(jaxpr.constvars, closed.consts)}
    arg_refs = tuple(_Ref(v.aval) for v in jaxpr.invars[: len(args)])
    ct_refs = tuple(_Ref(v.aval) for v in jaxpr.invars[len(args) :])
    env.update(zip(jaxpr.invars, (*arg_refs, *ct_refs)))

    # forward: what the outputs and JAX's residuals need, run as traced (not inlined)
    outvars = jaxpr.outvars
    top: list[_Op] = []  # one op per equation, in order
    _flatten(jaxpr.eqns, env, top, inline=False)
    out_refs = tuple(_read(env, v) for v in outvars[:n_out])
    res_refs = [_read(env, v) for v in outvars[n_out : n_out + n_res]]
    ct_out = [_read(env, v) for v in outvars[n_out + n_res :]]
    fwd_live = _live(top, [*out_refs, *res_refs])
    forward_ops = tuple(op for op, keep in zip(top, fwd_live) if keep)

    # backward: the rest of what the cotangents need, flattened so B and W can split it
    bwd_live = _live(top, ct_out)
    backward: list[_Op] = []
    _flatten([e for e, f, b in zip(jaxpr.eqns, fwd_live, bwd_live) if b and not f], env, backward, True)
    ct_out = [_read(env, v) for v in outvars[n_out + n_res :]]
    backward = _from_parameters(forward_ops, arg_refs[:n_params], backward) + backward
    dparam_refs, dinput_refs = tuple(ct_out[:n_params]), tuple(ct_out[n_params:n_diff])

    in_live = _live(backward, dinput_refs)
    input_ops = tuple(op for op, keep in zip(backward, in_live) if keep)
    rest = [op for op, keep in zip(backward, in_live) if not keep]
    weight_ops = tuple(op for op, keep in zip(rest, _live(rest, dparam_refs)) if keep)

    fwd_defined = _defined(forward_ops)
    b_reads, w_reads = _reads(input_ops), _reads(weight_ops)
    saved = [r for i, r in _reads(backward).items() if i in fwd_defined]
    saved_index = {id(r): k for k, r in enumerate(saved)}
    b_defined = _defined(input_ops)
    kept = [r for i, r in w_reads.items() if i in b_defined]
    kept += [r for r in dparam_refs if isinstance(r, _Ref) and id(r) in b_defined and id(r) not in w_reads]
    return SplitVJP(
        out_tree=jax.tree_util.tree_structure(out_shape),
        forward_ops=forward_ops,
        input_ops=input_ops,
        weight_ops=weight_ops,
        arg_refs=arg_refs,
        ct_refs=ct_refs,
        out_refs=out_refs,
        saved_refs=tuple(saved),
        saved_for_input=tuple(saved_index[i] for i in b_reads if i in saved_index),
        saved_for_weight=tuple(saved_index[i] for i in w_reads if i in saved_index),
        kept_refs=tuple(kept),
        dparam_refs=dparam_refs,
        dinput_refs=dinput_refs,
        weight_reads_ct=any(id(r) in w_reads for r in ct_refs),
    )
