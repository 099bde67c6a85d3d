"""The pipeline: per-stage compiled forward, backward and update, driven by
the actor runtime.

    stages = [sjp.Stage(block, params_i, placement=pl_i, param_sbp=tp_layout) for i ...]
    pipe = sjp.Pipeline(stages, loss_fn, optax.adam(1e-3), microbatches=8, schedule="1f1b")
    result = pipe.step(tokens, labels)      # result.loss, result.grads, result.timeline
    result.timeline.gantt("pipeline.png")

Each stage is ``fn(params, x) -> y`` on its own placement; the last stage's
output goes through ``loss_fn(y, targets) -> scalar``. Per stage, the programs
of :mod:`sbpjax.pipeline.programs` are compiled with :func:`sbpjax.jit` (so a
stage can be tensor parallel inside, with its own SBP layouts): the forward,
which keeps the residuals of the stage's VJP, the backward (whole, or split
into B for the input cotangent and W for the weight cotangent, from that one
VJP: :mod:`sbpjax.pipeline.split`), and the optimizer update. Nothing of the
forward is recomputed beyond the user's own ``jax.checkpoint``. Activations
and gradients cross stages by disjoint-placement boxing
(``GlobalTensor.to_global(placement=...)``).

The accumulated gradient is the mean over microbatches of each microbatch's
gradient (the backward of the last stage is seeded with ``1 / m``), which is
the gradient of the whole batch's loss when ``loss_fn`` is a mean over
examples and the microbatches are equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import optax

from sbpjax import checkpoint
from sbpjax._errors import SBPError, is_positive_amount
from sbpjax.pipeline.bodies import StepBodies
from sbpjax.pipeline.budget import check_budget
from sbpjax.pipeline.costs import program_costs
from sbpjax.pipeline.feeds import feed, microbatch_shapes, on_host, rows
from sbpjax.pipeline.graph import StageThreads, build_graph
from sbpjax.pipeline.lockstep import LockstepSystem, check_same_step_in_every_process
from sbpjax.pipeline.optimizer_scope import check_stagewise
from sbpjax.pipeline.programs import StagePrograms
from sbpjax.pipeline.registry import as_schedule
from sbpjax.pipeline.runtime import ThreadedSystem
from sbpjax.pipeline.simulate import Durations, simulate_graph
from sbpjax.pipeline.stage import Stage
from sbpjax.pipeline.timeline import Timeline
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, normalize_nd_sbp
from sbpjax.tensor import bytes_per_device


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one pipelined training step gives back."""

    loss: float  # mean of the microbatch losses
    microbatch_losses: tuple  # per microbatch, in order
    grads: list  # per stage: the accumulated gradient pytree (global tensors); None for a stage another process runs
    timeline: Timeline


