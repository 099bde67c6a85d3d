"""A Flax NNX model as a :class:`~sbpjax.pipeline.chain.LayerChain`: its blocks,
and what runs before (embedding) and after (head) them.

    chain = sjp.LayerChain.from_model(model, sample=tokens)              # blocks found
    chain = sjp.LayerChain.from_model(model, sample=tokens, blocks="h")  # or named

**The blocks** are an ``nnx.List`` (or a list in ``nnx.data``) of at least two
modules, or one module whose parameters were stacked along a leading layer dim
by ``nnx.vmap`` (and that ``__call__`` runs with ``nnx.scan``). Block ``i`` is
called as ``block(x) -> y``: the same call each layer gets in a Python loop or a
scan body. Layer ``i`` of a stack is the stacked module's graph merged with the
``i``-th slice of its state, the slice ``nnx.scan`` hands its body.

**Before and after** are found by running the model's own ``__call__`` with
the blocks swapped for probes, so no stage function is written by hand:

* *before*: every block is a probe that stops the call at the first block it
  reaches and hands back that block's input: the embedding, whatever it is;
* *after*: every block is a probe that returns the value given, the output of
  the last block: the rest of ``__call__`` is the head. What the call computed
  before the blocks is then dead code (the compiler and XLA drop it; the
  parameters it reads are zeros there).

Which parameters each part reads is read off its traced program with JAX's
dead-code elimination, so the embedding goes to the first stage and the head
to the last, and a weight read by both (a head tied to the embedding) is an
error: stages own their parameters. The chain is checked against the model on
``sample`` before it is handed out. Non-parameter state (batch statistics, RNG
streams) is held constant: the chain is the model in inference mode.
"""

from __future__ import annotations

import contextvars

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbpjax._errors import SBPError
from sbpjax.pipeline.chain import Layer, LayerChain

_NOT_FOUND = (
    "LayerChain.from_model: found no blocks in {model}: no nnx.List (or list in nnx.data) of two or more "
    "modules, and no module whose parameters share a leading (stacked) layer dim. Its attributes are "
    "{attrs}. Pass blocks='<attribute path>' naming the blocks, keep them in nnx.List([...]), or give the "
    "layers as functions with LayerChain.from_functions(fns, params, sample)."
)


class _Reached(Exception):
    """Raised by a stop probe: the model's call reached its first block."""

    def __init__(self, x, args, kwargs):
        super().__init__("first block reached")
        self.x, self.args, self.kwargs = x, args, kwargs


_INJECTED: contextvars.ContextVar = contextvars.ContextVar("sbpjax_pipeline_injected")


class _StopProbe(nnx.Module):
    def __call__(self, x, *args, **kwargs):
        raise _Reached(x, args, kwargs)


class _InjectProbe(nnx.Module):
    def __call__(self, x, *args, **kwargs):
        return _INJECTED.get()


class _StackedPass(nnx.Module):
    """A stand-in for a stacked block module that passes its input on: one
    parameter with the stack's leading dim, so the model's scan over it has
    something to slice (and the scan can be found by it)."""

    def __init__(self, n: int):
        self.layer = nnx.Param(jnp.zeros((n,), jnp.float32))

    def __call__(self, x, *args, **kwargs):
        # an exact identity, yet not one JAX sees through: a scan forwards a carry its
        # body returns untouched, and then the carry to cut at is gone
        return x + (self.layer[...] * 0).astype(x.dtype)


# -- paths -------------------------------------------------------------------------
def _path_text(path) -> str:
    return ".".join(str(k) for k in path)


def _parse_path(text: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in text.split("."))


def _get(node, path):
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    return node


