"""Training steps compiled by ``sj.jit``: a loss, an optax optimizer and layouts.

    step = sjf.TrainStep(loss_fn, optax.adamw(3e-4), pl, param_sbp, batch_sbp, zero=True)
    params, opt_state = step.init(params)           # global tensors at their stored layouts
    params, opt_state, loss = step(params, opt_state, batch)

:class:`TrainStep` works on a pytree of parameters (Linen's ``params``, an NNX
pure dict, plain JAX); :class:`Trainer` wraps it for an NNX model.

Layouts, as in OneFlow's Fig. 14:
- without ZeRO a parameter, its gradient and its optimizer state share the
  parameter's layout: gradients of B parameters come out P(sum) and are
  all-reduced, those of split parameters need nothing;
- ``zero=True`` (or an axis name) stores the fp32 master weight and its
  optimizer state split over the data axis (S(0), or the first dim that
  divides evenly); the loss sees it boxed to the compute layout (an
  all-gather), and the gradient is reduce-scattered to the stored layout;
- ``compute_dtype=jnp.bfloat16`` casts the master weights before the boxing,
  so the all-gather moves half the bytes and the model computes in bf16,
  while gradients, optimizer state and updates stay fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from sbpjax import checkpoint
from sbpjax._errors import SBPError
from sbpjax.compiler.api import constrain, is_nd_sbp, jit, state_sbp
from sbpjax.flax.annotate import get_sbp
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Split, normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, to_global


def _is_gt(v) -> bool:
    return isinstance(v, GlobalTensor)


def zero_layout(nd: tuple, shape, placement: Placement, axis: int) -> tuple:
    """The stored layout of a parameter under ZeRO: B over ``axis`` becomes a
    split of the first dim that stays even (dim 0 first, as OneFlow's Fig. 14).
    A parameter no dim of which divides (a small odd bias) stays as it is."""
    if not isinstance(nd[axis], Broadcast) or placement.shape[axis] == 1:
        return nd
    for dim in range(len(shape)):
        splits = placement.shape[axis] * math.prod(
            placement.shape[a] for a, s in enumerate(nd) if isinstance(s, Split) and s.dim == dim)
        if shape[dim] % splits == 0:
            return nd[:axis] + (Split(dim),) + nd[axis + 1:]
    return nd


def _data_axis(batch_sbp, placement: Placement, zero) -> int:
    if isinstance(zero, str):
        if zero not in placement.axis_names:
            raise SBPError(f"zero={zero!r}: the placement's axes are {placement.axis_names}; name one of them.")
        return placement.axis_names.index(zero)
    for nd in jax.tree.leaves(batch_sbp, is_leaf=is_nd_sbp):
        if is_nd_sbp(nd):
            for a, s in enumerate(nd):
                if isinstance(s, Split) and s.dim == 0 and placement.shape[a] > 1:
                    return a
    raise SBPError("zero=True needs a data axis: no batch leaf is split on dim 0 (S(0)). Split the batch over "
                   "an axis in batch_sbp, or name the axis, e.g. zero='x'.")


class TrainStep:
    """One optimizer step, compiled by ``sj.jit`` into a single ``shard_map``.

    ``loss_fn(params, batch) -> scalar loss`` (or ``(loss, aux)`` with
    ``has_aux=True``); ``param_sbp`` is a tree like ``params`` of nd-SBPs (the
    compute layouts; ``None`` or a missing annotation means B); ``batch_sbp`` a
    tree (or one nd-SBP) for the batch.
    """

    def __init__(self, loss_fn, optimizer: optax.GradientTransformation, placement: Placement, param_sbp,
                 batch_sbp, *, zero=False, compute_dtype=None, has_aux: bool = False, cost_model=None):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.placement = placement
        self.param_sbp = param_sbp
        self.batch_sbp = batch_sbp
        self.zero = zero
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.has_aux = has_aux
        self.cost_model = cost_model
        self.stored_sbp = None
        self._fn = None

    # -- layouts ---------------------------------------------------------------
    def _layouts(self, params):
        pl = self.placement
        rep = (Broadcast(),) * pl.ndim
        leaves, tree = jax.tree_util.tree_flatten(params, is_leaf=_is_gt)
        try:
            given = tree.flatten_up_to(self.param_sbp) if self.param_sbp is not None else [None] * len(leaves)
        except (ValueError, TypeError) as e:
            raise SBPError(f"TrainStep: param_sbp does not match the parameters' structure ({e}). Give a tree "
                           "shaped like the parameters (get_sbp(model, placement) builds one).") from None
        paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_gt)[0]]
        compute = [rep if nd is None else normalize_nd_sbp(nd, pl.ndim, len(np.shape(v)) if not _is_gt(v) else v.ndim,
                                                           f"param_sbp of parameter {p}")
                   for v, nd, p in zip(leaves, given, paths)]
        stored = compute
        if self.zero:
            axis = _data_axis(self.batch_sbp, pl, self.zero)
            stored = [zero_layout(nd, v.shape, pl, axis) for v, nd in zip(leaves, compute)]
        return tree, compute, stored

    def init(self, params):
        """Parameters as global tensors at their stored layouts, and the
        optimizer state laid out like them (scalars B)."""
        tree, compute, stored = self._layouts(params)
        self._tree, self._compute, self.stored_sbp = tree, compute, jax.tree_util.tree_unflatten(tree, stored)
        pl = self.placement
        leaves = jax.tree_util.tree_leaves(params, is_leaf=_is_gt)
        placed = [v.to_global(sbp=nd, placement=pl) if _is_gt(v) else to_global(np.asarray(v), pl, nd)
                  for v, nd in zip(leaves, stored)]
        params_g = jax.tree_util.tree_unflatten(tree, placed)
        logical = jax.tree_util.tree_unflatten(tree, [jnp.asarray(np.asarray(v.numpy() if _is_gt(v) else v))
                                                      for v in leaves])
        opt_state = self.optimizer.init(logical)
        rep = (Broadcast(),) * pl.ndim
        self.opt_sbp = state_sbp(opt_state, self.stored_sbp, rep)
        opt_leaves, opt_tree = jax.tree_util.tree_flatten(opt_state)
        opt_sbp_leaves = opt_tree.flatten_up_to(self.opt_sbp)
        opt_g = jax.tree_util.tree_unflatten(
            opt_tree, [to_global(np.asarray(v), pl, nd) for v, nd in zip(opt_leaves, opt_sbp_leaves)])
        self._build()
        return params_g, opt_g

    def _build(self):
        tree, compute = self._tree, self._compute
        cast = self.compute_dtype
        optimizer, loss_fn, has_aux = self.optimizer, self.loss_fn, self.has_aux

        def to_compute(p):
            leaves = jax.tree_util.tree_leaves(p)
            out = []
            for v, nd in zip(leaves, compute):
                if cast is not None and jnp.issubdtype(v.dtype, jnp.floating):
                    v = v.astype(cast)  # before the boxing: the all-gather moves compute-dtype bytes
                out.append(constrain(v, nd))
            return jax.tree_util.tree_unflatten(tree, out)

        def step(params, opt_state, batch):
            def objective(p):
                out = loss_fn(to_compute(p), batch)
                loss, aux = out if has_aux else (out, None)
                return loss.astype(jnp.float32), aux

            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state, loss, aux) if has_aux else (params, opt_state, loss)

        rep = (Broadcast(),) * self.placement.ndim
        outs = (self.stored_sbp, self.opt_sbp, rep) + ((None,) if has_aux else ())
        self._fn = jit(step, placement=self.placement, in_sbp=(self.stored_sbp, self.opt_sbp, self.batch_sbp),
                       out_sbp=outs, cost_model=self.cost_model)

    def _ready(self):
        if self._fn is None:
            raise SBPError("TrainStep: call step.init(params) first; it lays out the parameters and the "
                           "optimizer state and builds the program.")

    def __call__(self, params, opt_state, batch):
        """``(params, opt_state, loss)`` after one step (``aux`` last with has_aux)."""
        self._ready()
        return self._fn(params, opt_state, batch)

    def explain(self, params, opt_state, batch):
        """The compiler's explanation of the step (signatures, boxings, bytes)."""
        self._ready()
        return self._fn.explain(params, opt_state, batch)

    def lower(self, params, opt_state, batch):
        self._ready()
        return self._fn.lower(params, opt_state, batch)


def bytes_per_device(tree) -> int:
    """The largest number of bytes any one device holds for the global tensors
    in ``tree`` (measured from the local arrays, padding included)."""
    per: dict = {}
    for t in jax.tree.leaves(tree, is_leaf=_is_gt):
        if not _is_gt(t):
            continue
        for shard in t.physical.addressable_shards:
            per[shard.device.id] = per.get(shard.device.id, 0) + shard.data.nbytes
    return max(per.values()) if per else 0


class Trainer:
    """Train an NNX model with ``sj.jit``: its parameters' annotations are the
    compute layouts, the optimizer state follows them (or is split by ZeRO).

        trainer = Trainer(model, optax.adamw(1e-3), loss_fn, pl, batch_sbp=(S(0), B))
        loss = trainer.step(batch)          # loss_fn(model, batch) -> scalar
        print(trainer.explain(batch).summary())
        model = trainer.model()             # the trained model, unplaced (numpy values)

    Other state of the model (non-Param variables) is passed in as B and left
    unchanged: models whose forward pass updates state (BatchNorm statistics,
    dropout RNG counters) are not supported by the Trainer yet.
    """

    def __init__(self, model, optimizer, loss_fn, placement: Placement, *, batch_sbp, zero=False,
                 compute_dtype=None, cost_model=None):
        self.placement = placement
        self.graphdef, params_state, self.rest = nnx.split(model, nnx.Param, ...)
        self._template = params_state
        pure = nnx.to_pure_dict(params_state)
        template = self._template
        graphdef, rest = self.graphdef, self.rest

        def model_loss(params, batch):
            state = jax.tree.map(lambda v: v, template)
            nnx.replace_by_pure_dict(state, params)
            return loss_fn(nnx.merge(graphdef, state, rest), batch)

        self.train_step = TrainStep(model_loss, optimizer, placement, get_sbp(model, placement), batch_sbp,
                                    zero=zero, compute_dtype=compute_dtype, cost_model=cost_model)
        self.params, self.opt_state = self.train_step.init(pure)

    def step(self, batch) -> float:
        self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state, batch)
        return float(loss.numpy())

    def explain(self, batch):
        return self.train_step.explain(self.params, self.opt_state, batch)

    def model(self):
        """The trained model with logical parameter values (plain arrays)."""
        state = jax.tree.map(lambda v: v, self._template)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda t: jnp.asarray(t.numpy()), self.params, is_leaf=_is_gt))
        return nnx.merge(self.graphdef, state, self.rest)

    def save(self, path) -> None:
        """Save parameters and optimizer state with orbax (``sbpjax.checkpoint``)."""
        checkpoint.save(path, {"params": self.params, "opt_state": self.opt_state})

    def restore(self, path) -> None:
        """Load a state saved by any Trainer of the same model and optimizer,
        whatever its placement and layouts, into this Trainer's layouts."""
        state = checkpoint.restore(path, {"params": self.params, "opt_state": self.opt_state})
        self.params, self.opt_state = state["params"], state["opt_state"]

    def state_bytes_per_device(self) -> dict:
        """Bytes the most loaded device holds: parameters and optimizer state."""
        return {"params": bytes_per_device(self.params), "opt_state": bytes_per_device(self.opt_state)}
