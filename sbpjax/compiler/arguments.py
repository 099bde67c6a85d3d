"""How ``sj.jit`` reads its arguments' settings: ``in_sbp`` / ``out_sbp``
pytrees expanded to one nd-SBP per leaf (one rule for SBP values and their
text, see :func:`_canonical_spec`), optimizer-state layouts that mirror the
parameters' (:func:`state_sbp`), where a leaf sits in the call, and the
checks of ``donate_argnums``, ``regather`` and the retired
``solve_time_limit``. Shared by ``sj.jit`` and the Flax ``TrainStep``
(:mod:`sbpjax.flax.train`).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.auto import AUTO
from sbpjax.sbp import Broadcast, Partial, Split, normalize_nd_sbp, parse_sbp
from sbpjax.tensor import GlobalTensor


def is_nd_sbp(v) -> bool:
    """True for a non-empty tuple of SBP values (an nd-SBP, a leaf of in_sbp trees)."""
    return isinstance(v, tuple) and len(v) > 0 and all(isinstance(s, (Split, Broadcast, Partial)) for s in v)


def _is_sbp_leaf(v) -> bool:
    return v is None or v is AUTO or isinstance(v, (str, Split, Broadcast, Partial)) or is_nd_sbp(v)


def state_sbp(state, param_sbp, replicated: tuple):
    """An in_sbp/out_sbp tree for an optimizer state: every array leaf whose path
    ends with a parameter's path (optax's ``mu``/``nu`` mirror the parameters)
    takes that parameter's nd-SBP where it has the dims that splits
    (Adafactor's factored ``v_row`` / ``v_col`` have one dim fewer, and its
    placeholders one element: a split of a dim they lack, or of one element,
    is replaced by ``replicated``'s entry); scalars (step counts) and the rest
    take ``replicated``."""
    flat = [
        (jax.tree_util.keystr(k), v)
        for k, v in jax.tree_util.tree_flatten_with_path(param_sbp, is_leaf=is_nd_sbp)[0]
    ]

    def pick(path, leaf):
        if np.ndim(leaf) > 0:
            ks = jax.tree_util.keystr(path)
            for pk, nd in flat:
                if ks.endswith(pk):
                    if not is_nd_sbp(nd):
                        return nd
                    return tuple(
                        r
                        if isinstance(q, Split) and (q.dim >= np.ndim(leaf) or np.shape(leaf)[q.dim] == 1)
                        else q
                        for q, r in zip(nd, replicated)
                    )
        return replicated

    return jax.tree_util.tree_map_with_path(pick, state)


def leaf_paths(tree) -> list:
    """Key paths of the leaves of an ((args), {kwargs}) tree structure."""
    dummy = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def leaf_name(path) -> str:
    """``args[0]['fc1']['kernel']`` or ``kwargs['x']``: where a leaf sits in the call."""
    return ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])


def _one_sbp(v):
    """``v`` as a single SBP value (an SBP, or text naming exactly one), else None."""
    if isinstance(v, (Split, Broadcast, Partial)):
        return v
    if isinstance(v, str):
        parsed = parse_sbp(v)
        return parsed[0] if len(parsed) == 1 else None
    return None


def _one_per_value(spec) -> bool:
    """Whether ``spec`` is read, on a 1-D placement, as one SBP per value: a
    tuple or list of two or more single SBPs (see :func:`_canonical_spec`)."""
    return isinstance(spec, (tuple, list)) and len(spec) > 1 and all(_one_sbp(v) is not None for v in spec)


def _canonical_spec(spec, ndim: int, what: str):
    """An in_sbp / out_sbp tree with every nd-SBP written as a tuple of SBP values.

    The rule (the same for SBP values and their text): a string is always one
    whole nd-SBP ("S(0), B"); a tuple or list of single SBPs is one nd-SBP,
    except on a 1-D placement with other than one entry, where it is one bare
    SBP per entry of the argument tree (bare SBPs stand for nd-SBPs only on a
    1-D placement, so the two readings never compete); any other container is
    a tree whose entries follow the same rule."""
    if spec is None or spec is AUTO:
        return spec
    if isinstance(spec, str):
        return parse_sbp(spec)
    if isinstance(spec, (Split, Broadcast, Partial)):
        return (spec,)
    if isinstance(spec, (tuple, list)):
        single = [_one_sbp(v) for v in spec]
        n_single = sum(s is not None for s in single)
        if spec and n_single == len(spec):
            if ndim == 1 and _one_per_value(spec):
                return _rebuild(spec, [(s,) for s in single])
            return tuple(single)  # one nd-SBP (its length is checked against the placement later)
        if n_single and ndim > 1:
            raise SBPError(
                f"sj.jit: {what} entry {spec!r} mixes single SBPs with nested entries on a placement with "
                f"{ndim} axes, so it is neither one nd-SBP nor a tree of them. Give every leaf as a full "
                f"nd-SBP ({ndim} SBPs: a tuple, or text like 'S(0), B').{_auto_hint(spec)}"
            )
        return _rebuild(spec, [_canonical_spec(v, ndim, what) for v in spec])
    if isinstance(spec, dict):
        return type(spec)((k, _canonical_spec(v, ndim, what)) for k, v in spec.items())
    return spec  # other pytree nodes: matched against the values as they are


def _rebuild(container, items):
    if isinstance(container, tuple) and hasattr(container, "_fields"):  # a namedtuple
        return type(container)(*items)
    return type(container)(items)


def broadcast_spec(spec, tree, what, ndim):
    """Expand an in_sbp / out_sbp prefix pytree to one entry per leaf of ``tree``."""
    if spec is None:
        return [None] * tree.num_leaves
    given, spec = spec, _canonical_spec(spec, ndim, what)
    values = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    try:
        expanded = jax.tree_util.tree_map(
            lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), spec, values, is_leaf=_is_sbp_leaf
        )
        # read up to the values' own leaves: a None among the values is no leaf, and the
        # None standing for it in the spec must not become an entry (every later
        # value would take the layout written for the one before it)
        return tree.flatten_up_to(expanded)
    except (ValueError, TypeError) as e:
        where = _mismatch(spec, values, what) or f"({e})"
        example = (
            "in_sbp=((S(0), B), None) for two arguments" if what == "in_sbp" else f"{what}=((S(0), B), None)"
        )
        raise SBPError(
            f"sj.jit: {what} does not match the structure of the values: {where}. Give a pytree "
            "with the same structure (or a prefix of it) whose leaves are nd-SBPs, e.g. "
            f"{example}.{_one_axis_hint(given, values, ndim)}{_auto_hint(given)}"
        ) from None


def _auto_hint(spec) -> str:
    """A sentence for a layout written with ``sj.AUTO`` inside a tuple
    (``(sj.AUTO,)``, ``(sj.AUTO, B)``), where ``sj.AUTO`` stands for the whole
    layout; empty elsewhere."""
    found = []

    def visit(node):
        if isinstance(node, (tuple, list)):
            if any(v is AUTO for v in node):
                found.append(node)
            for v in node:
                visit(v)
        elif isinstance(node, dict):
            for v in node.values():
                visit(v)

    visit(spec)
    if not found:
        return ""
    return (
        f" sj.AUTO stands for a whole layout (every axis): give sj.AUTO itself where {found[0]!r} is written."
    )


def _mismatch(spec, values, what: str, path: str = "") -> str | None:
    """Where the prefix tree ``spec`` and the values' tree (a placeholder per
    array) first differ, in words, or None where the difference lies in a
    container this does not read (JAX's message is given then). An nd-SBP
    or None stands for any subtree."""
    if _is_sbp_leaf(spec):
        return None
    here = f"{what}{path}"
    if isinstance(spec, (tuple, list)):
        if not isinstance(values, (tuple, list)):
            return f"{here} is a {type(spec).__name__} of {len(spec)} entries where the value is {_described(values)}"
        if len(spec) != len(values):
            if what == "in_sbp" and not path:
                return (
                    f"in_sbp has {len(spec)} entries (one per positional argument, static ones aside) and this "
                    f"call passes {len(values)} such argument{'s' * (len(values) != 1)}"
                )
            return f"{here} has {len(spec)} entries where the values have {len(values)}"
        for k, (s, v) in enumerate(zip(spec, values)):
            found = _mismatch(s, v, what, f"{path}[{k}]")
            if found:
                return found
    elif isinstance(spec, dict):
        if not isinstance(values, dict):
            return f"{here} is a dict where the value is {_described(values)}"
        if set(spec) != set(values):
            return f"{here} has the keys {sorted(map(str, spec))} where the values have {sorted(map(str, values))}"
        for k in spec:
            found = _mismatch(spec[k], values[k], what, f"{path}[{k!r}]")
            if found:
                return found
    return None


def _described(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with the keys {sorted(map(str, value))}"
    if value is None:
        return "None"
    return "one array" if isinstance(value, int) else type(value).__name__


def _one_axis_hint(spec, values, ndim: int) -> str:
    """Where the mismatch comes from reading a tuple of SBPs as a tree: on a
    1-D placement ``(B, S(1))`` is one SBP per value (the rule of
    ``_canonical_spec``), so where it stands for one array (a layout written
    for a 2-D placement) the structures differ. ``values``: the values' tree
    with a placeholder per array. Only such a tuple standing on an array is
    named: one standing on a tuple of values may be right."""
    if ndim != 1:
        return ""
    found = _sbp_tuple_on_an_array(spec, values)
    if found is None:
        return ""
    return (
        f" The placement has one axis, so {tuple(found)!r} is read as one SBP for each of "
        f"{len(found)} values, but it stands where there is one array: an array on a 1-D placement "
        "takes one SBP (S(k), B or P), or a tuple of one."
    )


def _sbp_tuple_on_an_array(spec, values):
    """The first tuple or list of two or more single SBPs in ``spec`` whose
    place in ``values`` is one array (not a container), or None."""
    if _one_per_value(spec):
        return None if isinstance(values, (tuple, list, dict)) else spec
    if isinstance(spec, (tuple, list)) and isinstance(values, (tuple, list)) and len(spec) == len(values):
        pairs = list(zip(spec, values))
    elif isinstance(spec, dict) and isinstance(values, dict):
        pairs = [(v, values[k]) for k, v in spec.items() if k in values]
    else:
        return None
    for sub_spec, sub_values in pairs:
        found = _sbp_tuple_on_an_array(sub_spec, sub_values)
        if found is not None:
            return found
    return None


def checked_time_limit(value, where: str) -> None:
    """Check a ``solve_time_limit`` (an SBPError naming ``where`` for a bool,
    a string, zero or a negative number) and warn that it no longer decides
    anything: the layout choice is bounded by ``CompileOptions.effort``, a
    count of work, so that a plan never depends on the clock."""
    if value is None:
        return
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise SBPError(f"{where}: solve_time_limit must be a positive number of seconds, got {value!r}.")
    warnings.warn(
        f"{where}: solve_time_limit is ignored: plans no longer depend on the clock. The solver's work "
        "is bounded by sj.CompileOptions(effort=...); pass options= instead.",
        DeprecationWarning,
        stacklevel=3,
    )


def checked_regather(value, where: str):
    """``value`` as a ``regather`` setting (True, False or "auto"), or an
    SBPError naming ``where``."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise SBPError(f"{where}: regather must be True, False or 'auto', got {value!r}.")


def checked_donate_argnums(v) -> tuple[int, ...]:
    if v is None:
        return ()
    nums = (v,) if isinstance(v, int) else tuple(v)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nums):
        raise SBPError(f"sj.jit: donate_argnums must be non-negative ints (positional arguments), got {v!r}.")
    return tuple(sorted(set(nums)))


