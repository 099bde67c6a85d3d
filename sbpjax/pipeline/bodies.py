"""What each actor of a pipeline step does: the bodies the runtime calls.

Registers carry, per microbatch:

* ``stash{s}`` (forward to backward): ``(inputs, saved)``, the stage input
  (and the targets, on the last stage) and the VJP residuals the forward kept;
* ``kept{s}`` (B to W, split backwards only): ``(inputs, saved for W,
  output cotangent, kept)``, what W reads: the residuals it needs, handed on
  from the stash, and the values B computed for it. The register's bytes are
  what the timeline reports as kept for W;
* ``grads{s}``: the stage's accumulated gradient, once per step.

A stage another process runs (``jax.distributed``) gets bodies that pass
handles on (global tensors with no shards here), so this process still meets
the others in the transfers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.pipeline.feeds import placed
from sbpjax.placement import Placement
from sbpjax.tensor import GlobalTensor, is_global, placeholder


def ready(tree):
    """Wait for the values: an action ends when its work is done, so the
    timeline shows real durations and a register never holds pending work."""
    return jax.block_until_ready(tree)


class StepBodies:
    """The bodies of one step of ``pipe``: ``bodies()[actor name](k, inputs) -> outputs``."""

    def __init__(self, pipe, load_inputs: Callable, load_targets: Callable, losses: list, pending: list):
        self.pipe = pipe
        self.load_inputs, self.load_targets = load_inputs, load_targets
        self.losses, self.pending = losses, pending
        self.last = len(pipe.stages) - 1
        self.scale = np.float32(1.0 / pipe.microbatches)
        # each stage's gradient accumulator, this step's own: an action of a failed
        # step still running (past its deadline: a thread cannot be stopped) adds
        # into the failed step's accumulators, never into a later step's
        self.acc = [None if prog is None else prog.zeros for prog in pipe.programs]

    def bodies(self) -> dict[str, Callable]:
        pipe, stages, last = self.pipe, self.pipe.stages, self.last
        bodies: dict[str, Callable] = {
            "load:inputs": lambda k, _: {"host:inputs": self.load_inputs(k)},
            "load:targets": lambda k, _: {"host:targets": self.load_targets(k)},
            "put:inputs": lambda k, v: {
                "inputs": ready(placed(v["host:inputs"], stages[0].placement, stages[0].in_sbp))
            },
            "put:targets": lambda k, v: {
                "targets": ready(placed(v["host:targets"], stages[last].placement, pipe.target_sbp))
            },
        }
        for s in range(len(stages)):
            bodies[f"forward{s}"] = self.forward(s)
            if pipe.schedule.split_backward:
                bodies[f"backward_input{s}"] = self.backward_input(s)
                bodies[f"backward_weight{s}"] = self.backward_weight(s)
            else:
                bodies[f"backward{s}"] = self.backward(s)
            bodies[f"update{s}"] = self.update(s)
            if s < last:
                bodies[f"transfer:act{s}->{s + 1}"] = lambda k, v, s=s: {
                    f"in{s + 1}": self.transfer(s, s + 1, v[f"out{s}"], stages[s + 1].in_sbp)
                }
            if s > 0:
                bodies[f"transfer:grad{s}->{s - 1}"] = lambda k, v, s=s: {
                    f"dy{s - 1}": self.transfer(s, s - 1, v[f"dx{s}"], stages[s - 1].out_sbp)
                }
        return bodies

    def transfer(self, src: int, dst: int, t: GlobalTensor, sbp: tuple) -> GlobalTensor:
        """Box ``t`` from stage ``src`` onto stage ``dst`` (disjoint-placement
        boxing). Across processes this is a collective of both stages'
        processes; a process with neither stage passes a handle on."""
        pl: Placement = self.pipe.stages[dst].placement
        if not (self.pipe.here[src] or self.pipe.here[dst]):
            return placeholder(t.shape, t.dtype, pl, sbp)
        return ready(t.to_global(sbp=sbp, placement=pl))

    def check(self, s: int, what: str, tree) -> None:
        """With ``check_finite``: raise naming stage ``s`` if ``tree`` holds a NaN or infinity."""
        if not self.pipe.check_finite:
            return
        leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_global)[0]
        for path, t in leaves:
            if isinstance(t, GlobalTensor) and jnp.issubdtype(t.dtype, jnp.inexact):
                value = t.numpy()
                bad = int(value.size - np.count_nonzero(np.isfinite(value)))
                if bad:
                    raise FloatingPointError(
                        f"stage {s} ({self.pipe.stages[s].name!r}): {bad} non-finite value(s) (NaN or inf) in "
                        f"its {what}{jax.tree_util.keystr(path)}; nothing was updated. Look at this stage's "
                        "inputs and parameters, or lower the learning rate."
                    )

    def _inputs(self, s: int, v: dict) -> tuple:
        x = v["inputs" if s == 0 else f"in{s}"]
        return (x, v["targets"]) if s == self.last else (x,)

    def _cotangent(self, s: int, v: dict):
        return self.scale if s == self.last else v[f"dy{s}"]

    # -- forward ------------------------------------------------------------------
    def forward(self, s: int):
        prog, stage = self.pipe.programs[s], self.pipe.stages[s]
        if prog is None:
            return self._forward_elsewhere(s)

        def forward(k, v):
            inputs = self._inputs(s, v)
            out, saved = ready(prog.forward(stage.params, *inputs))
            if s == self.last:
                self.losses[k] = out
                self.check(s, "loss", out)
                return {f"stash{s}": (inputs, saved)}
            if not isinstance(out, GlobalTensor):
                raise SBPError(
                    f"stage {s} ({stage.name!r}) returns a {type(out).__name__}, not one array: a stage passes "
                    "one array to the next (the transfer boxes it into the next stage's placement). Pack "
                    "several values into one array (jnp.concatenate / jnp.stack), or keep them in one stage."
                )
            self.check(s, "forward output", out)
            return {f"out{s}": out, f"stash{s}": (inputs, saved)}

        return forward

    def _forward_elsewhere(self, s: int):
        """Another process runs stage ``s``: pass handles of its results on."""
        stage = self.pipe.stages[s]
        if s == self.last:
            return lambda k, v: {f"stash{s}": (self._inputs(s, v), None)}
        shapes: dict = {}  # (input shape, dtype) -> the output's (traced once)

        def elsewhere(k, v):
            x = self._inputs(s, v)[0]
            key = (x.shape, x.dtype)
            if key not in shapes:
                params = jax.tree_util.tree_map(
                    lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), stage.params, is_leaf=is_global
                )
                shapes[key] = jax.eval_shape(stage.fn, params, jax.ShapeDtypeStruct(x.shape, x.dtype))
            y = shapes[key]
            out = placeholder(y.shape, y.dtype, stage.placement, stage.out_sbp)
            return {f"out{s}": out, f"stash{s}": ((x,), None)}

        return elsewhere

    def _dx_handle(self, s: int, inputs) -> Any:
        stage = self.pipe.stages[s]
        x = inputs[0]
        return None if s == 0 else placeholder(x.shape, x.dtype, stage.placement, stage.in_sbp)

    # -- backward: whole, or B and W ----------------------------------------------
    def backward(self, s: int):
        """The whole backward (B then W in one program)."""
        prog, stage = self.pipe.programs[s], self.pipe.stages[s]
        if prog is None:
            return lambda k, v: {f"dx{s}": self._dx_handle(s, v[f"stash{s}"][0]), f"grads{s}": None}

        def backward(k, v):
            inputs, saved = v[f"stash{s}"]
            out = prog.backward(stage.params, *inputs, saved, self._cotangent(s, v), self.acc[s])
            dx, self.acc[s] = ready((None, out) if s == 0 else out)
            if s > 0:  # the gradient this stage sends back: where a NaN made here shows first
                self.check(s, "input gradient", dx)
            return {f"dx{s}": dx, f"grads{s}": self.acc[s]}

        return backward

    def backward_input(self, s: int):
        """B: the input cotangent, and what W will need. The first stage has no
        input cotangent, and nothing waits for its backward: its B runs the whole
        backward (the residuals are freed at once, nothing is kept) and its W
        only hands the gradient on."""
        prog, stage = self.pipe.programs[s], self.pipe.stages[s]
        if prog is None:
            return lambda k, v: {f"dx{s}": self._dx_handle(s, v[f"stash{s}"][0]), f"kept{s}": None}

        def backward_input(k, v):
            inputs, saved = v[f"stash{s}"]
            ct = self._cotangent(s, v)
            if s == 0:
                self.acc[s] = ready(prog.backward(stage.params, *inputs, saved, ct, self.acc[s]))
                return {f"dx{s}": None, f"kept{s}": ()}
            split = prog.vjp.split(stage.params, inputs[0], inputs[1:])
            saved_b = tuple(saved[i] for i in split.saved_for_input)
            saved_w = tuple(saved[i] for i in split.saved_for_weight)
            dx, kept = ready(prog.backward_input(stage.params, *inputs, saved_b, ct))
            self.check(s, "input gradient", dx)
            return {f"dx{s}": dx, f"kept{s}": (inputs, saved_w, ct, kept)}

        return backward_input

    def backward_weight(self, s: int):
        """W: the parameter cotangent, added into the stage's accumulator."""
        prog, stage = self.pipe.programs[s], self.pipe.stages[s]
        if prog is None:
            return lambda k, v: {f"grads{s}": None}

        def backward_weight(k, v):
            if s > 0:
                inputs, saved_w, ct, kept = v[f"kept{s}"]
                self.acc[s] = ready(
                    prog.backward_weight(stage.params, *inputs, saved_w, ct, kept, self.acc[s])
                )
            self.check(s, "weight gradient (accumulated)", self.acc[s])
            return {f"grads{s}": self.acc[s]}

        return backward_weight

    # -- update -------------------------------------------------------------------
    def update(self, s: int):
        prog, stage = self.pipe.programs[s], self.pipe.stages[s]
        if prog is None:
            return lambda k, v: {}

        def update(k, v):
            grads = v[f"grads{s}"]
            self.check(s, "gradient", grads)
            params, state = ready(prog.update(stage.params, prog.state, grads))
            self.pending[s] = (params, state, grads)  # made current by step() once every stage has succeeded
            return {}

        return update
