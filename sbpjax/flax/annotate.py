"""SBP annotations on Flax NNX modules.

Three ways to say how parameters are laid out, which combine (later wins):

    kernel_init=sjf.with_sbp(nnx.initializers.lecun_normal(), (B, S(1)))   # at creation
    ColumnLinear = sjf.sbp_module(nnx.Linear, params={"kernel": (B, S(1))})  # per class
    sjf.annotate(model, {"blocks.*.mlp.fc1.kernel": (B, S(1))})             # by path

The annotation is stored as the Variable's ``sbp`` metadata, the way
``nnx.with_partitioning`` stores ``out_sharding``; :func:`get_sbp` reads them
back as a tree of nd-SBPs shaped like the model's parameters, and
:func:`place` turns the parameters into global tensors.

Stacked layers. ``nnx.vmap`` / ``nnx.scan`` over a layer's constructor stack
its parameters along new leading dims (one per transform; Flax's default
``out_axes=0``). A layout is written for one layer, so it must shift: a
column-split kernel ``(B, S(1))`` of one layer is ``(B, S(2))`` of the stack,
and the stacked dim itself is never split (each device runs every layer on its
piece). The rank a layout was written for is kept beside it (``sbp_rank``;
:func:`with_sbp` and :func:`sbp_module` record it when the layer is created,
inside the transform, and ``annotate(..., stacked=k)`` says it for a model
that is already stacked); :func:`get_sbp` shifts every split by the number of
dims added since. A stack along another position than the leading dims needs
its layout written for the stacked shape (``annotate`` without ``stacked``).
"""

from __future__ import annotations

import fnmatch
import functools
import types

import jax
from flax import nnx

from sbpjax._errors import SBPError
from sbpjax.compiler.constrain import constrain
from sbpjax.flax.partitioning import sbp_from_metadata
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Partial, Split, format_sbp, normalize_nd_sbp, parse_sbp
from sbpjax.tensor import GlobalTensor, to_global

METADATA_KEY = "sbp"
RANK_KEY = "sbp_rank"  # the parameter rank the layout was written for (stacked layers shift it)


def _as_sbp_tuple(sbp, where: str) -> tuple:
    """User input (text, one SBP, a tuple) as a tuple of SBPs; its length is
    checked against a placement later, when one is known."""
    if isinstance(sbp, str):
        return parse_sbp(sbp)
    if isinstance(sbp, (Split, Broadcast, Partial)):
        return (sbp,)
    try:
        items = tuple(sbp)
    except TypeError:
        items = None
    if not items or not all(isinstance(s, (Split, Broadcast, Partial)) for s in items):
        raise SBPError(
            f'{where}: {sbp!r} is not an SBP, a tuple of SBPs or SBP text; write e.g. (B, S(1)) or "B, S(1)".'
        )
    return items


def _check_rank(sbp: tuple, ndim: int, where: str):
    for s in sbp:
        if isinstance(s, Split) and s.dim >= ndim:
            raise SBPError(
                f"{where}: {format_sbp(sbp)} splits dim {s.dim} but the parameter has {ndim} dims; "
                f"split a dim in 0..{ndim - 1} or use B."
            )


def with_sbp(initializer, sbp):
    """An initializer whose NNX Variable carries the layout ``sbp``, like
    ``nnx.with_partitioning`` carries a sharding::

        nnx.Linear(512, 2048, kernel_init=with_sbp(nnx.initializers.lecun_normal(), (B, S(1))), rngs=rngs)
    """
    sbp = _as_sbp_tuple(sbp, "with_sbp")

    @functools.wraps(initializer)
    def init(*args, **kwargs):
        value = initializer(*args, **kwargs)
        # Inside nnx.vmap / nnx.scan the value seen here is one layer's: its rank
        # is the one the layout was written for (see "Stacked layers" above).
        return nnx.variablelib.VariableMetadata(
            value, metadata={METADATA_KEY: sbp, RANK_KEY: jax.numpy.ndim(value)}
        )

    return init


def _path_text(path) -> str:
    return ".".join(str(k) for k in path)


def _params(module) -> list:
    """(dotted path, Param) for every parameter of ``module``."""
    return [(_path_text(path), node) for path, node in nnx.iter_graph(module) if isinstance(node, nnx.Param)]


