"""``sj.jit`` and ``sj.constrain``: the whole-program SBP compiler's surface.

    f = sj.jit(train_step, placement=pl, in_sbp=(param_sbps, (S(0), B)), out_sbp=...)
    new_params, loss = f(params, batch)       # global tensors or plain arrays
    print(f.explain(params, batch))           # signatures, boxings, bytes

Arguments are global tensors (their own layout) or plain arrays (laid out as
``in_sbp`` says, B by default). ``in_sbp``/``out_sbp`` are pytrees matching the
arguments / outputs whose leaves are nd-SBPs; a single nd-SBP stands for a
whole subtree; ``None`` means "as given" for inputs and "as chosen" for
outputs. One rule reads them, for SBP values and text alike: a string is
always one whole nd-SBP (``"S(0), B"``); a tuple of single SBPs (``(S(0), B)``
or ``("S(0)", "B")``) is one nd-SBP, except on a 1-D placement with more than
one entry, where it is one SBP per argument; a tuple mixing single SBPs with
nested entries on a placement of 2 or more axes is an error. Partials are
checked against the dtype table (:mod:`sbpjax.dtypes`). Results are global
tensors (partials stay partial unless ``out_sbp`` asks otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import time

import jax
import numpy as np

from sbpjax._errors import SBPError, is_positive_amount
from sbpjax.boxing.cost import checked_cost_model
from sbpjax.compiler import inner_loops  # noqa: F401 (plans long scans and while loops: registers them in propagation.NESTED)
from sbpjax.compiler.arguments import (
    broadcast_spec,
    check_array_leaf,
    check_no_donated_alias,
    checked_callable,
    checked_donate_argnums,
    checked_regather,
    checked_time_limit,
    is_nd_sbp,
    leaf_layout,
    leaf_name,
    leaf_paths,
    state_sbp,
    weakly_typed,
)
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.auto_arguments import Unplaced, place_chosen
from sbpjax.compiler.build_program import plan_and_build
from sbpjax.compiler.collector import collector_paused
from sbpjax.compiler.constrain import constrain
from sbpjax.compiler.explain import Explanation
from sbpjax.compiler.inflight import bounded
from sbpjax.compiler.keys import check_layout, rewrapped, unwrapped
from sbpjax.compiler.nested import inline_call
from sbpjax.compiler.options import checked_options
from sbpjax.compiler.plan_cache import ENV as PLAN_CACHE_ENV
from sbpjax.compiler.processes import check_same_call_in_every_process
from sbpjax.compiler.static_args import fingerprint_text, static_args
from sbpjax.compiler.trace import tracing_on
from sbpjax.described import describe
from sbpjax.dtypes import is_key, key_impl
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast
from sbpjax.tensor import GlobalTensor, is_global, relayout_together, to_global


def _is_deleted(x) -> bool:
    is_deleted = getattr(x, "is_deleted", None)
    return bool(is_deleted()) if is_deleted is not None and not isinstance(x, jax.core.Tracer) else False


class CompiledFunction:
    """What ``sj.jit`` returns: call it, ``explain`` it, ``lower`` it."""

    def __init__(
        self,
        fn,
        placement: Placement,
        in_sbp=None,
        out_sbp=None,
        cost_model=None,
        solver="ilp",
        solve_time_limit=None,
        donate_argnums=(),
        auto=False,
        memory_budget=None,
        regather="auto",
        options=None,
        plan_cache=None,
        static_argnums=None,
        static_argnames=None,
    ):
        checked_placement(placement, "sj.jit")
        self.fn = fn
        self.placement = placement
        self.in_sbp = in_sbp
        self.out_sbp = out_sbp
        self.cost_model = checked_cost_model(cost_model, "sj.jit")
        self.solver = solver
        checked_time_limit(solve_time_limit, "sj.jit")
        self.options = checked_options(options, "sj.jit")
        if not (plan_cache is None or isinstance(plan_cache, (bool, str, os.PathLike))):
            raise SBPError(
                f"sj.jit: plan_cache must be a directory (str or os.PathLike), False (no cache) or None "
                f"(${PLAN_CACHE_ENV}, else the user's cache directory), got {plan_cache!r}."
            )
        self.plan_cache = plan_cache
        self.donate_argnums = checked_donate_argnums(donate_argnums)
        self.static = static_args(fn, static_argnums, static_argnames)
        if set(self.donate_argnums) & set(self.static.nums):
            raise SBPError(
                f"sj.jit: donate_argnums and the static arguments (static_argnums / static_argnames) both "
                f"name argument(s) "
                f"{sorted(set(self.donate_argnums) & set(self.static.nums))}: a static argument is a Python "
                "value, not a buffer to donate."
            )
        if not isinstance(auto, (bool, np.bool_)):
            raise SBPError(
                f"sj.jit: auto must be True (the layout choice picks the layouts of arguments whose in_sbp "
                f"is None) or False, got {auto!r}."
            )
        self.auto = bool(auto)
        self.memory_budget = checked_budget(memory_budget)
        self.regather = checked_regather(regather, "sj.jit")
        self._cache: dict = {}
        # per call tree, in_sbp expanded to its positional leaves; per (spec, dims), the nd-SBP
        self._specs: dict = {}
        self._layouts: dict = {}
        # built programs not called or lowered yet: JAX traces the shard_map body
        # (Python) on the first, with the collector paused as for the plan
        self._unrun: set = set()
        self.last_overhead_s = 0.0
        functools.update_wrapper(self, fn)

    # -- argument handling -----------------------------------------------------
    def _globals(self, args, kwargs, static=(), abstract=False):
        """The call's array leaves as GlobalTensors laid out as ``in_sbp``
        says, and the call's tree; ``args`` / ``kwargs`` without the static
        arguments, whose values ``static`` holds (``StaticArgs.split``).
        ``abstract``: leaves not laid out so yet are described, not placed
        (``described.describe``: for ``lower()`` and ``explain()``)."""
        _, args_tree = jax.tree_util.tree_flatten(args, is_leaf=is_global)
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_global)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, jax.ShapeDtypeStruct) and is_key(leaf):
                raise SBPError(
                    f"sj.jit: argument {leaf_name(leaf_paths(tree)[k])} is a jax.ShapeDtypeStruct of typed "
                    "PRNG keys; pass a key array (jax.random.key(0)) instead: lower() reads its shape only."
                )
        leaves, impls = unwrapped(leaves)  # typed PRNG keys travel as their key data (compiler.keys)
        # keyword arguments: as given, or B
        try:
            specs = self._specs.get(args_tree)
            if specs is None:
                specs = self._specs[args_tree] = broadcast_spec(
                    self.in_sbp, args_tree, "in_sbp", self.placement.ndim
                )
        except SBPError as e:
            if not kwargs:
                raise
            raise SBPError(
                f"sj.jit: in_sbp describes the positional arguments only, and this call passes "
                f"{sorted(kwargs)} by keyword (laid out B); pass those by position to give them layouts, "
                f"as jax.jit's in_shardings also asks. ({e})"
            ) from None
        n_positional = len(specs)
        specs = specs + [None] * (len(leaves) - len(specs))
        # only a placement over every process can be checked with an all-gather
        # over every process; a placement in one process needs no check (a pipeline
        # stage), and one over some processes is not checked
        if CHECK_PROCESSES and len(self.placement.processes) == jax.process_count() > 1:
            check_same_call_in_every_process(tree, leaves, fingerprint_text(static))
        out = []
        pl = self.placement
        donated = set(self.static.donated_leaves(self.donate_argnums, tree, static))
        moving: list = []  # (leaf, nd-SBP): global tensors to re-lay out
        for k, (leaf, spec) in enumerate(zip(leaves, specs)):
            check_array_leaf(leaf, k, tree)
            if isinstance(leaf, jax.ShapeDtypeStruct) and not abstract:
                raise SBPError(
                    f"sj.jit: argument {leaf_name(leaf_paths(tree)[k])} is a jax.ShapeDtypeStruct: it "
                    "describes an argument for f.lower(...) and f.explain(...); a call needs its values."
                )
            shape = tuple(np.shape(leaf)) if not isinstance(leaf, GlobalTensor) else leaf.shape
            if k in donated and isinstance(leaf, jax.Array) and not abstract:
                # placing a jax array may reuse its buffer (a replicated layout
                # on devices that hold it), and donating that would delete the
                # caller's array; the docstring promises only the placed copy goes
                leaf = jax.numpy.copy(leaf)
            if isinstance(leaf, GlobalTensor):
                if _is_deleted(leaf.physical):
                    raise SBPError(
                        f"sj.jit: argument {leaf_name(leaf_paths(tree)[k])} {shape} was donated to an "
                        "earlier call (donate_argnums: its buffer now holds that call's result) and "
                        "cannot be used again; pass that call's result instead."
                    )
                if leaf.placement is not pl and leaf.placement != pl:
                    raise SBPError(
                        f"sj.jit: argument {leaf_name(leaf_paths(tree)[k])} lives on {leaf.placement!r}, the "
                        f"function on {pl!r}; move it with t.to_global(placement=...)."
                    )
            if spec is AUTO or (spec is None and self.auto and k < n_positional):
                # laid out once the solver has chosen (auto_arguments.place_chosen)
                out.append(Unplaced(leaf, shape))
                continue
            # a key's layout splits the key array's dims, never its data's last one
            dims = shape[:-1] if impls[k] else shape
            nd = None if spec is None else self._layout_of(spec, dims, k, tree)
            if nd is not None:  # named as the argument (to_global would name itself)
                dtype = leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf)
                where = f"sj.jit in_sbp of argument {leaf_name(leaf_paths(tree)[k])}"
                check_layout(dtype, nd, bool(impls[k]), where)
            if isinstance(leaf, GlobalTensor):
                out.append(leaf)
                if nd is not None and nd != leaf.sbp:
                    if abstract:
                        out[k] = describe(leaf, pl, nd)
                    else:
                        moving.append((k, nd))
            elif abstract:
                out.append(describe(leaf, pl, nd if nd is not None else (Broadcast(),) * pl.ndim))
            else:
                out.append(to_global(leaf, pl, nd if nd is not None else (Broadcast(),) * pl.ndim))
        if moving:  # every re-layout in one program (tensor.relayout_together)
            boxed = relayout_together([out[k] for k, _ in moving], [nd for _, nd in moving])
            for (k, _), t in zip(moving, boxed):
                out[k] = t
        if donated:
            check_no_donated_alias(out, donated, tree)
        return out, tree

    def _layout_of(self, spec, dims: tuple, k: int, tree):
        """``leaf_layout`` of an argument leaf, kept per (spec, dims): a train
        loop's calls lay out the same leaves every time."""
        try:
            key = (spec, dims)
            nd = self._layouts.get(key)
        except TypeError:  # a spec that is no hashable value (a list): not kept
            return leaf_layout(spec, self.placement.ndim, dims, k, tree)
        if nd is None:
            nd = self._layouts[key] = leaf_layout(spec, self.placement.ndim, dims, k, tree)
        return nd

    def _prepare(self, args, kwargs, abstract=False):
        """The call's arguments placed as its program takes them, and the
        program's entry (``_compile``), for a call from outside a trace.
        ``abstract``: arguments not laid out so yet are described, not placed
        (``lower()`` and ``explain()`` read shapes only, as ``jax.jit``'s
        ``lower()`` does: placing a model's parameters to read a plan cost a
        transfer of every byte, and a compile of its boxings)."""
        args, kwargs, static = self.static.split(args, kwargs)
        gts, tree = self._globals(args, kwargs, static, abstract)
        leaves = jax.tree_util.tree_leaves((args, kwargs), is_leaf=is_global)
        # Python scalars (and weakly typed jax values) keep JAX's weak type in
        # the trace, so a bf16 array times 2.0 stays bf16, as under jax.jit
        weak = tuple(weakly_typed(x) for x in leaves)
        entry = self._compile(gts, tree, weak, static, tuple(key_impl(x) for x in leaves))
        return place_chosen(gts, entry[0].in_sbp, self.placement, abstract), entry

    def _compile(self, gts, tree, weak=None, static=(), keys=None):
        """``(propagation, jitted program, each output's typed-key
        implementation or None)``, planned once per call signature."""
        weak = weak or (False,) * len(gts)
        keys = keys or (None,) * len(gts)
        key = (tree, weak, static, keys, tuple((t.shape, np.dtype(t.dtype).str, t.sbp) for t in gts))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        with collector_paused():
            entry = plan_and_build(self, gts, tree, weak, static, keys)
        self.last_overhead_s = sum(entry[0].timings[k] for k in ("trace_s", "choose_s", "build_s"))
        self._cache[key] = entry
        self._unrun.add(entry[1])
        return entry

    # -- the public surface ------------------------------------------------------
    def __call__(self, *args, **kwargs):
        outer = tracing_on()
        tracers = [x for x in jax.tree_util.tree_leaves((args, kwargs)) if isinstance(x, jax.core.Tracer)]
        if outer is not None and tracers:
            return inline_call(self, outer, args, kwargs)
        if any(hasattr(x, "batch_dim") for x in tracers):  # jax.vmap's tracers
            raise SBPError(
                f"sj.jit: {self!r} is called under jax.vmap. Its results are GlobalTensors laid out by "
                "dims vmap would shift; put the vmap inside: sj.jit(jax.vmap(f), placement=..., "
                "in_sbp=...) with the batch dim in the layouts."
            )
        gts, (prop, fn, out_keys) = self._prepare(args, kwargs)
        with self._first_use(fn):
            outs = fn(*[t.physical for t in gts])
        bounded(outs, self.placement)
        prog = prop.program
        results = [
            GlobalTensor(y, o.shape, o.dtype, self.placement, nd)
            for y, o, nd in zip(outs, prog.outputs, prop.out_sbp)
        ]
        return jax.tree_util.tree_unflatten(prog.out_tree, rewrapped(results, out_keys))

    def explain(self, *args, compile: bool = False, **kwargs) -> Explanation:  # noqa: A002 (jax's word)
        """What the compiler decided for these arguments (``Explanation``).

        ``compile=True`` also lowers and compiles the program with XLA (as
        ``lower(...).compile()`` does) and adds those times to ``timings``, so
        the front end's share of the whole compile can be read."""
        gts, (prop, fn, _) = self._prepare(args, kwargs, abstract=True)
        if compile and "xla_compile_s" not in prop.timings:
            t0 = time.perf_counter()
            with self._first_use(fn):
                lowered = fn.lower(*[t.physical for t in gts])
                t1 = time.perf_counter()
                lowered.compile()
            prop.timings.update(lower_s=t1 - t0, xla_compile_s=time.perf_counter() - t1)
        return Explanation(prop)

    def lower(self, *args, **kwargs):
        """The ``jax.stages.Lowered`` of the single jitted program, for the
        arguments' shapes, dtypes and layouts: as ``jax.jit``'s ``lower()``,
        it places no data (arguments not laid out as the program takes them
        are described by ``jax.ShapeDtypeStruct`` values). Its ``compile()``
        runs on the physical arrays of GlobalTensors laid out so."""
        gts, (prop, fn, _) = self._prepare(args, kwargs, abstract=True)
        with self._first_use(fn):
            return fn.lower(*[t.physical for t in gts])

    def _first_use(self, fn):
        """The collector paused for ``fn``'s first call or lowering (see ``_unrun``)."""
        if fn not in self._unrun:
            return contextlib.nullcontext()
        self._unrun.discard(fn)
        return collector_paused()

    def __repr__(self):
        return f"sj.jit({getattr(self.fn, '__name__', self.fn)!r}, placement={self.placement!r})"


