"""Tracing a function to a flat list of primitive applications.

``jax.make_jaxpr`` gives a jaxpr with nested calls (``jit`` from ``jnp``
helpers, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``). The compiler
works on one flat program, so nested calls are inlined; the custom
differentiation rules they carry are not needed any more because the traced
function has already been differentiated (``jax.grad`` runs before tracing).
Dead equations are removed (:mod:`sbpjax.compiler.dead_code`) so every boxing
left in the plan is one XLA runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools

import jax
import numpy as np

try:  # the public home moved across JAX versions
    from jax.extend.core import Literal as _Literal
except ImportError:  # pragma: no cover
    from jax.core import Literal as _Literal  # type: ignore[attr-defined,no-redef]

from sbpjax.compiler import rewrites
from sbpjax.compiler.dead_code import dce, live_roots
from sbpjax.compiler.loop_eqns import batched_while, scan_operands
from sbpjax.compiler.program import (
    UNKNOWN_SOURCE,
    Cond,
    Const,
    EqnText,
    Iteration,
    Loop,
    Node,
    Program,
    Var,
    source_of,
)
from sbpjax.compiler.returns import checked_returns
from sbpjax.compiler.small_jaxprs import index_jaxpr, jaxpr_of
from sbpjax.dtypes import constant_bits

INLINE = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "checkpoint",
    "remat",
    "remat2",
}
_JAXPR_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_regions = itertools.count(1)
_conds = itertools.count(1)

# jax.checkpoint / nnx.remat regions (with prevent_cse, their default) are
# inlined like other calls, but their equations are not merged with equal ones
# outside (the recomputation in the backward pass would otherwise become the
# forward value again, and the activations would be kept), and their nodes are
# tagged with a region: the lowering puts one optimization barrier over the
# region's inputs, as jax.jit's lowering of checkpoint does, so XLA neither
# merges the recomputation nor hoists it before the cotangent it waits for.
REMAT = ("checkpoint", "remat", "remat2")

# Loops and branches are flattened too, while the flat program stays this many
# equations or fewer per loop or branch (iterations x body size): a scan over
# stacked layers, a fori_loop with static bounds (JAX spells it as a scan) and
# a cond / switch become straight-line code the layout choice sees whole.
# Decision: flattening rather than a loop rule with fixed-point carry layouts
# solved on the body alone, because it reuses the whole-program choice
# unchanged and is exact (the boundary iterations may take other layouts
# than the ones between); the solver then gives the iterations of a scan the
# same choices (classes.loop_classes), and the lowering rolls alike iterations
# back into one lax.scan (sbpjax.compiler.loops), so the compiled program
# keeps the loop with its collectives inside. A cond / switch is written out
# as its branches followed by one select_n per result (the layout choice sees
# every branch); the lowering runs it as a lax.switch again, each branch's
# ops and boxings inside its branch, so only the branch taken computes (see
# Cond). Loops above the limit, and while loops whose trip count is only
# known at run time, stay one equation each, planned as loops of their own
# (sbpjax.compiler.inner_loops).
# The default of ``CompileOptions.unroll_limit``.
UNROLL_LIMIT = 20_000

# Each written-out scan slices its stacked operands itself: its slices are not
# merged with equal ones outside it (another loop's, or code before). Merged,
# the backward pass of scanned layers read the forward loop's slices, and with
# them the forward's boxings of them: the weights each layer gathered were
# handed from the forward loop to the backward one as a stack, every layer's
# gathered weights alive between the passes (the model zoo's scanned decoder
# peaked at 1.15x GSPMD's memory for 8% fewer bytes). Now the backward loop
# slices and boxes them again, as GSPMD does and as FSDP does by default
# (reshard after forward); the layout choice prices both boxings and may give
# the two passes different layouts. That decoder: 74.1 MB moved instead of
# 68.9 (GSPMD: 99.0), peak 7.1 MB instead of 10.3 (GSPMD: 8.9), and the forward
# pass's last layer is no longer peeled out of its loop. False: merge them.
# The default of ``CompileOptions.loop_slices``.
LOOP_SLICES = True


def _dtype(d):
    """A NumPy dtype, or JAX's own for extended dtypes (typed PRNG keys, whose
    ``itemsize`` is their key data's)."""
    try:
        return np.dtype(d)
    except TypeError:
        return d


