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
from jax.sharding import NamedSharding

from sbpjax import checkpoint
from sbpjax._errors import SBPError
from sbpjax.boxing.plan import normalized_layout
from sbpjax.compiler.api import constrain, jit
from sbpjax.compiler.arguments import checked_regather, checked_time_limit, is_nd_sbp, state_sbp
from sbpjax.compiler.options import checked_options
from sbpjax.dtypes import canonical_dtype
from sbpjax.flax.annotate import get_sbp
from sbpjax.layout import Geometry
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
            placement.shape[a] for a, s in enumerate(nd) if isinstance(s, Split) and s.dim == dim
        )
        if shape[dim] % splits == 0:
            return nd[:axis] + (Split(dim),) + nd[axis + 1 :]
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
    refused (an initializer has no terms to keep apart)."""
    abstract = jax.eval_shape(fn, *args)
    leaves, tree = jax.tree_util.tree_flatten(abstract)
    try:
        given = tree.flatten_up_to(  # type: ignore[attr-defined]
            jax.tree.map(lambda nd, sub: jax.tree.map(lambda _: nd, sub), sbp, abstract, is_leaf=is_nd_sbp)
        )
    except (ValueError, TypeError) as e:
        raise SBPError(f"init_global: the layouts do not match the outputs' structure ({e}).") from None
    pl = placement
    nds, geoms, layouts, shardings = [], [], [], []
    for k, (leaf, nd) in enumerate(zip(leaves, given)):
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
            y if geom.even(layout) else to_global(y, pl, nd).physical
            for y, nd, geom, layout in zip(outs, nds, geoms, layouts)
        ]

    physical = jax.jit(program, out_shardings=shardings)(*args)
    return jax.tree_util.tree_unflatten(
        tree,
        [
            GlobalTensor(x, leaf.shape, canonical_dtype(leaf.dtype), pl, nd)
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
    for nd in jax.tree.leaves(batch_sbp, is_leaf=is_nd_sbp):
        if is_nd_sbp(nd):
            for a, s in enumerate(nd):
                if isinstance(s, Split) and s.dim == 0 and placement.shape[a] > 1:
                    return a
    raise SBPError(
        "zero=True needs a data axis: no batch leaf is split on dim 0 (S(0)). Split the batch over "
        "an axis in batch_sbp, or name the axis, e.g. zero='x'."
    )


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
    ):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.placement = placement
        self.param_sbp = param_sbp
        self.batch_sbp = batch_sbp
        self.zero = zero
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.has_aux = has_aux
        self.aux_sbp = aux_sbp
        self.cost_model = cost_model
        self.donate = bool(donate)
        # checked here, not first in sj.jit: a Trainer builds the optimizer
        # state before the step, and a bad setting would fail only after that ran
        checked_time_limit(solve_time_limit, "TrainStep")
        self.options = checked_options(options, "TrainStep")
        self.regather = checked_regather(regather, "TrainStep")
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
            raise SBPError(
                f"TrainStep: param_sbp does not match the parameters' structure ({e}). Give a tree "
                "shaped like the parameters (get_sbp(model, placement) builds one)."
            ) from None
        paths = [
            jax.tree_util.keystr(k)
            for k, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_gt)[0]
        ]
        compute = [
            rep
            if nd is None
            else normalize_nd_sbp(
                nd, pl.ndim, len(np.shape(v)) if not _is_gt(v) else v.ndim, f"param_sbp of parameter {p}"
            )
            for v, nd, p in zip(leaves, given, paths)
        ]
        stored = compute
        if self.zero:
            axis = _data_axis(self.batch_sbp, pl, self.zero)
            stored = [zero_layout(nd, v.shape, pl, axis) for v, nd in zip(leaves, compute)]
        return tree, compute, stored

    def init(self, params):
        """Parameters as global tensors at their stored layouts, and the
        optimizer state laid out like them (scalars B).

        Global tensors already at their stored layout are returned as they are
        (with ``donate=True`` the first step consumes them); others are boxed;
        plain arrays are laid out from the host. The optimizer state is made
        from the placed parameters by one compiled program whose outputs are
        born in their layouts (:func:`init_global`): it never passes through
        the host or one device."""
        tree, compute, stored = self._layouts(params)
        self._tree, self._compute, self.stored_sbp = tree, compute, jax.tree_util.tree_unflatten(tree, stored)
        pl = self.placement
        leaves = jax.tree_util.tree_leaves(params, is_leaf=_is_gt)
        placed = [
            v.to_global(sbp=nd, placement=pl) if _is_gt(v) else to_global(np.asarray(v), pl, nd)
            for v, nd in zip(leaves, stored)
        ]
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
        self.opt_sbp = state_sbp(jax.eval_shape(opt_init, *physical), self.stored_sbp, rep)
        opt_g = init_global(opt_init, pl, self.opt_sbp, *physical)
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
        outs = (self.stored_sbp, self.opt_sbp, rep) + ((self.aux_sbp,) if has_aux else ())
        self._fn = jit(
            step,
            placement=self.placement,
            in_sbp=(self.stored_sbp, self.opt_sbp, self.batch_sbp),
            out_sbp=outs,
            cost_model=self.cost_model,
            donate_argnums=(0, 1) if self.donate else (),
            options=self.options,
            regather=self.regather,
        )

    def _ready(self):
        if self._fn is None:
            raise SBPError(
                "TrainStep: call step.init(params) first; it lays out the parameters and the "
                "optimizer state and builds the program."
            )

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


def _is_key(v) -> bool:
    return hasattr(v, "dtype") and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)


def _unwrap_keys(tree):
    return jax.tree.map(lambda v: jax.random.key_data(v) if _is_key(v) else v, tree)


def _wrap_keys(tree, impls):
    return jax.tree.map(
        lambda v, impl: v if impl is None else jax.random.wrap_key_data(v, impl=impl),
        tree,
        impls,
        is_leaf=lambda v: v is None,
    )


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


def _step_options(zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options) -> dict:
    """The TrainStep keywords both Trainer constructors take and pass on as they are."""
    return dict(
        zero=zero,
        compute_dtype=compute_dtype,
        cost_model=cost_model,
        donate=donate,
        solve_time_limit=solve_time_limit,
        regather=regather,
        options=options,
    )


class Trainer:
    """Train an NNX model with ``sj.jit``: its parameters' annotations are the
    compute layouts, the optimizer state follows them (or is split by ZeRO).

        trainer = Trainer(model, optax.adamw(1e-3), loss_fn, pl, batch_sbp=(S(0), B))
        loss = trainer.step(batch)          # loss_fn(model, batch) -> scalar
        print(trainer.explain(batch).summary())
        model = trainer.model()             # the trained model, unplaced (numpy values)

    The model's other state (every non-Param variable: BatchNorm statistics,
    dropout RNG keys and counters) goes through the step too: it is B, the
    forward pass may update it (statistics over a split batch are reduced
    across devices), and the step returns it, as ``nnx.jit`` of the same
    step would. RNG keys travel as their key data and are rewrapped inside.

    ``Trainer(model, ...)`` places a model that exists already (its values go
    through the host once); :meth:`Trainer.create` builds the model's state
    born sharded, by compiled init programs, for models larger than one
    device or host.

    ``donate=True`` (default): each step donates the parameters and optimizer
    state to the compiled step, whose outputs reuse their buffers (one copy of
    the state on the devices, not two). A step that fails before it runs (a
    batch of the wrong shape or layout, a trace or layout error) leaves the
    trainer as it was and can be retried; so does a loss that cannot be read
    (checked on a probe scalar before the state is consumed). Once the step
    has run, the trainer holds its results: if reading the loss fails then
    (unexpectedly), the step stands and is not to be retried. ``donate=False``
    keeps the previous state until the loss is read (all or nothing at every
    point) at the cost of the second copy.

    ``options`` (``sj.CompileOptions``) and ``regather`` (whether gathered
    weights are gathered again for the backward pass): see :class:`TrainStep`.
    """

    def __init__(
        self,
        model,
        optimizer,
        loss_fn,
        placement: Placement,
        *,
        batch_sbp,
        zero=False,
        compute_dtype=None,
        cost_model=None,
        donate: bool = True,
        solve_time_limit=None,
        regather="auto",
        options=None,
    ):
        self._setup(
            model,
            optimizer,
            loss_fn,
            placement,
            batch_sbp,
            _step_options(zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options),
        )
        # typed PRNG keys cannot be global tensors: carry their key data (uint32)
        self._key_impls = jax.tree.map(
            lambda v: jax.random.key_impl(v) if _is_key(v) else None, self._rest_pure
        )
        self._build_step()
        self.params, self.opt_state = self.train_step.init(self._pure)
        rep = (Broadcast(),) * placement.ndim
        self.state = jax.tree.map(
            lambda v: to_global(np.asarray(v), placement, rep), _unwrap_keys(self._rest_pure)
        )
        del self._pure, self._rest_pure

    @classmethod
    def create(
        cls,
        model_factory,
        optimizer,
        loss_fn,
        placement: Placement,
        *,
        batch_sbp,
        zero=False,
        compute_dtype=None,
        cost_model=None,
        donate: bool = True,
        solve_time_limit=None,
        regather="auto",
        options=None,
    ) -> Trainer:
        """A Trainer whose state is born sharded: ``model_factory()`` (no
        arguments, e.g. ``lambda: sjf.annotate(GPT(cfg, nnx.Rngs(0)), RULES)``)
        runs only abstractly (``nnx.eval_shape``, to read the parameters'
        shapes and annotations) and inside one ``jax.jit`` whose outputs are
        laid out as the parameters' stored layouts (ZeRO's included), so each
        device computes only its own blocks of each parameter, as ``nnx.jit``
        with ``out_shardings`` does. The optimizer state is then made from the
        placed parameters by ``jax.jit(optimizer.init)`` with its layouts.
        No split parameter is ever whole on one device or on the host. The
        values equal ``Trainer(model_factory(), ...)``'s (the same RNG keys).
        """
        self = cls.__new__(cls)
        abstract = nnx.eval_shape(model_factory)
        self._setup(
            abstract,
            optimizer,
            loss_fn,
            placement,
            batch_sbp,
            _step_options(zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options),
        )
        impls: dict = {}

        def born():
            model = model_factory()
            _, p, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
            rest_pure = nnx.to_pure_dict(rest)
            impls["tree"] = jax.tree.map(lambda v: jax.random.key_impl(v) if _is_key(v) else None, rest_pure)
            return nnx.to_pure_dict(p), _unwrap_keys(rest_pure)

        jax.eval_shape(born)  # the RNG keys' implementations, which the step rewraps
        self._key_impls = impls["tree"]
        self._build_step()
        tree, _, stored = self.train_step._layouts(self._pure)
        rep = (Broadcast(),) * placement.ndim
        params_g, self.state = init_global(born, placement, (jax.tree_util.tree_unflatten(tree, stored), rep))
        self.params, self.opt_state = self.train_step.init(params_g)
        del self._pure, self._rest_pure
        return self

    def _setup(self, model, optimizer, loss_fn, placement, batch_sbp, step_options: dict):
        """What both constructors share: the graph, the templates and the layouts
        (``model`` may be abstract). ``step_options``: the TrainStep keywords
        the constructors take as they are (zero, compute_dtype, ...)."""
        self.placement = placement
        self.graphdef: nnx.GraphDef
        # flax types split with two or more filters as a variadic tuple; two give exactly three
        self.graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        self._template, self._rest_template = params_state, rest
        self._pure = nnx.to_pure_dict(params_state)
        self._rest_pure = nnx.to_pure_dict(rest)
        self._param_sbp = get_sbp(model, placement)
        self._optimizer, self._loss_fn, self._batch_sbp = optimizer, loss_fn, batch_sbp
        self._step_options = step_options
        self._probe = to_global(np.zeros((), np.float32), placement, (Broadcast(),) * placement.ndim)

    def _build_step(self):
        loss_fn = self._loss_fn
        placement = self.placement
        template, rest_template, graphdef = self._template, self._rest_template, self.graphdef
        impls = self._key_impls

        def model_loss(params, batch_and_state):
            batch, rest_data = batch_and_state
            state = jax.tree.map(lambda v: v, template)
            nnx.replace_by_pure_dict(state, params)
            other = jax.tree.map(lambda v: v, rest_template)
            nnx.replace_by_pure_dict(other, _wrap_keys(rest_data, impls))
            model = nnx.merge(graphdef, state, other)
            loss = loss_fn(model, batch)
            updated = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])
            return loss, _unwrap_keys(updated)

        rep = (Broadcast(),) * placement.ndim
        self.train_step = TrainStep(
            model_loss,
            self._optimizer,
            placement,
            self._param_sbp,
            (self._batch_sbp, rep),
            has_aux=True,
            aux_sbp=rep,
            **self._step_options,
        )

    def step(self, batch) -> float:
        """One training step; returns the loss.

        A step that raises before it runs (a bad batch, a loss that cannot be
        read) leaves the trainer as it was and can be retried. With
        ``donate=False`` that holds at every point: the loss is read before the
        trainer's state changes. With ``donate=True`` (default) the step
        consumes the previous parameters and optimizer state, so the trainer
        adopts the results as soon as the step has run and reads the loss
        after; whether the loss can be read is checked first, on a probe
        scalar of the same placement, so that failure still comes before."""
        if not self.train_step.donate:
            params, opt_state, loss, state = self.train_step(self.params, self.opt_state, (batch, self.state))
            value = float(loss.numpy())
            self.params, self.opt_state, self.state = params, opt_state, state
            return value
        self._probe.numpy()  # a B scalar on this placement reads as the loss will
        params, opt_state, loss, state = self.train_step(self.params, self.opt_state, (batch, self.state))
        self.params, self.opt_state, self.state = params, opt_state, state
        return float(loss.numpy())

    def explain(self, batch):
        return self.train_step.explain(self.params, self.opt_state, (batch, self.state))

    def lower(self, batch):
        """The ``jax.stages.Lowered`` of one step (``.compile()`` it, read ``sj.collectives``)."""
        return self.train_step.lower(self.params, self.opt_state, (batch, self.state))

    def model(self):
        """The trained model with logical values (plain arrays), its state included."""
        logical = lambda tree: jax.tree.map(lambda t: jnp.asarray(t.numpy()), tree, is_leaf=_is_gt)  # noqa: E731
        state = jax.tree.map(lambda v: v, self._template)
        nnx.replace_by_pure_dict(state, logical(self.params))
        other = jax.tree.map(lambda v: v, self._rest_template)
        nnx.replace_by_pure_dict(other, _wrap_keys(logical(self.state), self._key_impls))
        return nnx.merge(self.graphdef, state, other)

    def save(self, path) -> None:
        """Save parameters, optimizer state and model state with orbax (``sbpjax.checkpoint``)."""
        checkpoint.save(path, {"params": self.params, "opt_state": self.opt_state, "state": self.state})

    def restore(self, path) -> None:
        """Load a state saved by any Trainer of the same model and optimizer,
        whatever its placement and layouts, into this Trainer's layouts."""
        saved = checkpoint.restore(
            path, {"params": self.params, "opt_state": self.opt_state, "state": self.state}
        )
        self.params, self.opt_state, self.state = saved["params"], saved["opt_state"], saved["state"]

    def state_bytes_per_device(self) -> dict:
        """Bytes the most loaded device holds: parameters and optimizer state."""
        return {"params": bytes_per_device(self.params), "opt_state": bytes_per_device(self.opt_state)}
