"""What each stage program costs, by XLA's own analysis of the compiled program.

:func:`program_costs` runs one microbatch through every stage's programs
(forward, whole backward, B, W) and reads, for each, the compiled program's
``cost_analysis()`` (FLOPs, bytes accessed) and ``memory_analysis()``
(arguments + outputs + temporaries - aliased, per device). A step's work is
then ``m`` times the programs its schedule runs: F and the whole backward
(GPipe, 1F1B, interleaved) or F, B and W (zero-bubble schedules), so the two
can be compared program by program: B and W partition the whole backward's
equations, and F is the same program under every schedule.
"""

from __future__ import annotations

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.pipeline.bodies import ready
from sbpjax.pipeline.feeds import feed, on_host, placed


def _analysis(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    cost = cost or {}
    mem = compiled.memory_analysis()
    memory = 0
    if mem is not None:
        memory = (
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes
        )
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "memory_bytes": int(memory),
    }


def _measure(program, *args) -> dict:
    return _analysis(program.lower(*args).compile())


def program_costs(pipe, inputs, targets) -> list[dict]:
    """Per stage, ``{program: {"flops", "bytes_accessed", "memory_bytes"}}``
    for one microbatch (the first of ``inputs`` / ``targets``, split as
    :meth:`Pipeline.step` splits them), over the programs ``forward``,
    ``backward`` (whole), ``backward_input`` (B) and ``backward_weight`` (W),
    as the runtime runs them: the first stage's input has no cotangent, so its
    B runs the whole backward (``backward_input`` is that program's figures)
    and its W runs no program (no ``backward_weight`` entry). Every stage must run in
    this process. Compiles what a step has not compiled yet; runs the programs
    once on the microbatch (the parameters do not change)."""
    stages, progs, m = pipe.stages, pipe.programs, pipe.microbatches
    if any(p is None for p in progs):
        raise SBPError(
            "program_costs: some stages run in other processes; call it where every stage runs "
            "(one process), or read each process's own stages' programs."
        )
    x = placed(feed("inputs", on_host(inputs), m)(0), stages[0].placement, stages[0].in_sbp)
    t = placed(feed("targets", on_host(targets), m)(0), stages[-1].placement, pipe.target_sbp)
    costs: list[dict] = [{} for _ in stages]
    stash = []
    last = len(stages) - 1
    for s, (stage, prog) in enumerate(zip(stages, progs)):
        args = (x, t) if s == last else (x,)
        costs[s]["forward"] = _measure(prog.forward, stage.params, *args)
        out, saved = ready(prog.forward(stage.params, *args))
        stash.append((args, saved))
        if s < last:
            x = ready(out.to_global(sbp=stages[s + 1].in_sbp, placement=stages[s + 1].placement))
    ct = np.float32(1.0 / m)
    for s in range(last, -1, -1):
        stage, prog = stages[s], progs[s]
        args, saved = stash[s]
        costs[s]["backward"] = _measure(prog.backward, stage.params, *args, saved, ct, prog.zeros)
        if s == 0:  # what StepBodies.backward_input runs there
            costs[s]["backward_input"] = costs[s]["backward"]
            continue
        split = prog.vjp.split(stage.params, args[0], args[1:])
        saved_b = tuple(saved[i] for i in split.saved_for_input)
        saved_w = tuple(saved[i] for i in split.saved_for_weight)
        costs[s]["backward_input"] = _measure(prog.backward_input, stage.params, *args, saved_b, ct)
        dx, kept = ready(prog.backward_input(stage.params, *args, saved_b, ct))
        costs[s]["backward_weight"] = _measure(
            prog.backward_weight, stage.params, *args, saved_w, ct, kept, prog.zeros
        )
        ct = ready(dx.to_global(sbp=stages[s - 1].out_sbp, placement=stages[s - 1].placement))
    return costs
