"""Stages and the pipeline: per-stage compiled forward, backward and update,
driven by the actor runtime.

    stages = [sjp.Stage(block, params_i, placement=pl_i, param_sbp=tp_layout) for i ...]
    pipe = sjp.Pipeline(stages, loss_fn, optax.adam(1e-3), microbatches=8, schedule="1f1b")
    result = pipe.step(tokens, labels)      # result.loss, result.grads, result.timeline
    result.timeline.gantt("pipeline.png")

Each stage is ``fn(params, x) -> y`` on its own placement; the last stage's
output goes through ``loss_fn(y, targets) -> scalar``. Per stage, three
programs are compiled with :func:`sbpjax.jit` (so a stage can be tensor
parallel inside, with its own SBP layouts): the forward, the backward
(``jax.vjp`` of the forward, recomputed from the stage input, adding the
parameter gradient into an accumulator), and the optimizer update. The
backward recomputes because the register a forward fills for its backward then
holds only the stage input, the activation-checkpointing OneFlow uses for GPT
(one forward-to-backward edge per stage). Activations and gradients cross
stages by disjoint-placement boxing (``GlobalTensor.to_global(placement=...)``).

The accumulated gradient is the mean over microbatches of each microbatch's
gradient (the backward of the last stage is seeded with ``1 / m``), which is
the gradient of the whole batch's loss when ``loss_fn`` is a mean over
examples and the microbatches are equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sbpjax._errors import SBPError
from sbpjax.compiler.api import is_nd_sbp, jit, state_sbp
from sbpjax.pipeline.lockstep import LockstepSystem
from sbpjax.pipeline.runtime import ThreadedSystem
from sbpjax.pipeline.schedule import StageThreads, as_schedule, build_graph
from sbpjax.pipeline.simulate import Durations, simulate_graph
from sbpjax.pipeline.timeline import Timeline
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Partial, Split, normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, placeholder, to_global


def _is_layout_leaf(v) -> bool:
    return isinstance(v, (str, Split, Broadcast, Partial)) or is_nd_sbp(v)


def _param_layouts(params, param_sbp, placement: Placement, where: str):
    """One nd-SBP per parameter leaf: ``None`` -> all B; one nd-SBP -> every leaf."""
    if param_sbp is None or _is_layout_leaf(param_sbp):
        spec = (Broadcast(),) * placement.ndim if param_sbp is None else param_sbp
        return jax.tree_util.tree_map(
            lambda x: normalize_nd_sbp(spec, placement.ndim, np.ndim(x), where), params
        )
    try:
        return jax.tree_util.tree_map(
            lambda s, x: normalize_nd_sbp(s, placement.ndim, np.ndim(x), where),
            param_sbp,
            params,
            is_leaf=_is_layout_leaf,
        )
    except (ValueError, TypeError) as e:
        if isinstance(e, SBPError):
            raise
        raise SBPError(
            f"{where}: param_sbp does not match the structure of the parameters ({e}); give one "
            "nd-SBP per parameter leaf in the same pytree, or a single nd-SBP for all."
        ) from None


def _is_global(v) -> bool:
    return isinstance(v, GlobalTensor)


def _logical_nbytes(value) -> int:
    return sum(
        int(t.size) * t.dtype.itemsize
        for t in jax.tree_util.tree_leaves(value, is_leaf=_is_global)
        if isinstance(t, (GlobalTensor, jax.Array, np.ndarray))
    )


def _ready(tree):
    """Wait for the values: an action ends when its work is done, so the
    timeline shows real durations and a register never holds pending work."""
    return jax.block_until_ready(tree)


def _move(t: GlobalTensor, sbp: tuple, placement: Placement) -> GlobalTensor:
    """Box ``t`` onto another stage's ``(placement, sbp)`` (disjoint-placement
    boxing; same grid and layout is one ``device_put``, see sbpjax.boxing.transfer)."""
    return _ready(t.to_global(sbp=sbp, placement=placement))


class Stage:
    """One pipeline stage: ``fn(params, x) -> y`` on ``placement``.

    A Flax module is a stage as ``Stage(module.apply, variables, placement)``.
    ``param_sbp``: the parameters' nd-SBPs (a matching pytree, or one nd-SBP for
    all; default B). ``in_sbp`` / ``out_sbp``: nd-SBPs of ``x`` and ``y``
    (default B). Inside, :func:`sbpjax.jit` chooses every other layout.
    """

    def __init__(
        self,
        fn: Callable,
        params,
        placement: Placement,
        *,
        param_sbp=None,
        in_sbp=None,
        out_sbp=None,
        name: str | None = None,
    ):
        self.name = name or getattr(fn, "__name__", "stage")
        if not callable(fn):
            raise SBPError(
                f"Stage {self.name!r}: fn must be a function fn(params, x) -> y, got {type(fn).__name__}."
            )
        if not isinstance(placement, Placement):
            raise SBPError(
                f"Stage {self.name!r}: placement must be an sj.Placement (e.g. "
                f"sj.Placement(np.array(jax.devices()[0:2]), ('tp',))), got {type(placement).__name__}."
            )
        self.fn = fn
        self.placement = placement
        host = jax.tree_util.tree_map(lambda p: np.asarray(p), params)
        self.param_sbp = _param_layouts(host, param_sbp, placement, f"Stage {self.name!r} param_sbp")
        rep = (Broadcast(),) * placement.ndim
        self.in_sbp = (
            rep
            if in_sbp is None
            else normalize_nd_sbp(in_sbp, placement.ndim, None, f"Stage {self.name!r} in_sbp")
        )
        self.out_sbp = (
            rep
            if out_sbp is None
            else normalize_nd_sbp(out_sbp, placement.ndim, None, f"Stage {self.name!r} out_sbp")
        )
        self.params = jax.tree_util.tree_map(lambda p, s: to_global(p, placement, s), host, self.param_sbp)
        self._compiled: dict = {}  # (loss, first?, optimizer, target layout) -> compiled programs

    def __repr__(self):
        return f"Stage({self.name!r}, {self.placement!r})"


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one pipelined training step gives back."""

    loss: float  # mean of the microbatch losses
    microbatch_losses: tuple  # per microbatch, in order
    grads: list  # per stage: the accumulated gradient pytree (global tensors); None for a stage another process runs
    timeline: Timeline


