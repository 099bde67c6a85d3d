"""One stage's programs, compiled by :func:`sbpjax.jit`: forward (F), backward
for the input (B), backward for the weights (W), the two backwards as one
program, and the optimizer update.

All backwards come from one VJP of the stage (:mod:`sbpjax.pipeline.split`):
F keeps the VJP's residuals; B reads them and the output cotangent and
returns the input cotangent and what W needs (*kept*); W adds the parameter
cotangent into the stage's gradient accumulator. Schedules that do not split
the backward (GPipe, 1F1B, interleaved 1F1B) run B and W as one program, the
same equations in one XLA computation. The last stage's F ends in the loss and
its VJP is seeded with ``1 / m``, so the accumulator sums the microbatches'
gradients into the whole batch's mean.

Layouts: parameters, the stage input and output keep the stage's nd-SBPs;
residuals and kept values take the layout the compiler chooses for them in
the program that makes them (``out_sbp=None``) and are read as given.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sbpjax._errors import SBPError
from sbpjax.compiler.api import constrain, jit, state_sbp
from sbpjax.dtypes import is_key
from sbpjax.pipeline.split import SplitVJP, split_vjp
from sbpjax.sbp import Broadcast
from sbpjax.tensor import is_global, to_global


def _avals(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_global)
    return treedef, tuple((tuple(np.shape(v)), np.dtype(v.dtype)) for v in leaves)


def _nbytes(v) -> int:
    return int(np.prod(np.shape(v))) * np.dtype(v.dtype).itemsize


class StageVJP:
    """``fn(params, x, *rest)``'s VJP, split per input shapes (traced once each).

    ``differentiate_input``: False for the first stage, whose input needs no
    cotangent (it may be integer tokens); it has no B program, and its whole
    backward runs as one program (in its B action, see
    :mod:`sbpjax.pipeline.bodies`)."""

    def __init__(self, fn: Callable, differentiate_input: bool):
        self.fn = fn
        self.differentiate_input = differentiate_input
        self._splits: dict = {}

    def split(self, p, x, rest) -> SplitVJP:
        key = (_avals(p), _avals(x), _avals(rest))
        if key not in self._splits:
            (pt, pa), (xt, xa), (rt, _) = key
            flat = [jax.ShapeDtypeStruct(s, d) for s, d in (*pa, *xa, *key[2][1])]
            n_p, n_x = len(pa), len(xa)

            def stage(*leaves):
                return self.fn(
                    jax.tree_util.tree_unflatten(pt, leaves[:n_p]),
                    jax.tree_util.tree_unflatten(xt, leaves[n_p : n_p + n_x]),
                    *jax.tree_util.tree_unflatten(rt, leaves[n_p + n_x :]),
                )

            self._splits[key] = split_vjp(stage, flat, n_p, n_x if self.differentiate_input else 0)
        return self._splits[key]

    def slot_bytes(self, p, x, rest) -> tuple[int, int]:
        """Logical bytes one microbatch holds in the stash (inputs and residuals)
        and in the kept register (inputs, residuals W reads, the output
        cotangent and what B computes for W; nothing on the first stage, whose
        B runs the whole backward); ``p``, ``x``, ``rest``: values or
        ``jax.ShapeDtypeStruct``s."""
        sp = self.split(p, x, rest)
        inputs = sum(_nbytes(v) for v in jax.tree_util.tree_leaves((x, rest)))
        saved = [_nbytes(r.aval) for r in sp.saved_refs]
        ct = sum(_nbytes(r.aval) for r in sp.ct_refs)
        stash = inputs + sum(saved)
        if not self.differentiate_input:
            return stash, 0
        kept = inputs + sum(saved[i] for i in sp.saved_for_weight) + ct + sp.kept_nbytes
        return stash, kept

    @staticmethod
    def _args(p, x, rest) -> list:
        return jax.tree_util.tree_leaves((p, x, rest))

    def forward(self, p, x, *rest):
        """``(output, saved residuals)``."""
        sp = self.split(p, x, rest)
        out, saved = sp.forward(self._args(p, x, rest))
        return jax.tree_util.tree_unflatten(sp.out_tree, out), tuple(saved)

    def backward_input(self, p, x, *rest_saved_ct):
        """``(input cotangent, kept)`` from ``(*rest, saved_for_input, ct)`` (not
        for a first stage, whose input has no cotangent)."""
        *rest, saved_b, ct = rest_saved_ct
        sp = self.split(p, x, tuple(rest))
        dx, kept = sp.backward_input(
            self._args(p, x, tuple(rest)), list(saved_b), jax.tree_util.tree_leaves(ct)
        )
        return self._input_tree(x, dx), tuple(kept)

    def backward_weight(self, p, x, *rest_saved_ct_kept_acc):
        """The accumulator plus the parameter cotangent, from ``(*rest, saved_for_weight, ct, kept, acc)``."""
        *rest, saved_w, ct, kept, acc = rest_saved_ct_kept_acc
        sp = self.split(p, x, tuple(rest))
        dp = sp.backward_weight(
            self._args(p, x, tuple(rest)), list(saved_w), jax.tree_util.tree_leaves(ct), list(kept)
        )
        return _add(acc, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(p), dp))

    def backward(self, p, x, *rest_saved_ct_acc):
        """B then W in one program: ``(input cotangent, accumulator + parameter
        cotangent)``, or the accumulator alone when the input has no cotangent."""
        *rest, saved, ct, acc = rest_saved_ct_acc
        sp = self.split(p, x, tuple(rest))
        dx, dp = sp.backward(self._args(p, x, tuple(rest)), list(saved), jax.tree_util.tree_leaves(ct))
        acc = _add(acc, jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(p), dp))
        return (self._input_tree(x, dx), acc) if self.differentiate_input else acc

    @staticmethod
    def _input_tree(x, leaves):
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x), leaves)


def _gathered(fn: Callable, compute_sbp) -> Callable:
    def stage(p, x):
        return fn(jax.tree_util.tree_map(constrain, p, compute_sbp, is_leaf=is_global), x)

    return stage


def _placed_state(v, pl, nd, index: int):
    """An optimizer-state leaf on the stage's devices: a global tensor, or a
    typed PRNG key (``optax.add_noise``'s) as a replicated jax array, which
    the update program (an ``sj.jit``) takes and returns as a key. Each
    stage's optimizer is initialized on its own parameters, so every stage
    would start from the same key and draw the same noise: stage ``index``'s
    key is folded with its index. (The draws then differ from one optimizer
    over the whole model, whose key is split over all its leaves.)"""
    if is_key(v):
        return jax.device_put(jax.random.fold_in(v, index), NamedSharding(pl.mesh, PartitionSpec()))
    return to_global(np.asarray(v), pl, nd)


def _add(acc, d):
    return jax.tree_util.tree_map(lambda a, b: a + b, acc, d)


class StagePrograms:
    """One stage's compiled programs (shared by every pipeline built on the same
    stage, loss and optimizer, so they compile once) and this pipeline's state
    for it: optimizer state, gradient accumulator, last step's gradients.

    ``vjp`` is the stage's split VJP; ``forward``, ``backward_input``,
    ``backward_weight``, ``backward`` and ``update`` are :func:`sbpjax.jit`
    programs (each compiles at its first call)."""

    def __init__(self, stage, loss_fn: Callable | None, first: bool, optimizer, target_sbp, index: int = 0):
        pl, ps = stage.placement, stage.stored_sbp
        host_params = jax.tree_util.tree_map(lambda t: t.numpy(), stage.params, is_leaf=is_global)
        try:
            state = optimizer.init(host_params)
        except Exception as e:  # noqa: BLE001 - whatever optax raises on a tree it was not written for
            raise SBPError(
                f"Pipeline: the optimizer cannot be initialized on stage {index} ({stage.name!r})'s own "
                f"parameters: {type(e).__name__}: {str(e).splitlines()[0][:200]}. A pipeline runs the optimizer "
                "on each stage's parameter tree, so masks and labels (optax.masked, optax.multi_transform) "
                "must be written for one stage's tree (a function of the tree works for any stage)."
            ) from None
        layout = state_sbp(state, ps, (Broadcast(),) * pl.ndim)
        self.state = jax.tree_util.tree_map(lambda v, s: _placed_state(v, pl, s, index), state, layout)
        key = (loss_fn, first, optimizer, target_sbp)
        if key not in stage._compiled:
            stage._compiled[key] = _compile(stage, loss_fn, first, optimizer, target_sbp, layout)
        (self.vjp, self.forward, self.backward_input, self.backward_weight, self.backward, self.update) = (
            stage._compiled[key]
        )
        self.zeros = jax.tree_util.tree_map(
            lambda t, s: to_global(np.zeros(t.shape, t.dtype), pl, s), stage.params, ps, is_leaf=is_global
        )
        self.grads = None
        self.last = loss_fn is not None


def checked_loss(loss, loss_fn):
    """The loss a pipeline differentiates: one float scalar (the mean over a
    microbatch), which the backward pass seeds with 1 / microbatches."""
    leaves = jax.tree_util.tree_leaves(loss)
    if len(leaves) != 1 or np.shape(leaves[0]) != () or not jnp.issubdtype(leaves[0].dtype, jnp.floating):
        what = (
            f"a {type(loss).__name__} of {len(leaves)} values"
            if len(leaves) != 1 or not hasattr(loss, "shape")
            else f"an array of shape {np.shape(leaves[0])} and dtype {leaves[0].dtype}"
        )
        raise SBPError(
            f"Pipeline: loss_fn {getattr(loss_fn, '__name__', loss_fn)!r} returns {what}; it must return one "
            "float scalar, the mean loss of the microbatch (e.g. jnp.mean over its rows). Auxiliary outputs "
            "(accuracy, counts) are not carried: compute them from the model's outputs outside the pipeline."
        )
    return leaves[0]


def _compile(stage, loss_fn: Callable | None, first: bool, optimizer, target_sbp, state_layout):
    """The split VJP and the stage's programs (see :class:`StagePrograms`).
    Parameters come in their stored layouts; a ZeRO stage gathers them to its
    compute layouts where it uses them (``sj.constrain``)."""
    pl, fn = stage.placement, stage.fn
    ps, xs, ys = stage.stored_sbp, stage.in_sbp, stage.out_sbp
    if stage.stored_sbp is not stage.param_sbp:
        fn = _gathered(fn, stage.param_sbp)
    rep = (Broadcast(),) * pl.ndim
    if loss_fn is not None:  # the last stage: its forward ends in the loss, seeded with 1 / m

        def with_loss(p, x, t):
            return checked_loss(loss_fn(fn(p, x), t), loss_fn)

        vjp = StageVJP(with_loss, not first)
        args: tuple = (ps, xs, target_sbp)
        out = ct = rep
    else:
        vjp = StageVJP(fn, not first)
        args, out, ct = (ps, xs), ys, ys
    forward = jit(vjp.forward, placement=pl, in_sbp=args, out_sbp=(out, None))
    # the first stage's input has no cotangent: its B is never run, its backward returns the accumulator
    backward_input = jit(vjp.backward_input, placement=pl, in_sbp=(*args, None, ct), out_sbp=(xs, None))
    backward_weight = jit(vjp.backward_weight, placement=pl, in_sbp=(*args, None, ct, None, ps), out_sbp=ps)
    backward = jit(
        vjp.backward, placement=pl, in_sbp=(*args, None, ct, ps), out_sbp=ps if first else (xs, ps)
    )

    def update(p, s, g):
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    update_c = jit(update, placement=pl, in_sbp=(ps, state_layout, ps), out_sbp=(ps, state_layout))
    return vjp, forward, backward_input, backward_weight, backward, update_c
