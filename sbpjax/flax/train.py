"""Training steps compiled by ``sj.jit``: a loss, an optax optimizer and layouts.

    step = sjf.TrainStep(loss_fn, optax.adamw(3e-4), pl, param_sbp, batch_sbp, zero=True)
    params, opt_state = step.init(params)           # global tensors at their stored layouts
    params, opt_state, loss = step(params, opt_state, batch)

:class:`TrainStep` works on a pytree of parameters (Linen's ``params``, an NNX
pure dict, plain JAX); :class:`sbpjax.flax.trainer.Trainer` wraps it for an NNX
model.

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

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import checked_cost_model
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler.api import checked_budget, constrain, jit
from sbpjax.compiler.arguments import checked_regather, checked_time_limit, is_nd_sbp, state_sbp
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.options import checked_options
from sbpjax.dtypes import canonical_dtype, is_key
from sbpjax.flax.checks import (
    batch_axis,
    batch_layouts,
    checked_compute_dtype,
    checked_loss,
    checked_optimizer,
)
from sbpjax.layout import Geometry, zero_split
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, Partial, format_sbp, normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, is_global, to_global


def zero_layout(nd: tuple, shape, placement: Placement, axis: int) -> tuple:
    """The stored layout of a parameter under ZeRO: B over ``axis`` becomes a
    split of the first dim that stays even (dim 0 first, as OneFlow's Fig. 14).
    A parameter no dim of which divides (a small odd bias) stays as it is."""
    if not -placement.ndim <= axis < placement.ndim:
        raise SBPError(
            f"zero_layout: axis {axis} is out of range for a placement of {placement.ndim} axes "
            f"{placement.axis_names}; give 0..{placement.ndim - 1} (the axis the batch is split over)."
        )
    return zero_split(nd, shape, placement.shape, axis % placement.ndim)  # -1: the last axis


def spread_layout(shape, placement: Placement) -> tuple:
    """Where a parameter whose layout the solver will choose starts (``sj.AUTO``
    in :class:`TrainStep`): split over every axis of ``placement`` by the first
    dim that stays even (:func:`zero_layout` over each axis in turn), so that
    no device holds more than its share before the first step lays it out."""
    nd = (Broadcast(),) * placement.ndim
    for axis in range(placement.ndim):
        nd = zero_layout(nd, shape, placement, axis)
    return nd


def init_global(fn, placement: Placement, sbp, *args):
    """Run ``fn(*args)`` as one compiled program whose outputs are born in their
    layouts: global tensors laid out as ``sbp`` (a tree like the outputs whose
    leaves are nd-SBPs; one nd-SBP stands for a whole subtree), each device
    computing only its own blocks (``jax.jit`` with ``out_shardings``, as
    ``nnx.jit`` initializes a sharded model). No output is gathered on one
    device or on the host. ``args``: arrays (e.g. the physical arrays of
    global tensors) passed to the program.

    S/B layouts that divide evenly are the outputs' shardings; a split that
    does not divide its dim is padded to the physical form inside the program
    (there the padding step may see the whole value); partial layouts are
    refused (an initializer has no terms to keep apart). A typed PRNG key
    output (``optax.noisy_sgd``'s state) stays a replicated ``jax.Array``:
    ``sj.jit`` takes and returns typed keys as such (``compiler.keys``)."""
    abstract = jax.eval_shape(fn, *args)
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    try:
        given = tree.flatten_up_to(  # type: ignore[attr-defined]
            jax.tree.map(lambda nd, sub: jax.tree.map(lambda _: nd, sub), sbp, abstract, is_leaf=is_nd_sbp)
        )
    except (ValueError, TypeError) as e:
        raise SBPError(f"init_global: the layouts do not match the outputs' structure ({e}).") from None
    pl = placement
    nds: list = []
    geoms: list = []
    layouts: list = []
    shardings: list = []
    for k, (leaf, nd) in enumerate(zip(leaves, given)):
        if is_key(leaf):  # a typed PRNG key (optax.noisy_sgd's state): a replicated jax array
            nds.append(None)
            geoms.append(None)
            layouts.append(None)
            shardings.append(NamedSharding(pl.mesh, PartitionSpec()))
            continue
        nd = normalize_nd_sbp(nd, pl.ndim, len(leaf.shape), f"init_global layout of output leaf {k}")
        layout = normalized_layout(nd, len(leaf.shape), pl.shape)
        if layout.partial:
            raise SBPError(f"init_global: output leaf {k} asks for a partial layout {nd}; give S or B.")
        geom = Geometry(tuple(leaf.shape), pl.shape)
        nds.append(nd)
        geoms.append(geom)
        layouts.append(layout)
        shardings.append(NamedSharding(pl.mesh, geom.partition_spec(layout, pl.axis_names)))

    def program(*a):
        outs = jax.tree_util.tree_leaves(fn(*a))
        return [
            y if geom is None or geom.even(layout) else to_global(y, pl, nd).physical
            for y, nd, geom, layout in zip(outs, nds, geoms, layouts)
        ]

    physical = jax.jit(program, out_shardings=shardings)(*args)
    return jax.tree_util.tree_unflatten(
        tree,
        [
            x if nd is None else GlobalTensor(x, leaf.shape, canonical_dtype(leaf.dtype), pl, nd)
            for x, leaf, nd in zip(physical, leaves, nds)
        ],
    )


def _data_axis(batch_sbp, placement: Placement, zero) -> int:
    if isinstance(zero, str):
        if zero not in placement.axis_names:
            raise SBPError(
                f"zero={zero!r}: the placement's axes are {placement.axis_names}; name one of them."
            )
        return placement.axis_names.index(zero)
    axis = batch_axis(batch_layouts(batch_sbp, placement, "TrainStep"), placement)
    if axis is not None:
        return axis
    raise SBPError(
        "zero=True needs a data axis: no batch leaf is split on dim 0 (S(0)). Split the batch over "
        "an axis in batch_sbp, or name the axis, e.g. zero='x'."
    )


def _as_chosen(tree):
    """``out_sbp`` for results of ``sj.AUTO`` arguments: None ("as chosen"),
    where a donated argument's result comes back in its chosen layout."""
    return jax.tree.map(lambda nd: None if nd is AUTO else nd, tree, is_leaf=is_nd_sbp)


class TrainStep:
    """One optimizer step, compiled by ``sj.jit`` into a single ``shard_map``.

    ``loss_fn(params, batch) -> scalar loss`` (or ``(loss, aux)`` with
    ``has_aux=True``; ``aux_sbp`` lays ``aux`` out, as chosen by default);
    ``param_sbp`` is a tree like ``params`` of nd-SBPs (the
    compute layouts; ``None`` or a missing annotation means B); ``batch_sbp`` a
    tree (or one nd-SBP) for the batch.

    ``donate=True`` (default): the step donates the parameters and optimizer
    state it is given (``sj.jit``'s ``donate_argnums=(0, 1)``), so their
    buffers hold the new values and a step keeps one copy of the state, not
    two. The tensors passed in are invalid after the call (reading them or
    passing them again raises an SBPError); use the returned ones.
    ``donate=False`` keeps them valid (e.g. to run a step twice from the same
    state).

    ``options``: an ``sj.CompileOptions`` for ``sj.jit`` (the layout
    solver's work limit and the other settings). ``solve_time_limit`` is
    accepted for compatibility and ignored, with a DeprecationWarning (plans
    do not depend on the clock).

    ``regather``: ``sj.jit``'s (default ``"auto"``): whether weights the plan
    all-gathers are gathered again for the backward pass rather than held
    across the step's memory peak (``sbpjax.compiler.regather``).

    Automatic layouts: a ``param_sbp`` leaf ``sj.AUTO`` (or ``param_sbp=sj.AUTO``
    for all), and with ``memory_budget`` every parameter ``param_sbp`` leaves
    ``None``, is laid out by ``sj.jit``'s whole-program solver with the rest
    of the step. The optimizer state is then chosen by the solver too: it
    mirrors its parameter without a budget; under one it is chosen on its own
    (ZeRO-1's split state beside whole parameters, say). ``memory_budget``
    is ``sj.jit``'s: the bytes per device the step's arguments and results
    hold together (parameters, optimizer state, the batch and the loss; a
    donated argument and its result once), and the solver picks the cheapest
    layouts that fit, or raises an SBPError giving the least any needs.
    ``init`` places such parameters, and their state, split over every
    placement axis where a dim stays even (ZeRO-3's layout: no device holds
    more than its share, :func:`spread_layout`), as the layouts depend on the
    batch's shapes, which ``init`` does not see; the first step lays them out
    as chosen once, and each step returns them there (the state is donated,
    so ``donate=False`` is refused). ``explain`` shows the choice. ``zero``
    is refused with them: give a budget and the solver picks ZeRO's layouts
    where they fit best.
    """

    def __init__(
        self,
        loss_fn,
        optimizer: optax.GradientTransformation,
        placement: Placement,
        param_sbp,
        batch_sbp,
        *,
        zero=False,
        compute_dtype=None,
        has_aux: bool = False,
        aux_sbp=None,
        cost_model=None,
        donate: bool = True,
        solve_time_limit=None,
        regather="auto",
        options=None,
        memory_budget=None,
    ):
        self.loss_fn = loss_fn
        self.optimizer = checked_optimizer(optimizer, "TrainStep")
        self.placement = checked_placement(placement, "TrainStep")
        self.param_sbp = param_sbp
        self.batch_sbp = batch_sbp
        batch_layouts(batch_sbp, self.placement, "TrainStep")
        self.zero = zero
        self.compute_dtype = checked_compute_dtype(compute_dtype, "TrainStep")
        self.has_aux = has_aux
        self.aux_sbp = aux_sbp
        self.cost_model = checked_cost_model(cost_model, "TrainStep")
        self.donate = bool(donate)
        # checked here, not first in sj.jit: a Trainer builds the optimizer
        # state before the step, and a bad setting would fail only after that ran
        checked_time_limit(solve_time_limit, "TrainStep")
        self.options = checked_options(options, "TrainStep")
        self.regather = checked_regather(regather, "TrainStep")
        self.memory_budget = checked_budget(memory_budget, "TrainStep")
        self.stored_sbp = None
        self._fn = None

    # -- layouts ---------------------------------------------------------------
    def layouts(self, params):
        """``(treedef, compute layouts, stored layouts)`` of ``params``' leaves:
        ``param_sbp`` normalized (B where it gives none), and under ZeRO the
        stored layouts split over the data axis (:func:`zero_layout`)."""
        pl = self.placement
        rep = (Broadcast(),) * pl.ndim
        leaves, tree = jax.tree_util.tree_flatten(params, is_leaf=is_global)
        try:
            given = (
                [self.param_sbp] * len(leaves)
                if self.param_sbp is None or self.param_sbp is AUTO
                else tree.flatten_up_to(self.param_sbp)
            )
        except (ValueError, TypeError) as e:
            raise SBPError(
                f"TrainStep: param_sbp does not match the parameters' structure ({e}). Give a tree "
                "shaped like the parameters (get_sbp(model, placement) builds one)."
            ) from None
        paths = [
            jax.tree_util.keystr(k)
            for k, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_global)[0]
        ]
        unannotated = AUTO if self.memory_budget is not None else rep
        compute = [
            unannotated
            if nd is None
            else nd
            if nd is AUTO
            else normalize_nd_sbp(
                nd, pl.ndim, len(np.shape(v)) if not is_global(v) else v.ndim, f"param_sbp of parameter {p}"
            )
            for v, nd, p in zip(leaves, given, paths)
        ]
        if AUTO in compute:
            self._check_auto()
        for nd, p in zip(compute, paths):
            if nd is not AUTO and any(isinstance(s, Partial) for s in nd):
                raise SBPError(
                    f"TrainStep: parameter {p} is given the partial layout {format_sbp(nd)}. A parameter "
                    "is stored whole or split (S or B on each axis) and the optimizer updates it in place; "
                    "a partial sum is a value inside the step. Give it S or B (its gradient may still be "
                    "partial inside the step: the step reduces it where the update needs it)."
                )
        stored = compute
        if self.zero and AUTO not in compute:
            axis = _data_axis(self.batch_sbp, pl, self.zero)
            stored = [zero_layout(nd, v.shape, pl, axis) for v, nd in zip(leaves, compute)]
        return tree, compute, stored

    def _check_auto(self) -> None:
        """Settings automatic layouts cannot keep, refused before anything is placed."""
        what = "automatic layouts (sj.AUTO parameters; a Trainer's auto=True or memory_budget=)"
        if self.zero:
            raise SBPError(
                f"TrainStep: zero= and {what} both decide how parameters and optimizer state are "
                "stored. Drop zero= and give memory_budget=: the solver then picks ZeRO's split "
                "layouts where they are the cheapest that fit."
            )
        if not self.donate:
            raise SBPError(
                f"TrainStep: {what} need donate=True: a donated state comes back in the layouts the "
                "solver chose, ready for the next step; without donation every step would lay the "
                "state out again."
            )

    def init(self, params):
        """Parameters as global tensors at their stored layouts, and the
        optimizer state laid out like them (scalars B).

        Global tensors already at their stored layout are returned as they are
        (with ``donate=True`` the first step consumes them); others are boxed;
        plain arrays are laid out from the host. The optimizer state is made
        from the placed parameters by one compiled program whose outputs are
        born in their layouts (:func:`init_global`): it never passes through
        the host or one device. An ``sj.AUTO`` parameter keeps the layout of a
        global tensor on this placement, and is placed :func:`spread_layout`
        otherwise, until the first step lays it out as the solver chooses."""
        tree, compute, stored = self.layouts(params)
        self._tree, self._compute, self.stored_sbp = tree, compute, jax.tree_util.tree_unflatten(tree, stored)
        pl = self.placement
        leaves = jax.tree_util.tree_leaves(params, is_leaf=is_global)
        placed = []
        for v, nd in zip(leaves, stored):
            if nd is AUTO and is_global(v) and v.placement == pl:
                placed.append(v)  # already placed: the first step lays it out as chosen
                continue
            if nd is AUTO:
                nd = spread_layout(np.shape(v) if not is_global(v) else v.shape, pl)
            placed.append(
                v.to_global(sbp=nd, placement=pl) if is_global(v) else to_global(np.asarray(v), pl, nd)
            )
        params_g = jax.tree_util.tree_unflatten(tree, placed)
        return params_g, self._init_state(placed)

    def _init_state(self, placed: list):
        """The optimizer state of the placed parameters, born in its layouts; builds the step."""
        pl, tree, optimizer = self.placement, self._tree, self.optimizer
        meta = [(t.shape, t.dtype, t.sbp) for t in placed]

        def opt_init(*physical):
            logical = [GlobalTensor(x, *m[:2], pl, m[2]).to_jax() for x, m in zip(physical, meta)]
            return optimizer.init(jax.tree_util.tree_unflatten(tree, logical))

        physical = [t.physical for t in placed]
        rep = (Broadcast(),) * pl.ndim
        shapes = jax.eval_shape(opt_init, *physical)
        self._opt_tree = jax.tree_util.tree_structure(shapes)
        born = state_sbp(
            shapes,
            jax.tree_util.tree_unflatten(tree, [t.sbp for t in placed]),
            rep,
        )
        # with automatic layouts the step chooses the state's layouts too (born as its parameters are)
        self.opt_sbp = AUTO if AUTO in self._compute else born
        opt_g = init_global(opt_init, pl, born, *physical)
        self._build()
        return opt_g

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
                out.append(v if nd is AUTO else constrain(v, nd))  # AUTO: as the solver chose
            return jax.tree_util.tree_unflatten(tree, out)

        def step(params, opt_state, batch):
            def objective(p):
                out = loss_fn(to_compute(p), batch)
                loss, aux = out if has_aux else (out, None)
                return checked_loss(loss, loss_fn, has_aux).astype(jnp.float32), aux

            (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state, loss, aux) if has_aux else (params, opt_state, loss)

        rep = (Broadcast(),) * self.placement.ndim
        outs = (_as_chosen(self.stored_sbp), _as_chosen(self.opt_sbp), rep) + (
            (self.aux_sbp,) if has_aux else ()
        )
        self._fn = jit(
            step,
            placement=self.placement,
            in_sbp=(self.stored_sbp, self.opt_sbp, self.batch_sbp),
            out_sbp=outs,
            cost_model=self.cost_model,
            donate_argnums=(0, 1) if self.donate else (),
            options=self.options,
            regather=self.regather,
            memory_budget=self.memory_budget,
        )

    def _ready(self, params, opt_state):
        if self._fn is None:
            raise SBPError(
                "TrainStep: call step.init(params) first; it lays out the parameters and the "
                "optimizer state and builds the program."
            )
        # named here: sj.jit would report a mismatch against its in_sbp, which users of TrainStep never wrote
        got = [jax.tree_util.tree_structure(v, is_leaf=is_global) for v in (params, opt_state)]
        if got[1] != self._opt_tree:
            swapped = got[0] == self._opt_tree and got[1] == self._tree
            raise SBPError(
                "TrainStep: "
                + (
                    "params and opt_state are passed in each other's place; call step(params, opt_state, batch)."
                    if swapped
                    else f"opt_state has {got[1].num_leaves} arrays where this optimizer's state has "
                    f"{self._opt_tree.num_leaves} (a state another optimizer made?); pass the opt_state "
                    "step.init returned, or the previous step's."
                )
            )

    def __call__(self, params, opt_state, batch):
        """``(params, opt_state, loss)`` after one step (``aux`` last with has_aux)."""
        self._ready(params, opt_state)
        return self._fn(params, opt_state, batch)

    def explain(self, params, opt_state, batch):
        """The compiler's explanation of the step (signatures, boxings, bytes)."""
        self._ready(params, opt_state)
        return self._fn.explain(params, opt_state, batch)

    def lower(self, params, opt_state, batch):
        self._ready(params, opt_state)
        return self._fn.lower(params, opt_state, batch)


__all__ = ["TrainStep", "batch_axis", "init_global", "spread_layout", "zero_layout"]
