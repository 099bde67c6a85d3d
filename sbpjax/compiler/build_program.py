"""From one call signature of ``sj.jit`` to its program: trace, read
``out_sbp``, choose the layouts (:mod:`sbpjax.compiler.planning`), add the
regathers, lower to one jitted ``shard_map``. ``CompiledFunction`` keeps the
result per signature."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax

from sbpjax._errors import SBPError
from sbpjax.compiler import lower as lowering
from sbpjax.compiler.arguments import broadcast_spec, leaf_name, leaf_paths
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.auto_arguments import donated_aliases, donated_result_ties, mirrored_state
from sbpjax.compiler.keys import check_layout, keyed
from sbpjax.compiler.planning import plan
from sbpjax.compiler.regather import add_regathers
from sbpjax.compiler.static_args import bind
from sbpjax.compiler.trace import trace
from sbpjax.sbp import normalize_nd_sbp

if TYPE_CHECKING:
    from sbpjax.compiler.api import CompiledFunction


def plan_and_build(cf: CompiledFunction, gts, tree, weak, static, keys):
    """Trace ``cf``'s function for a call's placed arguments, choose every
    layout, and build the jitted program: ``(propagation, program, each
    output's typed-key implementation or None)``. The phase times go into
    ``propagation.timings`` (``explain()``)."""
    t0 = time.perf_counter()
    avals = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=w) for t, w in zip(gts, weak)]
    opts = cf.options
    out_keys: list = []
    program = trace(
        keyed(bind(cf.fn, static), tree, keys, out_keys),
        avals,
        tree,
        unroll_limit=opts.unroll_limit,
        loop_slices=opts.loop_slices,
        keep_last_carries=opts.roll_loops,
        placement=cf.placement,
    )
    t_traced = time.perf_counter()
    out_specs = None
    if cf.out_sbp is not None:
        raw = broadcast_spec(cf.out_sbp, program.out_tree, "out_sbp", cf.placement.ndim)
        if any(s is AUTO for s in raw):
            raise SBPError(
                "sj.jit: out_sbp leaves cannot be sj.AUTO: a result without out_sbp (None) takes the "
                "layout the solver chose. sj.AUTO marks arguments (in_sbp); a donated AUTO argument's "
                "result takes the argument's layout."
            )
        names = [f"result{jax.tree_util.keystr(p)}" for p in leaf_paths(program.out_tree)]
        out_specs = [
            None
            if s is None
            else normalize_nd_sbp(s, cf.placement.ndim, len(o.shape), f"out_sbp of the {name}")
            for s, o, name in zip(raw, program.outputs, names)
        ]
        for nd, o, name, key in zip(out_specs, program.outputs, names, out_keys):
            if nd is not None:
                check_layout(o.dtype, nd, key is not None, f"sj.jit out_sbp of the {name}")
    donated = cf.static.donated_leaves(cf.donate_argnums, tree, static)
    ties = donated_result_ties(gts, donated, program, out_specs)
    prop = plan(
        program,
        cf.placement,
        [t.sbp for t in gts],
        out_specs,
        cf.cost_model,
        solver=cf.solver,
        options=cf.options,
        ties=ties,
        aliases=donated_aliases(gts, donated, program, ties),
        memory_budget=cf.memory_budget,
        same_layout=mirrored_state(gts, leaf_paths(tree)),
        arg_names=[leaf_name(p) for p in leaf_paths(tree)],
        cache=cf.plan_cache,
    )
    if cf.regather:
        add_regathers(prop, cf.regather)
    t_chosen = time.perf_counter()
    fn = lowering.build(prop, donated)
    t_built = time.perf_counter()
    prop.timings.update(trace_s=t_traced - t0, choose_s=t_chosen - t_traced, build_s=t_built - t_chosen)
    return prop, fn, tuple(out_keys)