def _compile(stage: Stage, loss_fn: Callable | None, first: bool, optimizer, target_sbp, state_layout):
    """The stage's forward, backward and update as :func:`sbpjax.jit` programs."""
    pl, fn = stage.placement, stage.fn
    ps, xs, ys = stage.param_sbp, stage.in_sbp, stage.out_sbp
    rep = (Broadcast(),) * pl.ndim
    backward: Callable[..., Any]  # (p, x, t, acc, scale) on the last stage, (p, x, dy, acc) before it
    if loss_fn is not None:  # the last stage: its forward ends in the loss

        def forward(p, x, t):
            return loss_fn(fn(p, x), t)

        def backward(p, x, t, acc, scale):
            if first:
                dp = jax.grad(lambda p: loss_fn(fn(p, x), t) * scale)(p)
                return _add(acc, dp)
            dp, dx = jax.grad(lambda p, x: loss_fn(fn(p, x), t) * scale, argnums=(0, 1))(p, x)
            return dx, _add(acc, dp)

        forward_c = jit(forward, placement=pl, in_sbp=(ps, xs, target_sbp), out_sbp=rep)
        backward_c = jit(
            backward, placement=pl, in_sbp=(ps, xs, target_sbp, ps, rep), out_sbp=ps if first else (xs, ps)
        )
    else:

        def backward(p, x, dy, acc):
            if first:  # the first stage's input needs no gradient (it may be integer tokens)
                _, vjp = jax.vjp(lambda p: fn(p, x), p)
                return _add(acc, vjp(dy)[0])
            _, vjp = jax.vjp(fn, p, x)
            dp, dx = vjp(dy)
            return dx, _add(acc, dp)

        forward_c = jit(fn, placement=pl, in_sbp=(ps, xs), out_sbp=ys)
        backward_c = jit(backward, placement=pl, in_sbp=(ps, xs, ys, ps), out_sbp=ps if first else (xs, ps))

    def update(p, s, g):
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    update_c = jit(update, placement=pl, in_sbp=(ps, state_layout, ps), out_sbp=(ps, state_layout))
    return forward_c, backward_c, update_c


