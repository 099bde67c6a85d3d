"""Training an NNX model with ``sj.jit``: :class:`Trainer` splits the model
into parameters and the rest of its state, runs a
:class:`~sbpjax.flax.train.TrainStep` on them, and merges them back.

    trainer = sjf.Trainer(model, optax.adamw(1e-3), loss_fn, pl, batch_sbp=(S(0), B))
    loss = trainer.step(batch)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sbpjax import checkpoint
from sbpjax._errors import SBPError
from sbpjax.boxing.cost import checked_cost_model
from sbpjax.compiler.api import checked_budget
from sbpjax.compiler.arguments import broadcast_spec
from sbpjax.compiler.auto import AUTO
from sbpjax.dtypes import canonical_dtype, is_key
from sbpjax.flax.annotate import get_sbp
from sbpjax.flax.checks import batch_layouts, checked_compute_dtype, checked_loss, checked_optimizer
from sbpjax.flax.train import TrainStep, init_global, spread_layout
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, normalize_nd_sbp
from sbpjax.tensor import bytes_per_device, is_global, to_global

_TRAINER_AUX = (
    "Trainer's loss_fn returns the loss alone: compute metrics from the model outside the step, or "
    "use sjf.TrainStep(..., has_aux=True), whose loss_fn returns (loss, aux)."
)


def _unwrap_keys(tree):
    return jax.tree.map(lambda v: jax.random.key_data(v) if is_key(v) else v, tree)


def _wrap_keys(tree, impls):
    return jax.tree.map(
        lambda v, impl: v if impl is None else jax.random.wrap_key_data(v, impl=impl),
        tree,
        impls,
        is_leaf=lambda v: v is None,
    )


def _step_options(
    zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options, memory_budget
) -> dict:
    """The TrainStep keywords both Trainer constructors take and pass on as they are."""
    return dict(
        memory_budget=memory_budget,
        zero=zero,
        compute_dtype=compute_dtype,
        cost_model=cost_model,
        donate=donate,
        solve_time_limit=solve_time_limit,
        regather=regather,
        options=options,
    )


def _traced_factory(model_factory):
    """``model_factory``, with the one mistake JAX's own error leaves unexplained
    when it runs traced: entering ``jax.set_mesh`` inside it."""

    def make():
        try:
            return model_factory()
        except ValueError as e:
            if "`set_mesh` can only be used outside of `jax.jit`" not in str(e):
                raise
            raise SBPError(
                "Trainer.create: model_factory enters jax.set_mesh, which JAX allows only outside "
                "jax.jit, and the factory runs traced (nnx.eval_shape, then one jax.jit) so that no "
                "parameter is ever whole on one device. Enter the mesh and the logical axis rules "
                "around Trainer.create instead: `with jax.set_mesh(pl.mesh), "
                "nnx.logical_axis_rules(rules): Trainer.create(lambda: Model(...), ...)`."
            ) from e

    return make


def _check_param_dtypes(pure: dict, model_name: str) -> None:
    """An SBPError naming the first nnx.Param that is not floating: the step
    differentiates the loss by every Param, and JAX has no gradient of an
    integer or bool array."""
    for path, v in jax.tree_util.tree_flatten_with_path(pure)[0]:
        dtype = jnp.result_type(v)  # a Python number's too (nnx.Param(1.0))
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise SBPError(
                f"Trainer: parameter {jax.tree_util.keystr(path)} of {model_name} is an nnx.Param of dtype "
                f"{dtype}; the step differentiates the loss by every Param, and integers and bools have "
                "no gradient. Keep counters and masks in an nnx.Variable (or a subclass), which the "
                "trainer carries as state."
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
    Values the model records with ``sow`` (``nnx.Intermediate``) are a call's
    outputs, not state: the trainer drops them, from the model it is given
    too (read them inside ``loss_fn``, with ``nnx.pop``, to use them in the
    loss).

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

    ``auto=True``: parameters the model does not annotate get the layouts
    ``sj.jit``'s solver chooses with the rest of the step (annotated ones
    keep theirs), and the optimizer state is chosen with them (it mirrors
    its parameter). ``memory_budget`` (implies ``auto``): the bytes per device
    the step's arguments and results hold together (parameters, optimizer
    state, the batch; a donated one once); the solver picks the cheapest
    layouts that fit, the optimizer state on its own (ZeRO-1's split state
    beside whole parameters, say), or raises an SBPError giving the least any
    layout needs. Such parameters start split over every axis
    (:func:`~sbpjax.flax.train.spread_layout`: no device holds more than its
    share) and are laid out once, at the first step, which holds both
    layouts for a moment; see :class:`TrainStep`.
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
        auto: bool = False,
        memory_budget=None,
    ):
        self._setup(
            model,
            optimizer,
            loss_fn,
            placement,
            batch_sbp,
            auto,
            _step_options(
                zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options, memory_budget
            ),
        )
        # typed PRNG keys cannot be global tensors: carry their key data (uint32)
        self._key_impls = jax.tree.map(
            lambda v: jax.random.key_impl(v) if is_key(v) else None, self._rest_pure
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
        auto: bool = False,
        memory_budget=None,
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
        if isinstance(model_factory, nnx.Module) or not callable(model_factory):
            instead = (
                " (a model: pass it to Trainer(model, ...))" if isinstance(model_factory, nnx.Module) else ""
            )
            raise SBPError(
                f"Trainer.create: model_factory must be a function of no arguments that builds the model "
                f"(e.g. lambda: MyModel(cfg, nnx.Rngs(0))), got {type(model_factory).__name__}{instead}."
            )
        model_factory = _traced_factory(model_factory)
        abstract = nnx.eval_shape(model_factory)
        self._setup(
            abstract,
            optimizer,
            loss_fn,
            placement,
            batch_sbp,
            auto,
            _step_options(
                zero, compute_dtype, cost_model, donate, solve_time_limit, regather, options, memory_budget
            ),
        )
        impls: dict = {}

        def born():
            model = model_factory()
            nnx.pop(model, nnx.Intermediate)
            _, p, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
            rest_pure = nnx.to_pure_dict(rest)
            impls["tree"] = jax.tree.map(lambda v: jax.random.key_impl(v) if is_key(v) else None, rest_pure)
            return nnx.to_pure_dict(p), _unwrap_keys(rest_pure)

        jax.eval_shape(born)  # the RNG keys' implementations, which the step rewraps
        self._key_impls = impls["tree"]
        self._build_step()
        tree, _, stored = self.train_step.layouts(self._pure)
        rep = (Broadcast(),) * placement.ndim
        # born spread over the placement; the first step lays them out as chosen
        stored = [
            spread_layout(v.shape, placement) if nd is AUTO else nd
            for nd, v in zip(stored, jax.tree.leaves(self._pure))
        ]
        params_g, self.state = init_global(born, placement, (jax.tree_util.tree_unflatten(tree, stored), rep))
        self.params, self.opt_state = self.train_step.init(params_g)
        del self._pure, self._rest_pure
        return self

    def _setup(self, model, optimizer, loss_fn, placement, batch_sbp, auto, step_options: dict):
        """What both constructors share: the graph, the templates and the layouts
        (``model`` may be abstract). ``step_options``: the TrainStep keywords
        the constructors take as they are (zero, compute_dtype, ...)."""
        self.placement = checked_placement(placement, "Trainer")
        # TrainStep checks these too; here the message names the Trainer the user built, and
        # comes before the parameters are split and placed
        checked_optimizer(optimizer, "Trainer")
        checked_compute_dtype(step_options["compute_dtype"], "Trainer")
        checked_cost_model(step_options["cost_model"], "Trainer")
        batch_layouts(batch_sbp, self.placement, "Trainer")
        if not isinstance(model, nnx.Module):
            raise SBPError(
                f"Trainer: model must be a Flax NNX Module (an nnx.Module instance; Trainer.create takes a "
                f"function that builds one), got {type(model).__name__}."
            )
        self.graphdef: nnx.GraphDef
        # what sow recorded (dropped from the model given too): a call's output, not state
        nnx.pop(model, nnx.Intermediate)
        # flax types split with two or more filters as a variadic tuple; two give exactly three
        self.graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
        self._template, self._rest_template = params_state, rest
        self._pure = nnx.to_pure_dict(params_state)
        if not jax.tree.leaves(self._pure):
            raise SBPError(
                f"Trainer: the model ({type(model).__name__}) has no nnx.Param to train; its weights must be "
                "nnx.Param variables (as nnx.Linear's are)."
            )
        _check_param_dtypes(self._pure, type(model).__name__)
        self._rest_pure = nnx.to_pure_dict(rest)
        if not isinstance(auto, (bool, np.bool_)):
            raise SBPError(
                f"Trainer: auto must be True (parameters with no annotation get the layouts sj.jit's "
                f"solver chooses) or False (they are B), got {auto!r}."
            )
        checked_budget(step_options["memory_budget"], "Trainer")  # before anything is placed
        chosen = auto or step_options["memory_budget"] is not None
        self._param_sbp = get_sbp(model, placement, unannotated=AUTO if chosen else None)
        self._optimizer, self._loss_fn, self._batch_sbp = optimizer, loss_fn, batch_sbp
        self._step_options = step_options
        self._probe = to_global(np.zeros((), np.float32), placement, (Broadcast(),) * placement.ndim)
        self._as_chosen = False  # the state is laid out as the step takes it (``_lay_out_as_chosen``)

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
            loss = checked_loss(_loss_on(loss_fn, model, batch), loss_fn, False, aux_hint=_TRAINER_AUX)
            # values the model sowed (nnx.Intermediate) are dropped: the state a step hands the
            # next keeps its structure (sow adds a variable, then appends to it, call by call)
            nnx.pop(model, nnx.Intermediate)
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
        self._check_batch(batch)
        if not self.train_step.donate:
            params, opt_state, loss, state = self.train_step(self.params, self.opt_state, (batch, self.state))
            value = float(loss.numpy())
            self.params, self.opt_state, self.state = params, opt_state, state
            return value
        self._probe.numpy()  # a B scalar on this placement reads as the loss will
        if not self._as_chosen:
            self._lay_out_as_chosen(batch)
        params, opt_state, loss, state = self.train_step(self.params, self.opt_state, (batch, self.state))
        self._as_chosen = True
        self.params, self.opt_state, self.state = params, opt_state, state
        return float(loss.numpy())

    def _lay_out_as_chosen(self, batch) -> None:
        """Before the first donating step: the parameters and optimizer state
        leave the layouts they were born in (spread, where the solver chooses)
        for the ones the step takes, one leaf at a time, each old copy freed
        as soon as its new one exists. Left to the step, every leaf would be
        re-laid out before it runs while the trainer still held the old ones:
        the state twice over at the first step, the step a model sized to
        its memory fails on. The trainer holds its state whole at every
        point: were a re-layout to fail, the leaves moved so far are held in
        their new layouts and the rest in their old ones."""
        chosen = self.train_step.explain(self.params, self.opt_state, (batch, self.state)).propagation.in_sbp
        held, tree = jax.tree_util.tree_flatten((self.params, self.opt_state), is_leaf=is_global)
        users: dict = {}
        for t in held:  # a buffer two leaves share is freed by neither
            users[id(t.physical)] = users.get(id(t.physical), 0) + 1
        try:
            for k, (t, nd) in enumerate(zip(held, chosen)):
                if nd == t.sbp:
                    continue
                moved = t.to_global(sbp=nd)
                if moved.physical is not t.physical and users[id(t.physical)] == 1:
                    t.physical.delete()
                held[k] = moved
        finally:
            self.params, self.opt_state = jax.tree_util.tree_unflatten(tree, held)

    def _check_batch(self, batch) -> None:
        """``batch`` checked where the message can name the leaf (the step's
        own checks name its internal argument, ``args[2][0]``): each leaf an
        array of numbers or bools, its layout in ``batch_sbp`` one it has."""
        leaves, tree = jax.tree_util.tree_flatten_with_path(batch)
        for path, leaf in leaves:
            if is_key(leaf):
                continue
            dtype = getattr(leaf, "dtype", None)  # a device array's own: no copy to the host to read it
            dtype = np.asarray(leaf).dtype if dtype is None else dtype
            try:
                canonical_dtype(dtype)  # the project's reading of which dtypes a JAX array holds
            except SBPError:
                raise SBPError(
                    f"Trainer: batch{jax.tree_util.keystr(path)} is a {type(leaf).__name__} of dtype {dtype}; "
                    "a batch holds arrays of numbers or bools. Encode text as token ids (and other data as "
                    "arrays) before the step."
                ) from None
        specs = broadcast_spec(self._batch_sbp, tree, "Trainer batch_sbp", self.placement.ndim)
        for (path, leaf), spec in zip(leaves, specs):
            if spec is not None and spec is not AUTO:  # (an AUTO leaf the step lays out)
                where = f"Trainer batch_sbp for batch{jax.tree_util.keystr(path)} {tuple(np.shape(leaf))}"
                normalize_nd_sbp(spec, self.placement.ndim, np.ndim(leaf), where)

    def explain(self, batch):
        self._check_batch(batch)
        return self.train_step.explain(self.params, self.opt_state, (batch, self.state))

    def lower(self, batch):
        """The ``jax.stages.Lowered`` of one step (``.compile()`` it, read ``sj.collectives``)."""
        self._check_batch(batch)
        return self.train_step.lower(self.params, self.opt_state, (batch, self.state))

    def model(self):
        """The trained model with logical values (plain arrays), its state included."""
        logical = lambda tree: jax.tree.map(lambda t: jnp.asarray(t.numpy()), tree, is_leaf=is_global)  # noqa: E731
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
        self._as_chosen = False

    def state_bytes_per_device(self) -> dict:
        """Bytes the most loaded device holds: parameters and optimizer state."""
        return {"params": bytes_per_device(self.params), "opt_state": bytes_per_device(self.opt_state)}


def _loss_on(loss_fn, model, batch):
    """``loss_fn(model, batch)``; an error it raises while tracing (a batch of
    the wrong shape or structure, most often) as an SBPError naming the
    batch's shapes, its cause kept, as ``Pipeline.step`` reports it."""
    try:
        return loss_fn(model, batch)
    except (SBPError, jax.errors.JAXTypeError):
        raise  # sbpjax's own, and JAX's tracing errors (a Python `if` on a traced value): not the batch
    except (TypeError, ValueError, IndexError, KeyError) as e:
        shapes = jax.tree.map(lambda v: tuple(np.shape(v)), batch)
        name = getattr(loss_fn, "__name__", repr(loss_fn))
        raise SBPError(
            f"Trainer: loss_fn {name!r} raised {type(e).__name__} on a batch of shapes {shapes}: {e}. "
            "Where it is about the batch, check its shapes and structure against what the model and "
            "loss_fn expect; otherwise it is the model's own (a Dropout given no rngs, say)."
        ) from e


__all__ = ["Trainer", "bytes_per_device"]