def leaf_layout(spec, ndim: int, shape: tuple, k: int, tree):
    """The nd-SBP ``spec`` gives argument leaf ``k``; a bad one is reported with
    the leaf's place in the call (its path is found only then)."""
    try:
        return normalize_nd_sbp(spec, ndim, len(shape), f"in_sbp of argument leaf {k}")
    except SBPError:
        pass  # raised again below, naming the leaf, without the first one chained to it
    where = f"in_sbp of argument {leaf_name(leaf_paths(tree)[k])} {shape}"
    return normalize_nd_sbp(spec, ndim, len(shape), where)


def check_array_leaf(leaf, k: int, tree) -> None:
    """An argument leaf must be an array or a number unless it is static: a
    string, a function or a config object selects the program, and the
    compile cache is keyed by shapes, layouts and the static values only."""
    if isinstance(leaf, (GlobalTensor, jax.Array, jax.ShapeDtypeStruct)):
        return
    try:
        dtype = np.result_type(leaf)  # ml_dtypes' (bfloat16, float8) are numbers too
        ok = bool(
            jax.numpy.issubdtype(dtype, jax.numpy.number) or jax.numpy.issubdtype(dtype, jax.numpy.bool_)
        )
    except TypeError:
        ok = False
    if not ok:
        raise SBPError(
            f"sj.jit: argument {leaf_name(leaf_paths(tree)[k])} is {leaf!r:.60} ({type(leaf).__name__}), not an "
            "array or a number. Mark it static (sj.jit(f, placement=..., static_argnames=('mode',)), "
            "as jax.jit's) or bind it before compiling (sj.jit(functools.partial(f, mode='eval'), ...))."
        )