class _StagePrograms:
    """One stage's compiled programs (shared by every pipeline built on the same
    stage, loss and optimizer, so they compile once) and this pipeline's state
    for it: optimizer state, gradient accumulator, last step's gradients."""

    def __init__(self, stage: Stage, loss_fn: Callable | None, first: bool, optimizer, target_sbp):
        pl, ps = stage.placement, stage.param_sbp
        host_params = jax.tree_util.tree_map(lambda t: t.numpy(), stage.params, is_leaf=_is_global)
        state = optimizer.init(host_params)
        layout = state_sbp(state, ps, (Broadcast(),) * pl.ndim)
        self.state = jax.tree_util.tree_map(lambda v, s: to_global(np.asarray(v), pl, s), state, layout)
        key = (loss_fn, first, optimizer, target_sbp)
        if key not in stage._compiled:
            stage._compiled[key] = _compile(stage, loss_fn, first, optimizer, target_sbp, layout)
        self.forward, self.backward, self.update = stage._compiled[key]
        self.zeros = jax.tree_util.tree_map(
            lambda t, s: to_global(np.zeros(t.shape, t.dtype), pl, s), stage.params, ps, is_leaf=_is_global
        )
        self.acc = self.zeros
        self.grads = None


def _add(acc, d):
    return jax.tree_util.tree_map(jnp.add, acc, d)