# With several processes, every call first checks that all processes make the
# same call (sbpjax.compiler.processes). It costs one all-gather of 32 bytes and
# a wait for it per call; a program known to be consistent may turn it off.
CHECK_PROCESSES = True


def jit(
    fn=None,
    *,
    placement: Placement,
    in_sbp=None,
    out_sbp=None,
    cost_model=None,
    solver="ilp",
    solve_time_limit=None,
    donate_argnums=(),
    auto=False,
    memory_budget=None,
    regather="auto",
    options=None,
    plan_cache=None,
    static_argnums=None,
    static_argnames=None,
):
    """Compile ``fn`` into one SBP-partitioned program on ``placement``.

    ``solver="ilp"`` (default) chooses every layout for the program as a whole,
    minimizing bytes moved plus each collective's latency priced in bytes by
    ``cost_model`` (:mod:`sbpjax.compiler.choose`): a pairwise problem solved
    within a work limit, never a wall clock, so the same program gets the same
    plan on every machine and in every process; the greedy choice is kept
    if it costs no more, and ``explain()`` says which was used and the
    proven gap. ``solver="greedy"`` is the fast op-by-op pass, for
    prototyping. ``options``: an ``sj.CompileOptions`` (the solver's
    ``effort`` and the other settings of the layout choice and the
    lowering). ``solve_time_limit`` is accepted for compatibility and
    ignored, with a DeprecationWarning.

    ``plan_cache``: where plans are kept on disk and read back
    (:mod:`sbpjax.compiler.plan_cache`): a directory, False for none, or
    None for ``$SBPJAX_PLAN_CACHE`` (a directory, or ``0`` for none), else
    ``~/.cache/sbpjax/plans``. With several processes, process 0 plans and
    sends its plan to the others.

    Usable as ``sj.jit(fn, placement=pl)`` or as a decorator
    ``@functools.partial(sj.jit, placement=pl)``. Arguments are arrays and
    numbers (Python scalars keep JAX's weak type), except static ones.

    ``static_argnums`` / ``static_argnames``: as ``jax.jit``'s, the
    arguments that are hashable Python values selecting the program (a mode
    string, a flag, a frozen config) rather than arrays; each distinct value
    is traced, planned and compiled once (:mod:`sbpjax.compiler.static_args`).
    ``in_sbp`` then describes the other positional arguments, as
    ``jax.jit``'s ``in_shardings`` does; ``donate_argnums`` counts all of them.
    Typed PRNG keys (``jax.random.key``) are arguments like arrays, and a
    key the function returns comes back as a typed key ``jax.Array``
    (:mod:`sbpjax.compiler.keys`).

    Calls return before their program has run, as ``jax.jit``'s do, except
    that on CPU devices under jax < 0.11 every 8th call waits for its results:
    that jax's CPU client deadlocks with some 30 programs with collectives
    queued (:mod:`sbpjax.compiler.inflight`).

    With JAX transformations: put them inside (``sj.jit(jax.grad(loss))``,
    ``sj.jit(jax.vmap(f))``). Outside, ``jax.vmap`` of an ``sj.jit``
    function is an SBPError, and ``jax.grad`` differentiates through the
    results' ``.to_jax()`` (results with no partial: ``out_sbp``), not
    through the GlobalTensors themselves. Called inside another function
    ``sj.jit`` compiles, it is inlined there (its layouts kept as
    ``sj.constrain`` points).

    ``in_sbp`` / ``out_sbp``: pytree prefixes of the arguments / outputs whose
    leaves are nd-SBPs. A string is always one whole nd-SBP; a tuple of single
    SBPs (objects or text, which mean the same) is one nd-SBP, except on a 1-D
    placement with more than one entry, where it is one SBP per argument:
    on ``sj.placement(8, "x")``, ``in_sbp=(S(0), B)`` and ``("S(0)", "B")``
    both give the first argument S(0) and the second B; on a 2x4 placement both
    give every argument (S(0), B). A tuple mixing single SBPs with nested
    entries on a placement of 2 or more axes is an SBPError (ambiguous).

    ``cost_model``: an ``sj.CostModel`` (latency ``alpha`` and inverse
    bandwidth ``beta`` per placement axis) for the boxing planner and the
    layout choice; each collective's latency counts as ``alpha / beta``
    bytes (100 kB on the default model). ``sj.calibrate`` measures one.

    ``donate_argnums``: an int or a tuple of ints, as ``jax.jit``'s: the
    positional arguments whose buffers the program may reuse for its outputs
    (e.g. parameters and optimizer state in a train step, so the step holds
    one copy of them rather than two). Every global tensor in a donated
    argument is invalid after the call: reading it (``numpy()``, ``to_jax()``)
    or passing it again raises an error. An argument that is re-laid out
    before the call (``in_sbp`` differs from its layout, or a plain array)
    donates the re-laid-out copy; the tensor passed in stays valid then.

    Automatic layouts: an ``in_sbp`` leaf ``sj.AUTO`` (or, with ``auto=True``,
    every positional argument leaf ``in_sbp`` leaves ``None``) gets the layout
    the whole-program solver chooses with the rest of the program (B or a
    split of any dim on each axis; ``explain()`` shows the choice). A donated
    AUTO argument (a train step's parameters and optimizer state) ties its
    result to the same layout, so the results can be passed to the next call
    as they are; without donation nothing ties them. ``memory_budget``: the
    bytes per device that arguments and results may hold together (a donated
    argument and its result once, where the result has the argument's
    layout; activations inside the step are not counted): the solver picks
    the cheapest layouts that fit, e.g. ZeRO's split optimizer state, never
    more bytes than ZeRO-1/2 or ZeRO-3/FSDP written by hand where one fits
    (``explain()`` lists them), or raises an SBPError giving the least any
    layout needs.
    Both need ``solver="ilp"``.

    ``regather`` trades bytes for memory where the chosen layouts all-gather a
    split argument (a parameter, ZeRO-3 / FSDP style) for its uses in both the
    forward and the backward pass: the gathered copy is held only while it is
    used and gathered again for the backward pass (PyTorch FSDP's
    ``reshard_after_forward``), where that lowers the step's estimated memory
    peak by at least 5% (``sbpjax.compiler.regather``). Each regather moves
    the gather's bytes again; ``explain()`` lists them. ``"auto"`` (default):
    the fewest (the largest first) that bring the estimated peak 5% under
    the greedy pass's plan's (``explain().choice.greedy_peak``), and only
    while the plan with them moves no more bytes than that plan
    (``explain().choice.greedy_bytes``; otherwise ``explain()`` says what
    they would have saved and cost); ``True``: every one that lowers the
    estimate, whatever the bytes; ``False``: never. On the model
    benchmark's ViT "auto" regathers 2 of 12 weights: peak 7.62 to 7.10 MB
    per device (GSPMD 7.19), bytes 23.0 to 26.1 MB (GSPMD 66.9); on the
    compiler benchmark's tensor-parallel transformer step none (they would
    cost more than the greedy plan's bytes).
    """
    kw = dict(
        in_sbp=in_sbp,
        out_sbp=out_sbp,
        cost_model=cost_model,
        solver=solver,
        solve_time_limit=solve_time_limit,
        donate_argnums=donate_argnums,
        auto=auto,
        memory_budget=memory_budget,
        regather=regather,
        options=options,
        plan_cache=plan_cache,
        static_argnums=static_argnums,
        static_argnames=static_argnames,
    )
    if fn is None:
        return lambda f: CompiledFunction(checked_callable(f), placement, **kw)
    return CompiledFunction(checked_callable(fn), placement, **kw)


def checked_budget(memory_budget, where: str = "sj.jit"):
    """``memory_budget`` as a Python int or float (NumPy's numbers too: a
    budget computed from array sizes), or None; a bool, a string, NaN or a
    number <= 0 or infinite is an SBPError."""
    if memory_budget is None:
        return None
    if not is_positive_amount(memory_budget):
        raise SBPError(
            f"{where}: memory_budget must be a positive, finite number of bytes per device (None for no "
            f"budget), got {memory_budget!r}."
        )
    return int(memory_budget) if isinstance(memory_budget, numbers.Integral) else float(memory_budget)


__all__ = ["jit", "constrain", "CompiledFunction", "is_nd_sbp", "state_sbp", "AUTO"]