def annotate(model, rules, *, stacked: int = 0):
    """Set the layout of every parameter whose dotted path matches a pattern.

    ``rules``: a dict ``{pattern: sbp}`` or a list of pairs. Patterns are
    ``fnmatch`` globs over dotted paths such as ``blocks.0.mlp.fc1.kernel``
    (``*`` matches any text, dots included). The first matching rule wins,
    as in t5x/Haliax rule lists, so put specific patterns first. A pattern
    that matches no parameter is an error (it is almost always a typo).
    ``stacked``: how many leading dims of the matched parameters were added by
    ``nnx.vmap`` / ``nnx.scan`` (layer stacks); the layouts are then written for
    one layer and shifted past those dims. Returns ``model`` (annotated in place)."""
    if not isinstance(stacked, int) or stacked < 0:
        raise SBPError(f"annotate: stacked={stacked!r}; give the number of leading stacked dims (0, 1, ...).")
    items = list(rules.items()) if isinstance(rules, dict) else list(rules)
    params = _params(model)
    used = [False] * len(items)
    for path, var in params:
        for k, (pattern, sbp) in enumerate(items):
            if fnmatch.fnmatchcase(path, pattern):
                nd = _as_sbp_tuple(sbp, f"annotate rule {pattern!r}")
                ndim = jax.numpy.ndim(var.get_value())
                where = f"annotate rule {pattern!r} on parameter '{path}'"
                if stacked > ndim:
                    raise SBPError(f"{where}: stacked={stacked} but the parameter has only {ndim} dims.")
                _check_rank(nd, ndim - stacked, where)
                var.set_metadata(METADATA_KEY, nd)
                var.set_metadata(RANK_KEY, ndim - stacked)
                used[k] = True
                break
    unused = [p for (p, _), u in zip(items, used) if not u]
    if unused:
        known = ", ".join(p for p, _ in params[:12]) + (" ..." if len(params) > 12 else "")
        raise SBPError(
            f"annotate: rule(s) {unused} match no parameter of {type(model).__name__}. Parameter "
            f"paths are dotted, e.g. {known}."
        )
    return model


def get_sbp(model, placement: Placement | None = None, *, rules=None, unannotated=None):
    """The layout tree of ``model``'s parameters: a nested dict shaped like
    ``nnx.to_pure_dict(nnx.state(model, nnx.Param))`` with each parameter's nd-SBP.

    Without ``placement`` unannotated parameters are ``None``; with it every
    entry is a checked nd-SBP of the placement's rank and unannotated ones are B.
    With a placement, a parameter annotated for ``jax.sharding`` instead
    (``nnx.with_partitioning``, mesh axis or logical names) is read as the
    nd-SBP it means (see :mod:`sbpjax.flax.partitioning`); logical names are
    resolved by ``rules`` (``[(logical, axis or None), ...]``), else by Flax's
    ``nnx.logical_axis_rules`` context, else by the parameter's own sharding
    when it already lives on this placement. ``unannotated``: with a
    placement, what a parameter with no annotation gets instead of B
    (``sj.AUTO``: the layout ``sj.jit``'s solver chooses, as
    ``Trainer(memory_budget=...)`` asks)."""
    tree: dict = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        meta = node.get_metadata()
        sbp = meta.get(METADATA_KEY)
        where = f"parameter '{_path_text(path)}'"
        ndim = jax.numpy.ndim(node.get_value())
        if sbp is not None and meta.get(RANK_KEY) is not None:
            if placement is not None:
                # checked as written, one layer's layout, so that a message's
                # example is what to write in with_sbp (not the stack's layout)
                stacked = meta[RANK_KEY] != ndim  # a layer of nnx.scan / nnx.vmap's stack
                layer = f"{where} (one layer of a stack)" if stacked else where
                sbp = normalize_nd_sbp(sbp, placement.ndim, meta[RANK_KEY], layer)
            sbp = shift_stacked(sbp, ndim - meta[RANK_KEY], where)
        if placement is not None:
            if sbp is None:
                sbp = sbp_from_metadata(meta, node.get_value(), placement, rules, where)
            if sbp is not None:
                sbp = normalize_nd_sbp(sbp, placement.ndim, ndim, where)
            elif unannotated is not None:
                sbp = unannotated
            else:
                sbp = (Broadcast(),) * placement.ndim
        sub = tree
        for k in path[:-1]:
            sub = sub.setdefault(k, {})
        sub[path[-1]] = sbp
    return tree