class Pipeline:
    """A model split into stages, trained by the actor runtime.

    ``schedule``: 'gpipe', '1f1b' (default), :class:`Interleaved1F1B` or
    :class:`ActionList`. With ``p`` device groups, stage ``s`` must live on the
    ``s % p``-th distinct placement (interleaved schedules put ``v`` stages on
    each group; the others one). ``data_registers`` / ``activation_registers``:
    slots of the loader / put registers and of the registers between stages;
    ``stash_counts`` overrides the schedule's forward-to-backward slots per
    stage. ``before_action(actor_spec, k)`` is called before every action (for
    tracing, injected delays or faults). A step that cannot finish raises
    :class:`PipelineStall` as soon as no actor can act.

    ``action_timeout``: each action's deadline in seconds, past which the step
    stops every actor and raises :class:`PipelineTimeout` naming the stage,
    microbatch and action. ``"auto"`` (default): ``FIRST_STEP_TIMEOUT_S`` until
    a step has finished (the first one compiles), then the larger of
    ``MIN_TIMEOUT_S`` and ``TIMEOUT_FACTOR`` times the slowest action of the
    same kind in the last finished step. A number: that many seconds for every
    action; ``None``: no deadline. ``check_finite=True`` checks every stage's
    forward output, the loss and, before the update, every gradient, and
    raises naming the stage where a NaN or infinity first appears.

    With ``jax.distributed``, stages may live in different processes: build
    the same pipeline in every process. ``lockstep`` is then True: each
    process runs the actions of the stages with devices in it (``here``) in
    the schedule's order and meets the others in the transfers
    (:mod:`sbpjax.pipeline.lockstep`); ``action_timeout`` is not enforced.
    """

    FIRST_STEP_TIMEOUT_S = 600.0
    MIN_TIMEOUT_S = 30.0
    TIMEOUT_FACTOR = 20.0

    def __init__(
        self,
        stages: Sequence[Stage],
        loss_fn: Callable,
        optimizer: optax.GradientTransformation,
        *,
        microbatches: int,
        schedule="1f1b",
        target_sbp=None,
        data_registers: int = 2,
        activation_registers: int = 2,
        stash_counts: Sequence[int] | None = None,
        before_action: Callable | None = None,
        action_timeout="auto",
        check_finite: bool = False,
    ):
        stages = list(stages)
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise SBPError("Pipeline: stages must be a non-empty list of sbpjax.pipeline.Stage.")
        self.stages = stages
        self.schedule = as_schedule(schedule)
        self.microbatches = microbatches
        self.groups = self._device_groups(stages)
        p = len(self.groups)
        if self.schedule.stages(p) != len(stages):
            raise SBPError(
                f"Pipeline: {len(stages)} stages on {p} device groups, but {self.schedule!r} runs "
                f"{self.schedule.stages(p)} stages on {p} groups; give Interleaved1F1B(chunks=v) "
                f"v stages per group, other schedules one."
            )
        last_pl = stages[-1].placement
        self.target_sbp = (
            (Broadcast(),) * last_pl.ndim
            if target_sbp is None
            else normalize_nd_sbp(target_sbp, last_pl.ndim, None, "Pipeline target_sbp")
        )
        threads = StageThreads(tuple(f"group{self._group_of(s)}" for s in range(len(stages))))
        self.graph = build_graph(
            self.schedule,
            p,
            microbatches,
            threads,
            data_registers=data_registers,
            activation_registers=activation_registers,
            stash_counts=None if stash_counts is None else list(stash_counts),
        )
        n = len(stages)
        # With jax.distributed, each process runs the stages that have devices in
        # it and meets the others in the transfers (sbpjax.pipeline.lockstep).
        self.here = [st.placement.in_this_process for st in stages]
        self.lockstep = len(frozenset().union(*(st.placement.processes for st in stages))) > 1
        self.programs: list[_StagePrograms | None] = [
            _StagePrograms(st, loss_fn if i == n - 1 else None, i == 0, optimizer, self.target_sbp)
            if self.here[i]
            else None
            for i, st in enumerate(stages)
        ]
        self.before_action = before_action
        if not (
            action_timeout is None
            or action_timeout == "auto"
            or (isinstance(action_timeout, (int, float)) and action_timeout > 0)
        ):
            raise SBPError(
                f"Pipeline: action_timeout={action_timeout!r}; give seconds (> 0), 'auto' or None."
            )
        self.action_timeout = action_timeout
        self.check_finite = check_finite
        self._slowest: dict | None = None  # kind -> slowest action (s) of the last finished step

    def _device_groups(self, stages) -> list[Placement]:
        groups: list[Placement] = []
        for s, st in enumerate(stages):
            pl = st.placement
            if pl in groups:
                continue
            for g in groups:
                if not pl.is_disjoint(g):
                    raise SBPError(
                        f"Pipeline: stage {s} ({st.name}) on {pl!r} shares devices with {g!r} but is "
                        "not the same placement; stages run on disjoint device groups (or on exactly "
                        "the same one, for interleaved schedules)."
                    )
            groups.append(pl)
        p = len(groups)
        for s, st in enumerate(stages):
            if st.placement != groups[s % p]:
                raise SBPError(
                    f"Pipeline: stage {s} ({st.name}) is on {st.placement!r} but with {p} device "
                    f"groups stage {s} belongs on group {s % p}, {groups[s % p]!r}."
                )
        return groups

    def _group_of(self, stage: int) -> int:
        return stage % len(self.groups)

    @property
    def params(self) -> list:
        """Per stage: the current parameters (pytrees of global tensors)."""
        return [st.params for st in self.stages]

    # -- one step -----------------------------------------------------------------
    def step(self, inputs, targets) -> StepResult:
        """One training step over the batch: ``inputs`` / ``targets`` are arrays
        whose dim 0 splits into ``microbatches`` equal microbatches, or functions
        ``k -> microbatch k`` (called by the loader actors).

        Raises :class:`PipelineError` (:class:`PipelineStall`,
        :class:`PipelineTimeout`) when an action fails, nothing can act or an
        action passes its deadline; Ctrl-C stops every actor and re-raises
        ``KeyboardInterrupt``. The update is all or none: each stage's new
        parameters and optimizer state are kept aside and become current only
        when every action of the step has succeeded, so after any failure every
        stage has its parameters from before the step."""
        m = self.microbatches
        load_inputs = self._feed("inputs", inputs, m)
        load_targets = self._feed("targets", targets, m)
        losses: list = [None] * m
        pending: list = [None] * len(self.stages)
        bodies = self._bodies(load_inputs, load_targets, losses, pending)
        system: ThreadedSystem | LockstepSystem
        if self.lockstep:
            system = LockstepSystem(self.graph, bodies, before_action=self.before_action)
        else:
            system = ThreadedSystem(
                self.graph,
                bodies,
                nbytes=_logical_nbytes,
                before_action=self.before_action,
                action_timeout=self._deadline(),
            )
        try:
            timeline = system.run()
            values = self._losses(losses)  # read before anything changes
        finally:
            for prog in self.programs:
                if prog is not None:
                    prog.acc = prog.zeros
        for stage, prog, done in zip(self.stages, self.programs, pending):
            if prog is not None:  # a stage of another process keeps its handles
                stage.params, prog.state, prog.grads = done
        self._slowest = {}
        for r in timeline.actions:
            self._slowest[r.kind] = max(self._slowest.get(r.kind, 0.0), r.end - r.start)
        return StepResult(
            float(np.mean(values)),
            tuple(values),
            [None if prog is None else prog.grads for prog in self.programs],
            timeline,
        )

    def _losses(self, losses: list) -> list[float]:
        """The microbatch losses, in every process: read where the last stage
        lives and shared with the others (one small all-gather)."""
        if not self.lockstep:
            return [float(np.asarray(loss.numpy())) for loss in losses]
        from jax.experimental import multihost_utils

        last = self.stages[-1].placement
        mine = (
            np.array([float(np.asarray(loss.numpy())) for loss in losses], np.float64)
            if self.here[-1]
            else np.full(len(losses), np.nan)
        )
        every = np.asarray(multihost_utils.process_allgather(mine))
        owner = min(last.processes)
        return [float(v) for v in every.reshape(-1, len(losses))[owner]]

    def _deadline(self):
        """``spec -> seconds or None`` for the runtime (see ``action_timeout``)."""
        setting = self.action_timeout
        if setting is None:
            return None
        if setting != "auto":
            return lambda spec: float(setting)
        if self._slowest is None:
            return lambda spec: self.FIRST_STEP_TIMEOUT_S
        slowest = dict(self._slowest)
        return lambda spec: max(self.MIN_TIMEOUT_S, self.TIMEOUT_FACTOR * slowest.get(spec.kind, 0.0))

    def simulate(self, durations: Durations | None = None) -> Timeline:
        """The same actor graph on the simulated clock (see :func:`simulate`)."""
        return simulate_graph(self.graph, durations)

    @staticmethod
    def _feed(name: str, data, m: int) -> Callable[[int], Any]:
        if callable(data):
            return data
        shape = np.shape(data)
        if not shape or shape[0] % m:
            rows = shape[0] if shape else "no"
            raise SBPError(
                f"Pipeline.step: {name} has {rows} rows (dim 0 of shape {shape}) which do not split into "
                f"{m} equal microbatches; equal microbatches make the accumulated gradient the whole "
                f"batch's gradient. Use a batch that is a multiple of {m}, or pass a function k -> "
                "microbatch."
            )
        size = shape[0] // m
        return lambda k: np.asarray(data[k * size : (k + 1) * size])

    def _bodies(self, load_inputs, load_targets, losses, pending) -> dict:
        stages, n, m = self.stages, len(self.stages), self.microbatches
        last = n - 1
        scale = np.float32(1.0 / m)
        bodies: dict[str, Callable] = {
            "load:inputs": lambda k, _: {"host:inputs": load_inputs(k)},
            "load:targets": lambda k, _: {"host:targets": load_targets(k)},
            "put:inputs": lambda k, v: {
                "inputs": _ready(to_global(v["host:inputs"], stages[0].placement, stages[0].in_sbp))
            },
            "put:targets": lambda k, v: {
                "targets": _ready(to_global(v["host:targets"], stages[last].placement, self.target_sbp))
            },
        }
        for s in range(n):
            bodies[f"forward{s}"] = self._forward_body(s, losses)
            bodies[f"backward{s}"] = self._backward_body(s, scale)
            bodies[f"update{s}"] = self._update_body(s, pending)
            if s < last:
                nxt = stages[s + 1]
                bodies[f"transfer:act{s}->{s + 1}"] = lambda k, v, s=s, nxt=nxt: {
                    f"in{s + 1}": self._transfer(s, s + 1, v[f"out{s}"], nxt.in_sbp)
                }
            if s > 0:
                prev = stages[s - 1]
                bodies[f"transfer:grad{s}->{s - 1}"] = lambda k, v, s=s, prev=prev: {
                    f"dy{s - 1}": self._transfer(s, s - 1, v[f"dx{s}"], prev.out_sbp)
                }
        return bodies

    def _transfer(self, src: int, dst: int, t: GlobalTensor, sbp: tuple) -> GlobalTensor:
        """Box ``t`` from stage ``src`` onto stage ``dst``. Across processes this
        is a collective of both stages' processes; a process with neither
        stage passes a handle on."""
        pl = self.stages[dst].placement
        if not (self.here[src] or self.here[dst]):
            return placeholder(t.shape, t.dtype, pl, sbp)
        return _move(t, sbp, pl)

    def _input_name(self, s: int) -> str:
        return "inputs" if s == 0 else f"in{s}"

    def _check(self, s: int, what: str, tree) -> None:
        """With ``check_finite``: raise naming stage ``s`` if ``tree`` holds a NaN or infinity."""
        if not self.check_finite:
            return
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_global)[0]
        for path, t in leaves:
            if isinstance(t, GlobalTensor) and jnp.issubdtype(t.dtype, jnp.inexact):
                value = t.numpy()
                bad = int(value.size - np.count_nonzero(np.isfinite(value)))
                if bad:
                    raise FloatingPointError(
                        f"stage {s} ({self.stages[s].name!r}): {bad} non-finite value(s) (NaN or inf) in its {what}"
                        f"{jax.tree_util.keystr(path)}; nothing was updated. Look at this stage's inputs and "
                        "parameters, or lower the learning rate."
                    )

    def _forward_body(self, s: int, losses: list):
        prog, stage, x_name = self.programs[s], self.stages[s], self._input_name(s)
        if prog is None:  # another process runs this stage: pass handles of its results on
            if s == len(self.stages) - 1:
                return lambda k, v: {f"stash{s}": (v[x_name], None)}

            shapes: dict = {}  # (input shape, dtype) -> the output's (traced once)

            def elsewhere(k, v):
                x = v[x_name]
                key = (x.shape, x.dtype)
                if key not in shapes:
                    params = jax.tree_util.tree_map(
                        lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), stage.params, is_leaf=_is_global
                    )
                    shapes[key] = jax.eval_shape(stage.fn, params, jax.ShapeDtypeStruct(x.shape, x.dtype))
                y = shapes[key]
                return {
                    f"out{s}": placeholder(y.shape, y.dtype, stage.placement, stage.out_sbp),
                    f"stash{s}": x,
                }

            return elsewhere
        if s == len(self.stages) - 1:

            def forward_last(k, v):
                x, t = v[x_name], v["targets"]
                losses[k] = _ready(prog.forward(stage.params, x, t))
                self._check(s, "loss", losses[k])
                return {f"stash{s}": (x, t)}

            return forward_last

        def forward(k, v):
            x = v[x_name]
            y = _ready(prog.forward(stage.params, x))
            self._check(s, "forward output", y)
            return {f"out{s}": y, f"stash{s}": x}

        return forward

    def _backward_body(self, s: int, scale):
        prog, stage = self.programs[s], self.stages[s]
        last, first = s == len(self.stages) - 1, s == 0
        if prog is None:  # another process runs this stage

            def elsewhere(k, v):
                x = v[f"stash{s}"][0] if last else v[f"stash{s}"]  # the stage input's handle
                dx = None if first else placeholder(x.shape, x.dtype, stage.placement, stage.in_sbp)
                return {f"dx{s}": dx, f"grads{s}": None}

            return elsewhere

        def backward(k, v):
            if last:
                x, t = v[f"stash{s}"]
                out = prog.backward(stage.params, x, t, prog.acc, scale)
            else:
                out = prog.backward(stage.params, v[f"stash{s}"], v[f"dy{s}"], prog.acc)
            dx, prog.acc = (None, out) if first else out
            _ready(prog.acc)
            if not first:  # the gradient this stage sends back: where a NaN made here shows first
                self._check(s, "input gradient", dx)
            return {f"dx{s}": _ready(dx), f"grads{s}": prog.acc}

        return backward

    def _update_body(self, s: int, pending: list):
        prog, stage = self.programs[s], self.stages[s]
        if prog is None:
            return lambda k, v: {}

        def update(k, v):
            grads = v[f"grads{s}"]
            self._check(s, "gradient", grads)
            params, state = _ready(prog.update(stage.params, prog.state, grads))
            pending[s] = (params, state, grads)  # made current by step() once every stage has succeeded
            return {}

        return update