def _inner_jaxpr(eqn):
    for k in _JAXPR_KEYS:
        j = eqn.params.get(k)
        if j is not None:
            return j
    return None


# The placement of the sj.jit tracing a function, while it does: an sj.jit
# function called inside is inlined (CompiledFunction.__call__), its layouts
# kept as sj.constrain points
_TRACING: contextvars.ContextVar = contextvars.ContextVar("sbpjax_tracing", default=None)


def tracing_on():
    """The placement of the ``sj.jit`` tracing the caller, or None."""
    return _TRACING.get()


@contextlib.contextmanager
def _tracing(placement):
    token = _TRACING.set(placement)
    try:
        yield
    finally:
        _TRACING.reset(token)


def trace(
    fn,
    leaves_avals,
    in_tree,
    unroll_limit: int = UNROLL_LIMIT,
    loop_slices: bool = LOOP_SLICES,
    keep_last_carries: bool = True,
    placement=None,
    devices: int | None = None,
) -> Program:
    """Trace ``fn`` on abstract leaves; inline nested calls; drop dead code.
    ``unroll_limit`` and ``loop_slices``: see ``UNROLL_LIMIT``, ``LOOP_SLICES``
    (``sj.CompileOptions`` sets both). ``keep_last_carries``: the carries a
    written-out scan's last iteration makes are kept though nothing reads
    them (see :func:`sbpjax.compiler.dead_code.last_carries`); ``sj.jit`` keeps them where it rolls
    loops (``CompileOptions.roll_loops``). ``placement``: ``sj.jit``'s, for
    the ``sj.jit`` functions ``fn`` calls (:func:`tracing_on`). ``devices``:
    the placement's device count, where known (``rewrites.rolls``; default:
    ``placement``'s)."""
    if devices is None and placement is not None:
        devices = placement.size

    def flat_fn(*leaves):
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        return checked_returns(fn, fn(*args, **kwargs))

    with _tracing(placement):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves_avals)
    out_tree = jax.tree_util.tree_structure(out_shape)
    inputs = [Var(tuple(a.shape), _dtype(a.dtype), name=f"arg{i}") for i, a in enumerate(leaves_avals)]
    nodes: list = []
    flat = _Flattening(unroll_limit=unroll_limit, loop_slices=loop_slices)
    outs = _inline(closed.jaxpr, list(closed.consts), inputs, nodes, flat=flat)
    roots, nodes = live_roots(nodes, outs, flat.loops) if keep_last_carries else (outs, dce(nodes, outs))
    nodes = dce(rewrites.fuse_padded_windows(nodes, roots, _emit), roots)
    nodes = dce(
        rewrites.fuse_shifts(rewrites.rolls(rewrites.splits_as_slices(nodes, _emit), _emit, devices), _emit),
        roots,
    )
    # after fuse_shifts: a slice of a padded value is then a pad of its own, and
    # convolutions may be the padded value's only readers
    nodes = dce(rewrites.fuse_padded_convs(nodes, roots, _emit), roots)
    return Program(inputs, nodes, outs, out_tree, flat.loops, flat.conds)


@dataclasses.dataclass
class _Flattening:
    """What writing loops and branches out needs: the limits, and the
    loops and conds written out so far."""

    unroll_limit: int = UNROLL_LIMIT
    loop_slices: bool = LOOP_SLICES
    loops: list = dataclasses.field(default_factory=list)
    conds: list = dataclasses.field(default_factory=list)
    texts: dict = dataclasses.field(default_factory=dict)  # id(eqn) -> its EqnText
    expansions: dict = dataclasses.field(default_factory=dict)  # id(eqn) -> (eqn, _hi_expansion's)
    zeros: dict = dataclasses.field(default_factory=dict)  # id(Var) -> the zero it holds (rewrites.zero_made)