def check_no_donated_alias(placed: list, donated: set, tree) -> None:
    """A donated argument's buffer passed again as another argument of the same
    call: XLA frees it while the other still reads it (jax.jit then crashes the
    process on CPU), so it is refused here."""
    where: dict = {}
    for k, t in enumerate(placed):
        if isinstance(t, GlobalTensor):
            where.setdefault(id(t.physical), []).append(k)
    for ks in where.values():
        if len(ks) > 1 and any(k in donated for k in ks):
            gone = next(k for k in ks if k in donated)
            other = next(k for k in ks if k != gone)
            paths = leaf_paths(tree)
            raise SBPError(
                f"sj.jit: the same tensor is passed as argument {leaf_name(paths[gone])}, which is donated "
                f"(donate_argnums), and as {leaf_name(paths[other])}: its buffer would be freed while the "
                "call still reads it. Pass two different tensors, or leave this argument out of donate_argnums."
            )


def weakly_typed(x) -> bool:
    """JAX's weak type (a Python int, float or complex, or a jax value made from
    one), as ``jax.typeof`` reads it; a GlobalTensor is typed by its dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return bool(x.weak_type)
    return not isinstance(x, GlobalTensor) and jax.typeof(x).weak_type


__all__ = [
    "is_nd_sbp",
    "state_sbp",
    "leaf_paths",
    "leaf_name",
    "broadcast_spec",
    "checked_time_limit",
    "checked_regather",
    "checked_donate_argnums",
    "leaf_layout",
    "check_array_leaf",
    "weakly_typed",
    "check_no_donated_alias",
]


def checked_callable(fn):
    """``fn``, refused now (as ``jax.jit`` does) unless it can be called."""
    if not callable(fn):
        raise SBPError(
            f"sj.jit: {fn!r:.60} ({type(fn).__name__}) is not callable; pass the function to compile: "
            "sj.jit(step, placement=...) or @functools.partial(sj.jit, placement=...)."
        )
    return fn