class Pipeline:
    """A model split into stages, trained by the actor runtime.

    ``schedule``: a name in :data:`~sbpjax.pipeline.SCHEDULES` ('gpipe',
    '1f1b' (default), 'interleaved', 'zb-h1', 'zb-h2', 'zb-v', 'dualpipev') or
    a :class:`Schedule` (:class:`Interleaved1F1B`, :class:`ActionList`, ...).
    With ``p`` device groups (distinct placements, in the order stages first
    use them), stage ``s`` must live on the schedule's group for it: group
    ``s % p`` for the round-robin schedules (interleaved ones put ``v`` stages
    on each group, the others one), and for the V schedules (zb-v, dualpipev)
    stages ``d`` and ``2p - 1 - d`` on group ``d``.

    The stages hold the parameters: a step updates each stage's ``params``
    in place, so two pipelines built from the same :class:`Stage` objects
    train one set of parameters (build each from its own stages, e.g. cut
    again, to train two).

    ``data_registers`` / ``activation_registers``: slots of the loader / put
    registers and of the registers between stages; ``stash_counts`` overrides
    the schedule's forward-to-backward slots per stage and ``kept_counts`` its
    B-to-W slots (split schedules; the first stage's B keeps nothing, so its
    entry bounds nothing): an action list that would need more is
    refused before it runs. ``memory_budget``: bytes each device may hold
    in residuals and kept values, counted as logical bytes from the stages'
    shapes at the first step (a bound on what one device holds: a split value
    holds less), so the timeline's per-device peaks stay at or under it; an
    action list or register counts that would exceed it are refused, naming
    the action. ``before_action(actor_spec, k)``
    is called before every action (for tracing, injected delays or faults). A
    step that cannot finish raises :class:`PipelineStall` as soon as no actor
    can act.

    ``action_timeout``: each action's deadline in seconds, past which the step
    stops every actor and raises :class:`PipelineTimeout` naming the stage,
    microbatch and action. ``"auto"`` (default): ``FIRST_STEP_TIMEOUT_S`` until
    a step has finished (the first one compiles), then the larger of
    ``MIN_TIMEOUT_S`` and ``TIMEOUT_FACTOR`` times the slowest action of the
    same kind (forward, backward, B, W, ...) in the last finished step. A
    number: that many seconds for every action; ``None``: no deadline.
    ``check_finite=True`` checks every stage's forward output, the loss, input
    gradients, each W's accumulated gradient and, before the update, every
    gradient, and raises naming the stage where a NaN or infinity first appears.

    The optimizer runs on each stage's own parameters. One that computes a
    statistic of the whole model first (``optax.clip_by_global_norm``,
    ``optax.apply_if_finite``) would see each stage's alone, so it is refused
    with an SBPError (:mod:`sbpjax.pipeline.optimizer_scope`);
    ``stagewise_optimizer=True`` accepts it with per-stage statistics.

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
        kept_counts: Sequence[int] | None = None,
        memory_budget: float | None = None,
        before_action: Callable | None = None,
        action_timeout="auto",
        check_finite: bool = False,
        stagewise_optimizer: bool = False,
    ):
        stages = list(stages)
        if not stages or not all(isinstance(s, Stage) for s in stages):
            raise SBPError("Pipeline: stages must be a non-empty list of sbpjax.pipeline.Stage.")
        seen: dict = {}
        for i, st in enumerate(stages):
            if id(st) in seen:
                raise SBPError(
                    f"Pipeline: stages {seen[id(st)]} and {i} are the same Stage object ({st.name!r}); each "
                    "stage holds its own parameters and optimizer state, so a stage used twice would keep "
                    "one use's gradient. Build a Stage per position; weights shared between stages (an "
                    "embedding tied to the head) are not supported."
                )
            seen[id(st)] = i
        if not callable(loss_fn):
            raise SBPError(
                f"Pipeline: loss_fn={loss_fn!r} is not a function; give loss_fn(outputs, targets) -> "
                "scalar, e.g. lambda y, t: jnp.mean((y - t) ** 2)."
            )
        if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
            raise SBPError(
                f"Pipeline: optimizer={optimizer!r} is not an optax GradientTransformation (init and update); "
                "give one, e.g. optax.adam(1e-3)."
            )
        if not stagewise_optimizer:
            check_stagewise(optimizer, [st.params for st in stages], [st.name for st in stages])
        self.stages = stages
        self.schedule = as_schedule(schedule)
        self.microbatches = microbatches
        self.groups = self._device_groups(stages)
        p = len(self.groups)
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
            kept_counts=None if kept_counts is None else list(kept_counts),
        )
        if memory_budget is not None and not is_positive_amount(memory_budget):
            raise SBPError(f"Pipeline: memory_budget={memory_budget!r}; give bytes (finite, > 0) or None.")
        self.memory_budget = memory_budget
        self._budget_checked: set = set()  # microbatch shapes already checked against the budget
        n = len(stages)
        # With jax.distributed, each process runs the stages that have devices in
        # it and meets the others in the transfers (sbpjax.pipeline.lockstep).
        self.here = [st.placement.in_this_process for st in stages]
        self._processes = frozenset().union(*(st.placement.processes for st in stages))
        self.lockstep = len(self._processes) > 1
        self.programs: list[StagePrograms | None] = [
            StagePrograms(st, loss_fn if i == n - 1 else None, i == 0, optimizer, self.target_sbp, index=i)
            if self.here[i]
            else None
            for i, st in enumerate(stages)
        ]
        self.before_action = before_action
        if not (
            action_timeout is None
            or action_timeout == "auto"
            or (
                isinstance(action_timeout, (int, float, np.integer, np.floating))
                and not isinstance(action_timeout, bool)
                and action_timeout > 0
            )
        ):
            raise SBPError(
                f"Pipeline: action_timeout={action_timeout!r}; give seconds (> 0), 'auto' or None."
            )
        self.action_timeout = action_timeout
        self.check_finite = check_finite
        self._slowest: dict | None = None  # kind -> slowest action (s) of the last finished step
        self._compiled_for: set = set()  # microbatch shapes a finished step ran (see _deadline)

    def _device_groups(self, stages) -> list[Placement]:
        """Distinct placements in the order stages first use them; each stage on
        the group the schedule gives it."""
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
                        "the same one, for schedules with several stages per group)."
                    )
            groups.append(pl)
        p = len(groups)
        want = self.schedule.stages(p)
        if want != len(stages):
            shared = (
                f" (stages {', '.join(str(s) for s, st in enumerate(stages) if st.placement == groups[0])} "
                f"share the placement {groups[0]!r}: each group is one placement)"
                if p < len(stages) and sum(st.placement == groups[0] for st in stages) > 1
                else ""
            )
            raise SBPError(
                f"Pipeline: {len(stages)} stages on {p} device groups{shared}, but {self.schedule!r} runs "
                f"{want} stages on {p} groups; give Interleaved1F1B(chunks=v) v stages per group, "
                "zb-v and dualpipev two, other schedules one"
                + ("; or put each stage on its own placement." if shared else ".")
            )
        for s, st in enumerate(stages):
            d = self.schedule.device_of(s, p)
            if not 0 <= d < p:
                raise SBPError(
                    f"Pipeline: {self.schedule!r} runs stage {s} on device group {d}, but the stages use "
                    f"{p} groups (0..{p - 1}); give stage_devices within them."
                )
            if st.placement != groups[d]:
                raise SBPError(
                    f"Pipeline: stage {s} ({st.name}) is on {st.placement!r} but {self.schedule!r} on "
                    f"{p} device groups runs stage {s} on group {d}, {groups[d]!r} (groups are numbered "
                    "in the order the stages first use them)."
                )
        return groups

    def _group_of(self, stage: int) -> int:
        return self.schedule.device_of(stage, len(self.groups))

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
        shapes, refused = None, None
        try:
            load_inputs, load_targets, shapes = self._feeds(inputs, targets)
        except SBPError as e:
            if not self.lockstep:
                raise
            refused = e  # raised after the other processes hear of it: none waits for this one
        if self.lockstep:
            check_same_step_in_every_process(self, self._processes, shapes, refused)
        losses: list = [None] * m
        pending: list = [None] * len(self.stages)
        bodies = StepBodies(self, load_inputs, load_targets, losses, pending).bodies()
        system: ThreadedSystem | LockstepSystem
        if self.lockstep:
            system = LockstepSystem(self.graph, bodies, before_action=self.before_action)
        else:
            system = ThreadedSystem(
                self.graph,
                bodies,
                nbytes=bytes_per_device,
                before_action=self.before_action,
                action_timeout=self._deadline(shapes),
            )
        timeline = system.run()
        values = self._losses(losses)  # read before anything changes
        for stage, prog, done in zip(self.stages, self.programs, pending):
            if prog is not None:  # a stage of another process keeps its handles
                stage.params, prog.state, prog.grads = done
        self._slowest = {}
        self._compiled_for.add(shapes)
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

    def _deadline(self, shapes):
        """``spec -> seconds or None`` for the runtime (see ``action_timeout``).
        A step on microbatch shapes no finished step ran compiles its programs
        again, so it gets the first step's deadline (``shapes``: None for data
        given by functions, whose shapes are known only when they are called)."""
        setting = self.action_timeout
        if setting is None:
            return None
        if setting != "auto":
            return lambda spec: float(setting)
        if self._slowest is None or (shapes is not None and shapes not in self._compiled_for):
            return lambda spec: self.FIRST_STEP_TIMEOUT_S
        slowest = dict(self._slowest)
        return lambda spec: max(self.MIN_TIMEOUT_S, self.TIMEOUT_FACTOR * slowest.get(spec.kind, 0.0))

    def save(self, path) -> None:
        """Write every stage's parameters and optimizer state to the new folder
        ``path`` (:mod:`sbpjax.checkpoint`: logical arrays, restorable into any
        placement and layout). Between steps nothing else is live: the gradient
        accumulators are zero and no B has kept anything for a W."""
        checkpoint.save(path, self._state_tree())

    def _feeds(self, inputs, targets):
        """The step's loaders and one microbatch's shapes, the batch checked
        (rows, and the memory budget where one is given)."""
        m = self.microbatches
        inputs, targets = on_host(inputs), on_host(targets)
        load_inputs = feed("inputs", inputs, m)
        load_targets = feed("targets", targets, m)
        shapes = microbatch_shapes((inputs, targets), m)
        if None not in (rows(inputs), rows(targets)) and rows(inputs) != rows(targets):
            raise SBPError(
                f"Pipeline.step: inputs have {rows(inputs)} rows but targets {rows(targets)}; "
                "microbatch k of each is rows k*size..(k+1)*size, so they must have the same number of rows."
            )
        if self.memory_budget is not None:
            check_budget(self, load_inputs, load_targets)
        return load_inputs, load_targets, shapes

    def restore(self, path) -> None:
        """Load what :meth:`save` wrote (by a pipeline of the same stages and
        optimizer, whatever its schedule and layouts) into this pipeline's layouts.

        A checkpoint of other stages (another cut of the model, as a schedule
        of two stages per device group needs, or other dtypes) is refused
        with an :class:`SBPError` that says so, and nothing changes."""
        try:
            saved = checkpoint.restore(path, self._state_tree())
        except checkpoint.CheckpointError:
            raise  # missing, incomplete or corrupted: its own message says which file
        except SBPError as e:
            raise SBPError(
                f"Pipeline.restore: the checkpoint at {path} was saved by a pipeline of other stages than "
                f"this one's {len(self.stages)} (another cut of the model, other parameter shapes or "
                "dtypes, or another optimizer); checkpoint.restore found: "
                f"{str(e).rstrip('.')}. A pipeline restores what a pipeline of the same stages saved, under "
                "any schedule and layouts. A schedule that runs another number of stages per device group "
                "(zb-v and dualpipev run two, interleaved its chunks) cuts the model differently: restore "
                "into a pipeline cut as the saved one was, then cut again from its stages' parameters (the "
                "optimizer's state starts anew)."
            ) from None
        for stage, prog, params, state in zip(
            self.stages, self.programs, saved["params"], saved["opt_state"]
        ):
            stage.params = params
            prog.state = state  # type: ignore[union-attr]

    def _state_tree(self) -> dict:
        if any(prog is None for prog in self.programs):
            raise SBPError(
                "Pipeline.save / restore: some stages run in other processes; save each process's "
                "stages with sbpjax.checkpoint (stage.params and pipe.programs[s].state)."
            )
        return {
            "params": [st.params for st in self.stages],
            "opt_state": [prog.state for prog in self.programs],  # type: ignore[union-attr]
        }

    def program_costs(self, inputs, targets) -> list[dict]:
        """Per stage, XLA's FLOPs, bytes accessed and compiled memory of each
        program (forward, backward, backward_input, backward_weight; the first
        stage has no backward_weight, its B runs the whole backward) for one
        microbatch of ``inputs`` / ``targets`` (see :mod:`sbpjax.pipeline.costs`)."""
        return program_costs(self, inputs, targets)

    def simulate(self, durations: Durations | None = None) -> Timeline:
        """The same actor graph on the simulated clock (see :func:`simulate`)."""
        return simulate_graph(self.graph, durations)