def _inline(jaxpr, consts, in_atoms, nodes, cse=None, flat=None):
    cse = {} if cse is None else cse
    flat = _Flattening() if flat is None else flat
    env: dict = {}
    for v, c in zip(jaxpr.constvars, consts):
        env[v] = Const(c)
    for v, a in zip(jaxpr.invars, in_atoms):
        env[v] = a

    def read(v):
        if isinstance(v, _Literal):
            return Const(v.val)
        return env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        written = _flatten_control(eqn, ins, nodes, cse, flat)
        if written is not None:
            for v, o in zip(eqn.outvars, written):
                env[v] = o
            continue
        inner = _inner_jaxpr(eqn) if eqn.primitive.name in INLINE else _hi_expansion(eqn, flat)
        if inner is not None:
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = list(getattr(inner, "consts", ()))
            if len(inner_jaxpr.invars) == len(ins):
                start, marks = len(nodes), (len(flat.loops), len(flat.conds))
                if eqn.primitive.name in REMAT and eqn.params.get("prevent_cse", False):
                    outs = _inline(inner_jaxpr, inner_consts, ins, nodes, {}, flat)
                    region = next(_regions)
                    for n in nodes[start:]:
                        n.region = n.region or region  # the innermost region wins
                else:
                    outs = _inline(inner_jaxpr, inner_consts, ins, nodes, cse, flat)
                # an expansion was traced here, not in the user's code: all of it is the call's
                expanded = eqn.primitive.name not in INLINE
                control = flat.loops[marks[0] :] + flat.conds[marks[1] :]
                _name_unnamed(nodes[start:], control, eqn, flat, every=expanded)
                for v, o in zip(eqn.outvars, outs):
                    env[v] = o
                continue
        same = rewrites.identity_operand(eqn, ins, flat.zeros)
        if same is not None:  # x - 0: the operand itself
            env[eqn.outvars[0]] = same
            continue
        texts = _texts(eqn, flat)
        key = _cse_key(eqn, ins, texts)
        if key is not None and key in cse:
            outs = cse[key]
        else:
            outs = [Var(tuple(v.aval.shape), _dtype(v.aval.dtype)) for v in eqn.outvars]
            nodes.append(Node(eqn, ins, outs, texts.source, texts=texts))
            if key is not None:
                cse[key] = outs
        zero = rewrites.zero_made(eqn, ins, flat.zeros)
        if zero is not None:
            flat.zeros[id(outs[0])] = zero
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _hi_expansion(eqn, flat):
    """The jaxpr, in JAX's own primitives, of a higher-level primitive
    (``call_hi_primitive`` of jax >= 0.12, which spells ``jnp.searchsorted``
    so): its ``expand`` traced on the equation's avals, once per equation; a
    ``while`` on a batched predicate as a loop on one (``batched_while``); or
    None for any other equation, or one that cannot be expanded (it then runs
    whole on every device, and a warning says so)."""
    if eqn.primitive.name not in ("call_hi_primitive", "while"):
        return None
    kept = flat.expansions.get(id(eqn))
    if kept is not None:
        return kept[1]
    if eqn.primitive.name == "while":
        flat.expansions[id(eqn)] = (eqn, batched_while(eqn))
        return flat.expansions[id(eqn)][1]
    prim = eqn.params.get("_prim")
    expand, in_tree, out_tree = (getattr(prim, k, None) for k in ("expand", "in_tree", "out_tree"))
    closed = None
    if expand is not None and in_tree is not None and out_tree is not None:

        def flat_expand(*leaves):
            return out_tree.flatten_up_to(expand(*in_tree.unflatten(leaves)))

        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
        try:
            closed = jax.make_jaxpr(flat_expand)(*avals)
        except Exception:  # noqa: BLE001 - an expansion this JAX spells otherwise: kept whole
            closed = None
    flat.expansions[id(eqn)] = (eqn, closed)  # the eqn kept alive, so the id stays its own
    return closed


