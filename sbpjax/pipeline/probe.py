"""Probes: an NNX model's own ``__call__`` run with its blocks swapped out, to
get what it does before the blocks (the embedding) and after them (the head).

* *before*: every block is a probe that stops the call at the first block it
  reaches and hands back that block's input (a stacked model is cut instead
  at the carry of its scan over the stack, in the traced call);
* *after*: every block is a probe that returns the value given (a stacked
  model: the scan over the stack is taken out of the traced call, its carry
  becoming an input). What the call computed before the blocks is dead code
  there; the parameters it reads are zeros.

Which parameters each part reads is read off its traced program with JAX's
dead-code elimination (:func:`split_params`).
"""

from __future__ import annotations

import contextvars

import flax
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbpjax._errors import SBPError


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
def path_text(path) -> str:
    return ".".join(str(k) for k in path)


def get_path(node, path):
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    return node


def set_path(root, path, value):
    parent = get_path(root, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def flatten(tree, prefix=()) -> dict:
    """A nested dict (``nnx.to_pure_dict``) as ``{path: leaf}``."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}


def nest(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def under(path, prefix) -> bool:
    return path[: len(prefix)] == prefix


def _used_inputs(fn, *args) -> list:
    """Per leaf of ``args``: whether ``fn``'s outputs depend on it (an older or
    newer JAX without ``dce_jaxpr`` counts every leaf that an equation reads)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    used = used_by(jaxpr, [True] * len(jaxpr.outvars))
    if used is None:  # pragma: no cover - the fallback for a JAX that moved it
        read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
        return [id(v) in read for v in jaxpr.invars]
    return used


def used_by(jaxpr, outputs: list) -> list | None:
    """Per input of ``jaxpr``: whether the outputs marked True in ``outputs``
    are computed from it (JAX's dead-code elimination, which follows calls,
    conds and loops). None where that private API is missing."""
    try:
        from jax._src.interpreters.partial_eval import dce_jaxpr
    except ImportError:  # pragma: no cover
        return None
    _, used = dce_jaxpr(jaxpr, list(outputs))
    return list(used)


class Parts:
    """The model with probes in place of its blocks: ``before`` and ``after`` as
    functions of the non-block parameters."""

    def __init__(self, model, path, kind: str, n: int, sample):
        self.sample = sample
        self.stacked = kind == "stacked"
        # a list's blocks are stop probes before and inject probes after; a stack is one
        # pass-through module both ways, its scan cut out of the traced call
        probes = (
            {"before": _StackedPass(n)}
            if self.stacked
            else {
                "before": nnx.List([_StopProbe() for _ in range(n)]),
                "after": nnx.List([_InjectProbe() for _ in range(n)]),
            }
        )
        self.graphs = {}
        for role, probe in probes.items():
            copy = nnx.merge(*nnx.split(model))
            set_path(copy, path, probe)
            graphdef, params, rest = nnx.split(copy, nnx.Param, ...)  # type: ignore[misc]
            self.graphs[role] = (graphdef, params, rest)
        flat = flatten(jax.tree_util.tree_map(np.asarray, nnx.to_pure_dict(self.graphs["before"][1])))
        self.probe_params = {p: v for p, v in flat.items() if under(p, path)}
        self.params = {p: v for p, v in flat.items() if not under(p, path)}

    def _merged(self, role, own: dict, probe: dict | None = None):
        graphdef, template, rest = self.graphs[role]
        # the other part's parameters are never read here (split_params checks it): zeros stand in
        flat = {p: own[p] if p in own else jnp.zeros(np.shape(v), v.dtype) for p, v in self.params.items()}
        flat.update(probe or self.probe_params)
        state = jax.tree_util.tree_map(lambda v: v, template)
        nnx.replace_by_pure_dict(state, nest(flat))
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

    def after(self, own: dict, h, x=None):
        """The head on the blocks' output ``h``. The model's own input is not
        there on the last stage: zeros of its shape stand in (``x`` only where
        ``split_params`` checks that the head never reads it)."""
        sample = np.asarray(self.sample)
        dummy = jnp.zeros((np.shape(h)[0], *sample.shape[1:]), sample.dtype) if x is None else x
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


def split_params(parts: Parts, sample, through_blocks=None) -> tuple[dict, dict, bool, bool]:
    """Non-block parameters read before and after the blocks, and whether each
    part is there at all (it reads a parameter, or is not the identity).
    ``through_blocks``: the blocks' output shape (a ``jax.ShapeDtypeStruct``)
    of their input's, where the blocks change the width (default: unchanged)."""
    try:
        return _split_params(parts, sample, through_blocks)
    except flax.errors.TraceContextError:  # a layer outside the blocks writes its state
        raise SBPError(
            "LayerChain.from_model: the model's embedding or head updates its own state when called: "
            "BatchNorm in training mode, or Dropout drawing from its RNG stream. A pipeline stage holds "
            "non-parameter state constant (the chain is the model in inference mode): call model.eval() "
            "before LayerChain.from_model / sjp.cut."
        ) from None


def _split_params(parts: Parts, sample, through_blocks) -> tuple[dict, dict, bool, bool]:
    paths = list(parts.params)
    leaves = [parts.params[p] for p in paths]

    def before_fn(vals, x):
        return parts.before(dict(zip(paths, vals)), x)

    def after_fn(vals, h, x=None):
        return parts.after(dict(zip(paths, vals)), h, x)

    used_before = _used_inputs(before_fn, leaves, sample)
    h = jax.eval_shape(before_fn, leaves, sample)
    h = jax.ShapeDtypeStruct(h.shape, h.dtype)
    if through_blocks is not None:
        h = through_blocks(h)  # the head reads what the last block makes
    used_after = _used_inputs(after_fn, leaves, h, sample)
    if used_after[-1]:
        raise SBPError(
            "LayerChain.from_model: the model reads its input after the blocks (a padding mask taken "
            "from the tokens, or a skip around the blocks from the embedding's output); the last stage "
            "sees only the blocks' output. Pass what the head needs through the blocks, read it from the "
            "targets in the loss, or cut the layers by hand with LayerChain.from_functions."
        )
    used_after = used_after[:-1]
    tied = [path_text(p) for p, b, a in zip(paths, used_before, used_after[: len(paths)]) if b and a]
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
    identity_after = not after and _is_identity(after_fn, leaves, h)
    return before, after, not identity_before, not identity_after


def _is_identity(fn, leaves, x) -> bool:
    jaxpr = jax.make_jaxpr(fn)(leaves, x).jaxpr
    return list(jaxpr.outvars) == [jaxpr.invars[-1]]
