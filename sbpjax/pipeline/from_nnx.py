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
the blocks swapped for probes (:mod:`sbpjax.pipeline.probe`), so no stage
function is written by hand. Which parameters each part reads is read off its
traced program, so the embedding goes to the first stage and the head to the
last, and a weight read by both (a head tied to the embedding) is an error:
stages own their parameters. The chain is checked against the model on
``sample`` before it is handed out. Non-parameter state (batch statistics, RNG
streams) is held constant: the chain is the model in inference mode.
"""

from __future__ import annotations

import flax.errors
import jax
import numpy as np
from flax import nnx

from sbpjax._errors import SBPError
from sbpjax.pipeline.chain import Layer, LayerChain, check_sample
from sbpjax.pipeline.probe import Parts, flatten, get_path, nest, path_text, split_params, under

_NOT_FOUND = (
    "LayerChain.from_model: found no blocks in {model}: no nnx.List (or list in nnx.data) of two or more "
    "modules, and no module whose parameters share a leading (stacked) layer dim. Its attributes are "
    "{attrs}. Pass blocks='<attribute path>' naming the blocks, keep them in nnx.List([...]), or give the "
    "layers as functions with LayerChain.from_functions(fns, params, sample)."
)


def _parse_path(text: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in text.split("."))


# -- finding the blocks ------------------------------------------------------------
def _is_block_list(node, least: int = 2) -> bool:
    """A list of ``least`` or more modules. Found without a name, a list of one
    module is the blocks only where nothing else is (``find_blocks``); named
    with ``blocks=``, it is."""
    return (
        isinstance(node, (list, tuple, nnx.List))
        and len(node) >= least
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
            node = get_path(model, path)
        except (AttributeError, IndexError, KeyError, TypeError):
            raise SBPError(
                f"LayerChain.from_model: {type(model).__name__} has no attribute path {blocks!r}; "
                f"its attributes are {_attributes(model)}."
            ) from None
        if _is_block_list(node, least=1):
            return path, "list", len(node)
        depth = _stack_depth(node) if isinstance(node, nnx.Module) else None
        if depth is None:
            raise SBPError(
                f"LayerChain.from_model: {blocks!r} is a {type(node).__name__}, neither a non-empty list of "
                "modules nor a module stacked by nnx.vmap (parameters sharing a leading layer dim)."
            )
        return path, "stacked", depth
    lists = _outermost_lists(model, least=2)
    if len(lists) == 1:
        return tuple(lists[0][0]), "list", len(lists[0][1])
    if len(lists) > 1:
        found = ", ".join(repr(path_text(p)) for p, _ in lists)
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
    # Last: a list of one module, as a one-layer configuration of a deep model
    # keeps its blocks. Taken only where it is the one such list and nothing
    # else looks like blocks (a submodule kept alone in a list would be taken too).
    singles = _outermost_lists(model, least=1)
    if len(singles) == 1:
        return tuple(singles[0][0]), "list", 1
    message = _NOT_FOUND.format(model=type(model).__name__, attrs=_attributes(model))
    if singles:
        found = ", ".join(repr(path_text(p)) for p, _ in singles)
        message += f" (Its lists of one module, {found}, are not taken without a name: pass blocks=.)"
    raise SBPError(message)


def _outermost_lists(model, least: int) -> list:
    """``(path, list)`` of the model's lists of ``least`` or more modules that
    no other such list holds."""
    lists = [(p, n) for p, n in nnx.iter_graph(model) if p and _is_block_list(n, least)]
    return [(p, n) for p, n in lists if not any(q != p and under(p, q) for q, _ in lists)]


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
        try:
            return nnx.merge(graphdef, state, rest)(x)
        except flax.errors.TraceContextError:  # it writes its state: training mode
            raise SBPError(
                f"LayerChain.from_model: block {name!r} updates its own state when called: "
                "BatchNorm in training mode, or Dropout drawing from its RNG stream. A pipeline stage holds "
                "non-parameter state constant (the chain is the model in inference mode): call model.eval() "
                "before LayerChain.from_model / sjp.cut."
            ) from None

    def layouts(placement):
        from sbpjax.flax.annotate import get_sbp

        return get_sbp(nnx.merge(graphdef, params, rest), placement)

    return Layer(name, apply, pure, layouts, tie, "block")


def _part_layer(parts: Parts, role: str, own: dict, model) -> Layer:
    keys = list(own)

    def apply(p, x):
        flat = flatten(p)
        return getattr(parts, role)({k: flat[k] for k in keys}, x)

    def layouts(placement):
        from sbpjax.flax.annotate import get_sbp

        flat = flatten(get_sbp(model, placement))
        return nest({k: flat[k] for k in keys})

    name = "embed" if role == "before" else "head"
    return Layer(name, apply, nest(own), layouts, None, role)


def _in_a_transformation() -> SBPError:
    # the probe standing in for a block stops the model's call at the block's
    # input; inside a transformation that input is the transformation's own value
    return SBPError(
        "LayerChain.from_model: the model calls its blocks inside a JAX transformation (nnx.remat, "
        "jax.checkpoint, nnx.jit, ...), so a block's input cannot be taken out of the call. Call the "
        "blocks directly, x = block(x), and ask sjp.cut(..., remat=True) for activation checkpointing "
        "per layer; or give the layers as functions with LayerChain.from_functions."
    )


def chain_of(model, sample, *, blocks: str | None = None, check: bool = True) -> LayerChain:
    """The :class:`LayerChain` of an NNX model (see the module docstring).
    ``check``: run the chain and the model on ``sample`` and compare."""
    if not isinstance(model, nnx.Module):
        raise SBPError(
            f"LayerChain.from_model: {type(model).__name__} is not a Flax NNX module; for layer functions use "
            "LayerChain.from_functions(fns, params, sample)."
        )
    check_sample(sample, ".from_model")  # before the probe runs the model on it
    path, kind, n = find_blocks(model, blocks)
    try:
        parts = Parts(model, path, kind, n, sample)
        eager = parts.before(parts.params, np.asarray(sample))
    except (SBPError, jax.errors.JAXTypeError):
        raise  # sbpjax's own, and JAX's tracing errors: not the sample's
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise SBPError(
            f"LayerChain.from_model: {type(model).__name__} raised {type(e).__name__} on the sample "
            f"(shape {np.shape(sample)}, dtype {np.asarray(sample).dtype}): {str(e).rstrip('.')}. The sample is one "
            "microbatch of what the model takes (token ids as integers, say)."
        ) from e
    if isinstance(eager, jax.core.Tracer):  # run eagerly
        raise _in_a_transformation()
    node = get_path(model, path)
    try:
        before, after, has_before, has_after = split_params(parts, sample, _through_blocks(node, kind))
    except jax.errors.UnexpectedTracerError:  # a transformation the eager run did not show
        raise _in_a_transformation() from None
    where = path_text(path)
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
            flat.update(flatten(per_layer[0]))
            k = 1
        blocks_params = per_layer[k : k + n]
        if kind == "list":
            for i, p in enumerate(blocks_params):
                flat.update({(*path, i, *q): v for q, v in flatten(p).items()})
        else:
            stacked = jax.tree_util.tree_map(lambda *vs: np.stack(vs), *blocks_params)
            flat.update({(*path, *q): v for q, v in flatten(stacked).items()})
        if has_after:
            flat.update(flatten(per_layer[-1]))
        return nest(flat)

    chain = LayerChain(chain_layers, sample, to_model=to_model, source=".from_model")
    if check:
        _check_against_model(chain, model, sample)
    return chain


def _through_blocks(node, kind: str):
    """The blocks' output shape of their input's, through each block of a list
    in turn (a block may change the width); None for a stack, whose scan
    carries one shape."""
    if kind != "list":
        return None

    def run(h):
        for block in node:
            graphdef, state = nnx.split(block)
            h = jax.eval_shape(lambda s, x, g=graphdef: nnx.merge(g, s)(x), state, h)
        return jax.ShapeDtypeStruct(h.shape, h.dtype)

    return run


def _block_tie(module) -> str:
    """Blocks with the same graph and parameter shapes are alike."""
    graphdef, params = nnx.split(module, nnx.Param, ...)[:2]  # other state (batch stats, RNG streams) apart
    shapes = tuple((np.shape(v), str(v.dtype)) for v in jax.tree_util.tree_leaves(params))
    return f"{type(module).__qualname__}:{hash((graphdef, shapes))}"


def _check_against_model(chain: LayerChain, model, sample) -> None:
    """The chain's output on ``sample`` equals the model's, leaf by leaf (a
    head may return a pytree: logits and an auxiliary loss)."""
    graphdef, state = nnx.split(model)
    want = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, sample)
    got = jax.jit(chain.__call__)(chain.params, sample)
    shapes = [jax.tree.map(lambda v: tuple(np.shape(v)), t) for t in (got, want)]
    worst = _largest_difference(got, want) if shapes[0] == shapes[1] else None
    if worst is None or worst > 0:
        raise SBPError(
            f"LayerChain.from_model: running embed -> {len(chain)} layers -> head does not give the model's "
            f"output on the sample (shapes {shapes[0]} vs {shapes[1]}, largest difference "
            f"{'n/a' if worst is None else worst}). The model's __call__ must run each block once, in order, "
            "as x = block(x); otherwise give the layers as functions with LayerChain.from_functions."
        )


def _largest_difference(got, want) -> float:
    """0.0 where every leaf of ``got`` is close to ``want``'s (rtol 1e-4, atol
    1e-4 of the leaf's largest value, NaN where the other has NaN); otherwise
    the largest difference."""
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        scale = float(np.max(np.abs(w))) if w.size else 0.0
        if not np.allclose(g, w, rtol=1e-4, atol=1e-4 * scale, equal_nan=True):
            diff = float(np.max(np.abs(g - w)))
            worst = max(worst, diff if np.isfinite(diff) else float("inf"))  # a NaN on one side only
    return worst