def shift_stacked(sbp: tuple, added: int, where: str, index: int = 0) -> tuple:
    """``sbp`` of one layer as the layout of a stack that inserted ``added``
    dims at ``index`` (negative: removed them): splits at or past ``index``
    move by ``added``; the stacked dims are not split."""
    if added == 0:
        return sbp
    removed = range(index, index - added) if added < 0 else range(0)
    out = []
    for s in sbp:
        if isinstance(s, Split) and s.dim in removed:
            raise SBPError(
                f"{where}: {format_sbp(sbp)} splits dim {s.dim}, a stacked dim being removed; "
                "a layer stack is never split along its layers."
            )
        if isinstance(s, Split) and s.dim >= index:
            s = Split(s.dim + added)
        out.append(s)
    return tuple(out)


def place(model, placement: Placement):
    """Turn every parameter of ``model`` into a global tensor at its annotated
    layout (B where unannotated), in place; returns ``model``.

    A placed model is what :class:`sbpjax.flax.Trainer` keeps; call
    :func:`unplace` for a model that runs eagerly on one device again."""
    sbps = get_sbp(model, placement)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            nd = functools.reduce(lambda t, k: t[k], path, sbps)
            value = node.get_value()
            if isinstance(value, GlobalTensor):
                node.set_value(value.to_global(sbp=nd, placement=placement))
            else:
                node.set_value(to_global(value, placement, nd))
    return model


def unplace(model):
    """The inverse of :func:`place`: every global-tensor parameter becomes its
    logical value (a plain array on the default device). Returns ``model``."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and isinstance(node.get_value(), GlobalTensor):
            node.set_value(jax.numpy.asarray(node.get_value().numpy()))
    return model


def _constrain_tree(tree, sbp):
    if sbp is None:
        return tree
    return jax.tree.map(lambda x: constrain(x, sbp), tree)


def sbp_module(cls=None, *, params=None, inputs=None, outputs=None):
    """Annotate a Module class: its parameters' layouts and the layouts its
    ``__call__`` takes and returns. Works as a decorator on your own class or
    on an existing one (a subclass is returned; the original is untouched)::

        ColumnLinear = sbp_module(nnx.Linear, params={"kernel": (B, S(1)), "bias": (S(0),)},
                                  outputs=(S(0), S(1)))

        @sbp_module(params={"*.kernel": (B, S(1))}, inputs=(S(0), B))
        class Block(nnx.Module): ...

    ``params`` are :func:`annotate` rules relative to the module. ``inputs``
    is one nd-SBP for the first argument or a tuple with one per positional
    argument (``None`` leaves one free); ``outputs`` one nd-SBP for every output
    leaf. Inside ``sj.jit`` they are boxing points (``sj.constrain``); outside
    they change nothing."""
    if cls is None:
        return functools.partial(sbp_module, params=params, inputs=inputs, outputs=outputs)
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise SBPError(
            f"sbp_module: {cls!r} is not an nnx.Module class; decorate a class such as nnx.Linear "
            "or your own `class Block(nnx.Module)`."
        )
    per_arg = inputs is not None and not _is_single_sbp(inputs)

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        if params:
            annotate(self, params)

    def __call__(self, *args, **kwargs):
        if inputs is not None:
            specs = inputs if per_arg else (inputs,)
            if len(specs) > len(args):
                raise SBPError(
                    f"{cls.__name__}: inputs= gives {len(specs)} layouts but the call has "
                    f"{len(args)} positional arguments."
                )
            args = tuple(_constrain_tree(a, s) for a, s in zip(args, specs)) + args[len(specs) :]
        out = cls.__call__(self, *args, **kwargs)
        return _constrain_tree(out, outputs)

    def body(ns):
        ns.update(
            __init__=__init__,
            __call__=__call__,
            __doc__=cls.__doc__,
            __module__=cls.__module__,
            __sbp_params__=params,
            __sbp_inputs__=inputs,
            __sbp_outputs__=outputs,
        )

    new = types.new_class(cls.__name__, (cls,), exec_body=body)
    new.__qualname__ = cls.__qualname__
    return new


def _is_single_sbp(spec) -> bool:
    """One layout (text, an SBP, or a tuple of SBPs) rather than one per argument."""
    if isinstance(spec, (str, Split, Broadcast, Partial)):
        return True
    return isinstance(spec, tuple) and all(isinstance(s, (Split, Broadcast, Partial)) for s in spec)