def _set(root, path, value):
    parent = _get(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _flatten(tree, prefix=()) -> dict:
    """A nested dict (``nnx.to_pure_dict``) as ``{path: leaf}``."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def _under(path, prefix) -> bool:
    return path[: len(prefix)] == prefix


# -- finding the blocks ------------------------------------------------------------
def _is_block_list(node) -> bool:
    return (
        isinstance(node, (list, tuple, nnx.List))
        and len(node) >= 2
        and all(isinstance(m, nnx.Module) for m in node)
    )


def _stack_depth(module) -> int | None:
    """The shared leading dim of every parameter of ``module`` when it looks like a
    stack (two or more parameters, each at least 2-D), else None."""
    leaves = jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    if len(leaves) < 2 or any(np.ndim(v) < 2 for v in leaves):
        return None
    dims = {np.shape(v)[0] for v in leaves}
    depth = dims.pop() if len(dims) == 1 else 0
    return depth if depth >= 2 else None


def find_blocks(model, blocks: str | None = None) -> tuple[tuple, str, int]:
    """``(path, "list" | "stacked", layers)`` of the model's blocks."""
    if blocks is not None:
        path = _parse_path(blocks)
        try:
            node = _get(model, path)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise SBPError(
                f"LayerChain.from_model: {type(model).__name__} has no attribute path {blocks!r}; "
                f"its attributes are {_attributes(model)}."
            ) from None
        if _is_block_list(node):
            return path, "list", len(node)
        depth = _stack_depth(node) if isinstance(node, nnx.Module) else None
        if depth is None:
            raise SBPError(
                f"LayerChain.from_model: {blocks!r} is a {type(node).__name__}, neither a list of two or more "
                "modules nor a module stacked by nnx.vmap (parameters sharing a leading layer dim)."
            )
        return path, "stacked", depth
    lists = [(p, n) for p, n in nnx.iter_graph(model) if p and _is_block_list(n)]
    lists = [(p, n) for p, n in lists if not any(q != p and _under(p, q) for q, _ in lists)]
    if len(lists) == 1:
        return tuple(lists[0][0]), "list", len(lists[0][1])
    if len(lists) > 1:
        found = ", ".join(repr(_path_text(p)) for p, _ in lists)
        raise SBPError(
            f"LayerChain.from_model: {type(model).__name__} has several lists of blocks ({found}); "
            "name the one to cut with blocks='<path>'."
        )
    stacks: list[tuple[str, int]] = []
    for name in _attributes(model):
        node = getattr(model, name)
        depth = _stack_depth(node) if isinstance(node, nnx.Module) else None
        if depth is not None:
            stacks.append((name, depth))
    if len(stacks) == 1:
        return (stacks[0][0],), "stacked", stacks[0][1]
    if len(stacks) > 1:
        raise SBPError(
            f"LayerChain.from_model: several modules of {type(model).__name__} look stacked "
            f"({', '.join(repr(n) for n, _ in stacks)}); name the blocks with blocks='<attribute>'."
        )
    raise SBPError(_NOT_FOUND.format(model=type(model).__name__, attrs=_attributes(model)))


def _attributes(model) -> list:
    return [k for k in vars(model) if not k.startswith("_")]


# -- the layers ----------------------------------------------------------------------
def _module_layer(module, name: str, tie: str, stacked_index: int | None = None) -> Layer:
    """A block as a layer: its parameters as a pure dict, applied by merging them
    back into its graph (with the ``stacked_index``-th slice of a stack)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
    if stacked_index is not None:
        depth = _stack_depth(module)
        params = jax.tree_util.tree_map(lambda v: v[stacked_index], params)
        rest = jax.tree_util.tree_map(
            lambda v: v[stacked_index] if np.ndim(v) and np.shape(v)[0] == depth else v, rest
        )
    pure = jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(params))

    def apply(p, x):
        state = jax.tree_util.tree_map(lambda v: v, params)
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state, rest)(x)

    def layouts(placement):
        from sbpjax.flax.annotate import get_sbp

        return get_sbp(nnx.merge(graphdef, params, rest), placement)

    return Layer(name, apply, pure, layouts, tie, "block")


def _used_inputs(fn, *args) -> list:
    """Per leaf of ``args``: whether ``fn``'s outputs depend on it (JAX's dead-code
    elimination over the traced program; private API, so an older or newer JAX
    without it counts every leaf that an equation reads)."""
    closed = jax.make_jaxpr(fn)(*args)
    jaxpr = closed.jaxpr
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:  # pragma: no cover - the fallback for a JAX that moved it
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
        return [id(v) in read for v in jaxpr.invars]
    _, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return list(used)


class _Parts:
    """The model with probes in place of its blocks: ``before`` and ``after`` as
    functions of the non-block parameters."""

    def __init__(self, model, path, kind: str, n: int, sample):
        self.sample = sample
        self.stacked = kind == "stacked"
        self.graphs = {}
        for role, probe in (
            ("before", _StackedPass(n) if kind == "stacked" else nnx.List([_StopProbe() for _ in range(n)])),
            ("after", _StackedPass(n) if kind == "stacked" else nnx.List([_InjectProbe() for _ in range(n)])),
        ):
            copy = nnx.merge(*nnx.split(model))
            _set(copy, path, probe)
            graphdef, params, rest = nnx.split(copy, nnx.Param, ...)  # type: ignore[misc]
            self.graphs[role] = (graphdef, params, rest)
        flat = _flatten(jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(self.graphs["before"][1])))
        self.probe_params = {p: v for p, v in flat.items() if _under(p, path)}
        self.params = {p: v for p, v in flat.items() if not _under(p, path)}

    def _merged(self, role, own: dict, probe: dict | None = None):
        graphdef, template, rest = self.graphs[role]
        # the other part's parameters are never read here (_split_params checks it): zeros stand in
        flat = {p: own[p] if p in own else jnp.zeros(np.shape(v), v.dtype) for p, v in self.params.items()}
        flat.update(probe or self.probe_params)
        state = jax.tree_util.tree_map(lambda v: v, template)
        nnx.replace_by_pure_dict(state, _nest(flat))
        return nnx.merge(graphdef, state, rest)

    def before(self, own: dict, x):
        if self.stacked:
            return self._before_scan(own, x)
        try:
            self._merged("before", own)(x)
        except _Reached as stop:
            if stop.args or stop.kwargs:
                raise SBPError(
                    "LayerChain.from_model: the model calls its blocks with more than one value "
                    f"({1 + len(stop.args)} positional, keywords {sorted(stop.kwargs)}); a pipeline passes one "
                    "array from layer to layer. Compute masks and positions inside the blocks, or give the "
                    "layers as functions with LayerChain.from_functions."
                ) from None
            return stop.x
        raise SBPError(
            "LayerChain.from_model: the model's __call__ never called its blocks; name the blocks the call "
            "runs with blocks='<path>'."
        )

    def _traced_scan(self, own: dict, x):
        """The model's call traced with a pass-through stack, and its scan over
        the stack: ``(closed jaxpr, scan equation, arguments)``. A probe cannot
        stop a scan's trace and hand back an outer value (the carry inside the
        body is the scan's own), so the stacked model is cut at the scan's
        carry in its traced program instead."""
        keys = list(own)
        (marker_path,) = self.probe_params

        def whole(vals, marker, x):
            return self._merged("before", dict(zip(keys, vals)), {marker_path: marker})(x)

        args = ([own[k] for k in keys], self.probe_params[marker_path], x)
        closed = jax.make_jaxpr(whole)(*args)
        eqn = _scan_over(closed.jaxpr, closed.jaxpr.invars[len(keys)])
        consts, carried = _scan_counts(eqn)
        if carried != 1:
            raise SBPError(
                f"LayerChain.from_model: the scan over the stacked blocks carries {carried} values; a "
                "pipeline passes one array from layer to layer (carry the hidden state only)."
            )
        return closed, eqn, jax.tree_util.tree_leaves(args), consts

    def _before_scan(self, own: dict, x):
        closed, eqn, args, consts = self._traced_scan(own, x)
        prefix = closed.jaxpr.replace(outvars=[eqn.invars[consts]])
        return jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(prefix, closed.consts))(*args)[0]

    def _after_scan(self, own: dict, dummy, h):
        closed, eqn, args, _ = self._traced_scan(own, dummy)
        jaxpr = closed.jaxpr
        carry_out, ys = eqn.outvars[0], eqn.outvars[1:]
        later = [v for e in jaxpr.eqns for v in e.invars] + list(jaxpr.outvars)
        if any(y in later for y in ys):
            raise SBPError(
                "LayerChain.from_model: the model reads the scan's stacked outputs (ys) after its blocks; a "
                "pipeline passes only the carry (the hidden state) from layer to layer."
            )
        suffix = jaxpr.replace(
            invars=[*jaxpr.invars, carry_out], eqns=[e for e in jaxpr.eqns if e is not eqn]
        )
        return jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(suffix, closed.consts))(*args, h)[0]

    def after(self, own: dict, h):
        dummy = jnp.zeros((np.shape(h)[0], *np.shape(self.sample)[1:]), np.asarray(self.sample).dtype)
        if self.stacked:
            return self._after_scan(own, dummy, h)
        token = _INJECTED.set(h)
        try:
            return self._merged("after", own)(dummy)
        finally:
            _INJECTED.reset(token)


def _scan_over(jaxpr, marker):
    """The first scan equation whose scanned inputs come from ``marker``."""
    derived = {marker}
    for eqn in jaxpr.eqns:
        if any(v in derived for v in eqn.invars if not isinstance(v, jax_core.Literal)):
            if eqn.primitive.name == "scan":
                return eqn
            derived.update(eqn.outvars)
    raise SBPError(
        "LayerChain.from_model: the model does not run its stacked blocks with a scan at the top of its "
        "__call__ (nnx.scan or jax.lax.scan, not inside a jit or a loop over slices); run them with "
        "nnx.scan, keep them in an nnx.List, or give the layers as functions with LayerChain.from_functions."
    )


def _scan_counts(eqn) -> tuple[int, int]:
    """How many of a scan equation's inputs are constants, and how many are carried:
    ``num_consts`` / ``num_carry`` up to JAX 0.10, the first two groups of
    ``ft_in`` (constants, carry, scanned) after."""
    params = eqn.params
    if "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    groups = params["ft_in"]  # a flat tree (consts, carry, xs); its subtrees count their leaves
    parts = getattr(groups, "elts", None) or tuple(groups.unpack())
    return len(parts[0]), len(parts[1])


def _split_params(parts: _Parts, sample) -> tuple[dict, dict, bool, bool]:
    """Non-block parameters read before and after the blocks, and whether each
    part is there at all (it reads a parameter, or is not the identity)."""
    paths = list(parts.params)
    leaves = [parts.params[p] for p in paths]

    def before_fn(vals, x):
        return parts.before(dict(zip(paths, vals)), x)

    def after_fn(vals, h):
        return parts.after(dict(zip(paths, vals)), h)

    used_before = _used_inputs(before_fn, leaves, sample)
    h = jax.eval_shape(before_fn, leaves, sample)
    used_after = _used_inputs(after_fn, leaves, jax.ShapeDtypeStruct(h.shape, h.dtype))
    tied = [_path_text(p) for p, b, a in zip(paths, used_before, used_after[: len(paths)]) if b and a]
    if tied:
        raise SBPError(
            f"LayerChain.from_model: parameter(s) {tied} are read both before the blocks (first stage) and "
            "after them (last stage), e.g. a head tied to the embedding. Stages own their parameters: untie "
            "them (a separate head weight), or cut the layers by hand with LayerChain.from_functions."
        )
    if used_after[-1] is False:
        raise SBPError(
            "LayerChain.from_model: the model's output does not depend on its blocks' output; name the blocks "
            "its __call__ runs with blocks='<path>'."
        )
    before = {p: v for p, v, u in zip(paths, leaves, used_before) if u}
    after = {p: v for p, v, u in zip(paths, leaves, used_after) if u}
    # parameters neither part reads stay with the head (their gradient is zero)
    after.update({p: v for p, v in parts.params.items() if p not in before and p not in after})
    identity_before = not before and _is_identity(before_fn, leaves, sample)
    identity_after = not after and _is_identity(after_fn, leaves, jax.ShapeDtypeStruct(h.shape, h.dtype))
    return before, after, not identity_before, not identity_after


def _is_identity(fn, leaves, x) -> bool:
    jaxpr = jax.make_jaxpr(fn)(leaves, x).jaxpr
    return list(jaxpr.outvars) == [jaxpr.invars[-1]]


def _part_layer(parts: _Parts, role: str, own: dict, model) -> Layer:
    keys = list(own)

    def apply(p, x):
        flat = _flatten(p)
        return getattr(parts, role)({k: flat[k] for k in keys}, x)

    def layouts(placement):
        from sbpjax.flax.annotate import get_sbp

        flat = _flatten(get_sbp(model, placement))
        return _nest({k: flat[k] for k in keys})

    name = "embed" if role == "before" else "head"
    return Layer(name, apply, _nest(own), layouts, None, role)


def chain_of(model, sample, *, blocks: str | None = None, check: bool = True) -> LayerChain:
    """The :class:`LayerChain` of an NNX model (see the module docstring).
    ``check``: run the chain and the model on ``sample`` and compare."""
    if not isinstance(model, nnx.Module):
        raise SBPError(
            f"LayerChain.from_model: {type(model).__name__} is not a Flax NNX module; for layer functions use "
            "LayerChain.from_functions(fns, params, sample)."
        )
    path, kind, n = find_blocks(model, blocks)
    parts = _Parts(model, path, kind, n, sample)
    before, after, has_before, has_after = _split_params(parts, sample)
    node = _get(model, path)
    where = _path_text(path)
    if kind == "list":
        layers = [_module_layer(m, f"{where}.{i}", _block_tie(m)) for i, m in enumerate(node)]
    else:
        layers = [_module_layer(node, f"{where}.{i}", f"{where}.*", stacked_index=i) for i in range(n)]
    chain_layers = (
        ([_part_layer(parts, "before", before, model)] if has_before else [])
        + layers
        + ([_part_layer(parts, "after", after, model)] if has_after else [])
    )

    def to_model(per_layer):
        flat: dict = {}
        k = 0
        if has_before:
            flat.update(_flatten(per_layer[0]))
            k = 1
        blocks_params = per_layer[k : k + n]
        if kind == "list":
            for i, p in enumerate(blocks_params):
                flat.update({(*path, i, *q): v for q, v in _flatten(p).items()})
        else:
            stacked = jax.tree_util.tree_map(lambda *vs: np.stack(vs), *blocks_params)
            flat.update({(*path, *q): v for q, v in _flatten(stacked).items()})
        if has_after:
            flat.update(_flatten(per_layer[-1]))
        return _nest(flat)

    chain = LayerChain(chain_layers, sample, to_model=to_model, source=".from_model")
    if check:
        _check_against_model(chain, model, sample)
    return chain


def _block_tie(module) -> str:
    """Blocks with the same graph and parameter shapes are alike."""
    graphdef, params = nnx.split(module, nnx.Param)[:2]
    shapes = tuple((np.shape(v), str(v.dtype)) for v in jax.tree_util.tree_leaves(params))
    return f"{type(module).__qualname__}:{hash((graphdef, shapes))}"


def _check_against_model(chain: LayerChain, model, sample) -> None:
    graphdef, state = nnx.split(model)
    want = np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, sample))
    got = np.asarray(jax.jit(chain.__call__)(chain.params, sample))
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-4 * scale):
        raise SBPError(
            f"LayerChain.from_model: running embed -> {len(chain)} layers -> head does not give the model's "
            f"output on the sample (shapes {got.shape} vs {want.shape}, largest difference "
            f"{float(np.max(np.abs(got - want))) if got.shape == want.shape else 'n/a'}). The model's __call__ "
            "must run each block once, in order, as x = block(x); otherwise give the layers as functions with "
            "LayerChain.from_functions."
        )