def _name_unnamed(inlined, control, call, flat, every: bool = False) -> None:
    """Give the inlined nodes, and the loops and conds written out with them
    (``control``), whose equations carry no frame the call's line (``every``:
    all of them, for an expansion sbpjax traced itself, whose frames are its
    own). JAX's own jitted helpers (``jnp.take_along_axis``'s index arithmetic
    and gather) are traced with no traceback of their own; ``explain()``
    listed them as ``<unknown>``. The call's line is computed only where
    needed."""
    unnamed = [n for n in [*inlined, *control] if every or n.source == UNKNOWN_SOURCE]
    if unnamed:
        source = _texts(call, flat).source
        for n in unnamed:
            n.source = source


def _texts(eqn, flat) -> EqnText:
    """The equation's EqnText, made once per equation (``_Flattening.texts``)."""
    texts = flat.texts.get(id(eqn))
    if texts is None:  # kept alive by flat.texts, so the id stays its own
        texts = flat.texts[id(eqn)] = EqnText(eqn)
    return texts


def _emit(fn, atoms, nodes, cse, what=None, flat=None):
    """Append the equations of ``fn`` (a small JAX function) applied to ``atoms``;
    ``what`` names what ``fn`` computes, to make its jaxpr once per shape
    (``small_jaxprs``)."""
    return _inline_closed(jaxpr_of(what, fn, atoms), atoms, nodes, cse, flat)


def _inline_closed(closed, atoms, nodes, cse, flat=None):
    return _inline(closed.jaxpr, list(closed.consts), list(atoms), nodes, cse, flat)


def _size(closed) -> int:
    return len(getattr(closed, "jaxpr", closed).eqns)


def _flatten_control(eqn, ins, nodes, cse, flat):
    """The outputs of a scan or cond written out as straight-line code (see
    ``UNROLL_LIMIT``), or None to keep the equation as it is."""
    if getattr(eqn, "effects", None):
        return None
    name = eqn.primitive.name
    if name == "scan":
        return _flatten_scan(eqn, ins, nodes, cse, flat)
    if name == "custom_linear_solve":
        return _linear_solve(eqn.params, ins, nodes, cse, flat)
    if name == "cond":
        return _flatten_cond(eqn, ins, nodes, cse, flat)
    return None


def _flatten_scan(eqn, ins, nodes, cse, flat):
    """A scan as its iterations one after another (a :class:`Loop` records
    them), its stacked outputs stacked from each iteration's."""
    p = eqn.params
    body, length = p["jaxpr"], p["length"]
    if length == 0 or length * max(_size(body), 1) > flat.unroll_limit:
        return None
    consts, carry, xs = scan_operands(p, ins)
    if "ft_out" in p:  # jax >= 0.12 groups the results as flat trees

        def split_out(outs):
            return (list(g) for g in p["ft_out"].update(outs).unpack())

    else:
        n_carry = len(carry)

        def split_out(outs):
            return outs[:n_carry], outs[n_carry:]

    ys: dict = {}
    source = source_of(eqn)
    slice_cse = {} if flat.loop_slices else cse
    loop = Loop(p["reverse"], len(consts), len(carry), list(xs), [])
    for i in reversed(range(length)) if p["reverse"] else range(length):
        sliced_from = len(nodes)
        x_i = [_inline_closed(index_jaxpr(x, i), [x], nodes, slice_cse, flat)[0] for x in xs]
        start = len(nodes)
        slicing = nodes[sliced_from:start]
        for n in slicing:  # made by sbpjax's small jaxprs: the scan's line is the user's
            n.source = source
        ins_i = consts + carry + x_i
        # a copy of the merge table: equal equations merge within the iteration
        # and with the code before the loop, never across iterations (the
        # lowering rolls iterations that are alike back into one loop body)
        outs_i = _inline(body.jaxpr, list(body.consts), ins_i, nodes, dict(cse), flat)
        made = {id(o) for n in nodes[start:] for o in n.outs}
        loop.iterations.append(Iteration(i, ins_i, list(outs_i), made, slicing))
        carry, ys[i] = split_out(outs_i)

    def stack(vs):
        return _emit(lambda *v: jax.numpy.stack(v), vs, nodes, cse, what="stack", flat=flat)[0]

    stacking = len(nodes)
    stacked = [stack([ys[i][k] for i in range(length)]) for k in range(len(ys[0]))]
    for n in nodes[stacking:]:
        n.source = source
    if len(carry) + len(stacked) != len(eqn.outvars):
        return None  # a form of scan not known here: kept whole (what was emitted is dead, dce drops it)
    loop.stacked, loop.source = list(stacked), source
    flat.loops.append(loop)
    return carry + stacked


def _flatten_cond(eqn, ins, nodes, cse, flat):
    """A cond as every branch followed by one ``select_n`` per result (a
    :class:`Cond` records them)."""
    branches = eqn.params["branches"]
    if sum(_size(b) for b in branches) > flat.unroll_limit:
        return None
    index, operands = ins[0], ins[1:]
    if len(branches) == 1:
        return _inline(branches[0].jaxpr, list(branches[0].consts), operands, nodes, cse, flat)
    cond = Cond(next(_conds), index, len(branches), [], source_of(eqn))
    results = []
    for k, b in enumerate(branches):
        start = len(nodes)
        # a copy of the merge table: a branch's equations may read the code
        # before the cond, but nothing outside the branch reads its values
        results.append(_inline(b.jaxpr, list(b.consts), operands, nodes, dict(cse), flat))
        for n in nodes[start:]:
            n.branch = ((cond.id, k), *n.branch)
    # lax.switch has already clamped the index; select_n picks case ``index``
    outs = []
    for cases in zip(*results):
        start = len(nodes)
        outs.append(_emit(lambda i, *cases: jax.lax.select_n(i, *cases), [index, *cases], nodes, {})[0])
        for n in nodes[start:]:
            n.source = cond.source  # the user's cond, not this line
        cond.selects += [n for n in nodes[start:] if n.name == "select_n"]
    flat.conds.append(cond)
    return outs


def _linear_solve(params, ins, nodes, cse, flat):
    """``lax.custom_linear_solve`` (``jnp.linalg.solve`` and ``inv``) as its
    value: its ``solve`` jaxpr on the solve's constants and the right-hand
    side. Its other jaxprs define only its derivatives, which the trace has
    taken already. Kept whole, it ran whole on every device: a batch of
    systems split by system was gathered."""
    n = params["const_lengths"]
    solve = params["jaxprs"].solve
    start = n.matvec + n.vecmat
    operands = ins[start : start + n.solve] + ins[sum(n) :]
    if len(solve.jaxpr.invars) != len(operands):
        return None  # a form this JAX spells otherwise: kept whole
    return _inline(solve.jaxpr, list(solve.consts), operands, nodes, cse, flat)


def _cse_key(eqn, ins, texts):
    """Equal equations on equal inputs compute equal values; XLA merges them,
    so the plan must too (else it would count a boxing XLA never runs).
    ``texts``: the equation's EqnText (its params' text)."""
    if getattr(eqn, "effects", None):
        return None
    try:
        params = texts.params
    except Exception:  # noqa: BLE001 - unprintable params: do not merge
        return None
    args = []
    for a in ins:
        if isinstance(a, Var):
            args.append(("v", a.id))
        elif np.ndim(a.value) == 0:
            bits = constant_bits(a.value)  # a typed key: its key data
            args.append(("c", str(getattr(a.value, "dtype", bits.dtype)), bits.tobytes()))
        else:
            return None
    return (eqn.primitive.name, params, tuple(args))
