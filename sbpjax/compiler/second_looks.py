"""Second looks at a solved plan: what the solver's objective (bytes, plus
each collective's latency) does not see, and the plan is held to after it.

* :func:`bytes_alone`: the plan solved again by bytes alone, kept where the
  first solve's prices missed a shared exchange or the lowering's buckets;
* :func:`fewer_collectives`: the plan solved again with each collective at
  its ring's full latency, kept where it runs fewer collectives for few more
  bytes (``CompileOptions.fewer_collectives``);
* :func:`held_to_greedys_peak`: the greedy pass's plan, kept where it moves
  no more bytes and holds less memory at its estimated peak (``PEAK_MARGIN``);
* :func:`greedy_dominates`: the greedy pass's plan, kept where it moves fewer
  bytes in no more collectives as compiled;
* :func:`as_given`: for ``AUTO`` arguments, the plan of the layouts chosen
  for them as if written by hand, kept where it is cheaper;
* :func:`by_hand_as_given`: likewise the layouts one would write by hand
  (data parallelism, ZeRO-1/2, ZeRO-3/FSDP, the chosen splits with ZeRO
  over the batch's axis), without a memory budget.
"""

from __future__ import annotations

import dataclasses
import time

from sbpjax.boxing.cost import CostModel
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.backend import solve_settled, spent
from sbpjax.compiler.buckets import emitted_collectives
from sbpjax.compiler.formulate import propagator
from sbpjax.compiler.hand_layouts import described, own, to_try
from sbpjax.compiler.liveness import held_bytes, live_bytes
from sbpjax.compiler.pricing import count_collectives, emitted_price, price, priced_launches
from sbpjax.compiler.propagation import Propagation
from sbpjax.compiler.tables import Tables
from sbpjax.sbp import Broadcast

# How far above the greedy pass's estimated peak a plan that moves no fewer
# bytes may hold (see _held_to_greedys_peak). The greedy pass follows the
# annotations op by op, as GSPMD does, and users hold a plan to GSPMD's memory
# within 10% (its temp memory at most 1.1x GSPMD's for the same annotations).
PEAK_MARGIN = 0.1

# How many times the bytes a plan that runs at most half the collectives may
# move (see traded). The trade that rule is for is GSPMD's one all-reduce in
# place of a reduce-scatter and a split kept (or gathered later, over more
# devices): a ring all-reduce moves twice its reduce-scatter's bytes, so the
# trade costs at most twice (the data-parallel steps on 4x2: 1.12-1.2x, 3
# collectives to 1). Past twice, the fewer collectives gather what the
# bytes-first plan reduces: a PPO step's advantages, normalized over 8
# devices, were all-gathered, 14,336 B in one collective where the mean's and
# standard deviation's scalar reductions move 112 B in two (GSPMD: 168 B).
HALVING_BYTES = 2


def held_to_greedys_peak(kept: Propagation, greedy: Propagation, g_memory: int) -> Propagation:
    """``kept``, or the greedy pass's plan where that moves no more bytes and
    ``kept``'s estimated peak (``liveness.live_bytes``) is more than
    ``PEAK_MARGIN`` above greedy's: the solver prices bytes and latency, not
    memory, and with the bytes equal, fewer collectives are not worth a
    larger peak. ``explain()`` says why greedy's plan was kept.

    The case it is for: a ``fori_loop`` reading its weights by index
    (``w1[i]``) accumulates their gradients in whole-size buffers; the solver
    keeps them partial through the backward loop and reduces them once after
    it, in one collective where the greedy pass runs one per iteration, for
    the same bytes. The one reduction's result is a second whole-size buffer:
    4 Megatron MLP layers on 8x1 held 1.66x GSPMD's temp memory that way,
    0.43x with greedy's plan."""
    if kept is greedy or greedy.bytes > kept.bytes:
        return kept
    choice = kept.choice
    peak = int(live_bytes(kept).max())
    if choice is None or choice.greedy_peak is None or peak <= (1 + PEAK_MARGIN) * choice.greedy_peak:
        return kept
    why = (
        f"the whole-program plan moves {kept.bytes} B, greedy's {greedy.bytes} B, but is estimated to "
        f"hold {peak} B at its peak per device, greedy's {choice.greedy_peak} B"
    )
    return _greedy_kept(greedy, choice, why, g_memory)


def greedy_dominates(kept: Propagation, greedy: Propagation, g_memory: int) -> Propagation:
    """``kept``, or the greedy pass's plan where that moves fewer bytes in no
    more collectives as compiled (``pricing.count_collectives``), holding at
    most ``PEAK_MARGIN`` more at its estimated peak: better by every measure
    but the solver's price, which charges a launch per boxing where XLA
    combines the reductions of gradients into one. A ViT-style step
    trained data parallel on 8 devices: the solved plan all-gathered the
    positional embeddings' batch-split gradient to save that reduction's
    launch, 397,880 B in 2 collectives, where greedy's plan moves 308,280 B
    in 1 (GSPMD's). ``explain()`` says why greedy's plan was kept."""
    # (not where scans were written out: greedy's iterations may differ, and
    # the lowering could not roll them back into a loop)
    if kept is greedy or greedy.bytes >= kept.bytes or greedy.program.loops:
        return kept
    choice = kept.choice
    kept_count, g_count = count_collectives(kept), count_collectives(greedy)
    if choice is None or g_count > kept_count:
        return kept
    # greedy's peak in place is the choice's already (``choose``); hoisted, it is not
    g_in_place = choice.greedy_peak if choice.greedy_peak is not None else live_bytes(greedy).max()
    hoisted = (live_bytes(greedy, hoisted=True).max(), live_bytes(kept, hoisted=True).max())
    peaks = [(g_in_place, live_bytes(kept).max()), hoisted]
    if any(g > (1 + PEAK_MARGIN) * k for g, k in peaks):
        return kept
    why = (
        f"the whole-program plan moves {kept.bytes} B in {kept_count} collectives as compiled, "
        f"greedy's {greedy.bytes} B in {g_count}"
    )
    return _greedy_kept(greedy, choice, why, g_memory)


def _greedy_kept(greedy: Propagation, choice, why: str, g_memory: int) -> Propagation:
    """The greedy pass's plan, with the first solve's ``choice`` saying ``why``."""
    choice.method, choice.reason = "greedy", why
    choice.memory_bytes, choice.latency_note = g_memory, ""
    greedy.choice = choice
    return greedy


def larger_peak(alt: Propagation, kept: Propagation, hoisted: bool) -> bool:
    """Whether ``alt``'s estimated peak (``liveness.live_bytes``) is larger
    than ``kept``'s, with recomputation where the program has it or hoisted."""
    return bool(live_bytes(alt, hoisted=hoisted).max() > live_bytes(kept, hoisted=hoisted).max())


def bytes_alone(
    program,
    kept: Propagation,
    form,
    *,
    in_sbp,
    cost_model,
    options,
    caches,
    pairs,
    memory_budget,
    greedy_bytes: int,
    greedy_fits: bool,
    effort: int,
) -> tuple[Propagation, int]:
    """``kept``, the plan of the first solve (each collective's latency
    priced), or the plan solved by bytes alone where the first solve's
    prices miss what the program runs, in either of two ways:

    * Its tables charge an exchange that two ops share (a convolution and
      its kernel gradient read one halo) once per op, where the lowering and
      ``price`` count it once, so the solve's objective is above
      ``price(kept)``. The bytes-alone plan is kept where ``price`` puts it
      below ``kept``. A height-split convolution's kernel gradient on 8
      devices: the first plan all-gathered the image beside the halos,
      200,256 B in 9 collectives, where the bytes-alone plan reuses the
      forward's halo, 114,240 B in 8 (GSPMD: 153,664 B).
    * It prices one launch per boxing, where the lowering combines
      reductions into buckets (:mod:`sbpjax.compiler.buckets`) and XLA
      combines all-reduces: a plan of many small boxings is priced above
      what it runs. Where ``kept`` moves more bytes than the greedy pass
      (which follows the layouts op by op, as GSPMD does) and greedy's plan
      fits the memory budget (else the budget may be what costs the bytes),
      ``kept`` is held to the trade :func:`fewer_collectives` allows: at
      most ``options.fewer_collectives`` more bytes than the bytes-alone
      plan, or at most half its collectives (``pricing.count_collectives``)
      for at most ``HALVING_BYTES`` times its bytes.
      A conv + BatchNorm step, batch split over x and channels over y on
      2x4: the first plan moved 197,160 B, the bytes-alone plan 72,288 B,
      both in 11 collectives as compiled (GSPMD: 69,792 B in 10).
      Likewise where the latency priced is at least the plan's bytes (the
      objective at least twice them: latency decides the layouts) and
      ``kept`` runs fewer collectives as compiled than the launches its
      price charged (``pricing.priced_launches``), greedy's bytes or not. A
      batch norm in a tensor-parallel step (4x2) kept its two small
      statistics' gradients partial, zero-filled the per-sample gradient to meet them
      and all-gathered the input for the kernel's gradient, 97,840 B, to
      save two all-reduces XLA combines with the others: both plans run 6
      collectives, the bytes-alone one moves 64,048 B (GSPMD: 65,584 B).

    Either way the bytes-alone plan is not kept where its estimated peak is
    larger (``larger_peak``, both places of recomputation). The tests need
    another solve, so each is gated: a plan whose objective is its price,
    that moves no more than greedy and whose bytes outweigh its latency
    (every row of the compiler benchmark) skips it. Decision: the latency
    share gates the last test because launches combined as compiled are the
    rule in training steps (their gradients' all-reduces): ungated, it
    solved every GPT row of ``benchmarks/compiler.py`` twice (its layout
    choice 1.6-1.9x slower on 2x4) and changed no row's bytes. And gates,
    not a pairwise term for shared exchanges or buckets in the problem: both
    would couple ops the exact elimination now solves apart. ``effort``:
    what the first solve left; this solve is given half of it, so that
    :func:`fewer_collectives` keeps the rest. Returns the plan and the work
    the solve spent."""
    choice = kept.choice
    if not options.latency or choice is None:
        return kept, 0
    kept_price = price(kept, cost_model, options)
    # one byte over: more than the rounding of sums kept in 1/64 B (pricing._weighted_sum)
    mispriced = choice.method == "ilp" and choice.objective is not None and choice.objective > kept_price + 1
    over_greedy = greedy_fits and kept.bytes > greedy_bytes
    # latency at least the bytes in the objective: where it decides the layouts
    latency_led = choice.objective is not None and choice.objective >= 2 * kept.bytes
    combined = latency_led and count_collectives(kept) < priced_launches(kept)
    if not (mispriced or over_greedy or combined):
        return kept, 0
    if (choice.gap is not None and choice.gap > 0) or spent(effort, options.effort):
        return kept, 0  # an unproven plan is not held to another heuristic solve's
    plain = dataclasses.replace(options, latency=False)
    alt, work = solved_again(
        program, kept, form, in_sbp, cost_model, plain, caches, memory_budget, effort // 2
    )
    if alt is None:
        return kept, work
    alt_price = price(alt, cost_model, options)
    kept_count, alt_count = count_collectives(kept), count_collectives(alt)
    if mispriced and alt_price < kept_price:
        why = f"priced {alt_price:.0f} B against {kept_price:.0f} B (the first solve charged a shared exchange per op)"
    elif over_greedy and not traded(kept.bytes, alt.bytes, kept_count, alt_count, options.fewer_collectives):
        why = (
            f"the first plan moved more than the greedy pass's {greedy_bytes} B for too few collectives saved"
        )
    elif combined and not traded(kept.bytes, alt.bytes, kept_count, alt_count, options.fewer_collectives):
        why = "the first plan's launches are combined as compiled, too few collectives saved"
    else:
        return kept, work
    if any(larger_peak(alt, kept, h) for h in (False, True)):
        return kept, work
    note(
        choice,
        f"solved again by bytes alone, and that plan kept: {alt.bytes} B in {alt_count} collectives in place "
        f"of {kept.bytes} B in {kept_count}, {why}",
    )
    return replaced(kept, alt, program, pairs, form.placement.shape), work


def solved_again(
    program, kept: Propagation, form, in_sbp, cost_model, options, caches, memory_budget, effort, ring=False
):
    """The first solve's problem with its boxings planned and priced anew
    (by ``options``; ``ring``: each collective at its ring latency), solved
    from ``kept`` within ``effort``; its time, rounds and table entries are
    added to ``kept.choice``. Returns the plan (None where the solve found
    none) and the work spent."""
    choice = kept.choice
    t0 = time.perf_counter()
    pr = propagator(program, form.placement, in_sbp, cost_model, options, caches, ring=ring)
    cm = cost_model if cost_model is not None else CostModel()
    again = form.repriced(pr, Tables(pr, cm, options, ring=ring))
    t1 = time.perf_counter()
    solved = solve_settled(again, effort, start=again.start(kept), usage_limit=memory_budget)
    choice.build_s += t1 - t0
    choice.solve_s += time.perf_counter() - t1
    choice.rounds += solved.rounds
    choice.planned += again.tables.planned
    choice.entries += again.tables.entries
    return (None if solved.strategies is None else again.plan(solved.strategies)), solved.work


def traded(
    dear_bytes, cheap_bytes, dear_count, cheap_count, share: float, dear_peak_larger=None
) -> str | None:
    """Why a plan moving ``dear_bytes`` in ``dear_count`` collectives is worth
    it against one moving ``cheap_bytes`` in ``cheap_count``: at most
    ``share`` more bytes, or at most half the collectives for at most
    ``HALVING_BYTES`` times the bytes where ``dear_peak_larger()`` (when
    given) says its estimated peak is no larger; None where neither holds.
    ``CompileOptions.fewer_collectives`` is the share: the trade
    :func:`fewer_collectives` buys and :func:`bytes_alone` holds a plan to."""
    if dear_bytes <= (1 + share) * cheap_bytes:
        return f"within {100 * share:.0f}%"
    if dear_bytes > HALVING_BYTES * cheap_bytes:
        return None
    if 2 * dear_count <= cheap_count and not (dear_peak_larger is not None and dear_peak_larger()):
        return "half the collectives, no larger peak"
    return None


def replaced(kept: Propagation, alt: Propagation, program, pairs, grid) -> Propagation:
    """``alt`` in place of ``kept``: ``kept``'s Choice (its bytes and the
    memory its arguments and results hold updated) and warnings."""
    choice = kept.choice
    choice.ilp_bytes = alt.bytes
    choice.memory_bytes = held_bytes(program, alt, pairs, grid)
    alt.warnings = kept.warnings
    alt.choice = choice
    return alt


def note(choice, text: str) -> None:
    """Add ``text`` to what ``explain()`` says of the second looks (``latency_note``)."""
    choice.latency_note = f"{choice.latency_note}; {text}" if choice.latency_note else text


def fewer_collectives(
    program, kept: Propagation, form, in_sbp, cost_model, options, caches, pairs, memory_budget, effort: int
) -> Propagation:
    """``kept``, or the plan solved with each collective at the cost model's
    ring latency (boxings planned by the same price) where that plan runs
    fewer collectives, is faster by the cost model, and either moves at most
    ``options.fewer_collectives`` more bytes or runs at most half the
    collectives for at most ``HALVING_BYTES`` times the bytes with no larger
    estimated peak (``liveness.live_bytes``),
    with each ``jax.checkpoint`` region's recomputation where the program
    has it and hoisted as early as its inputs allow.

    Bytes come first, but not at any price in collectives: on the compiler
    benchmark's data-parallel transformer step the bytes-first plan moves 7%
    fewer bytes in 4 collectives where GSPMD runs one all-reduce, and the cost
    model times it slower. Decision: these conditions rather than the ring's
    latency throughout (tried: collectives were bought with bytes everywhere,
    up to 35% more on the tensor-parallel step). The peak condition keeps
    FSDP plans, whose ring-priced alternative holds gathered weights and
    whole gradients (an 8-device FSDP MLP: 6 collectives instead of 12 for
    3.3x the estimated peak). Both places of the recomputation, because
    XLA's CPU scheduler keeps far more of an unrolled, checkpointed step than
    the program's order does (the model zoo's unrolled decoder: XLA's peak is
    up to 2.7x the program-order estimate, and GSPMD's program's temporaries are
    3.2x the scanned decoder's). There the ring-priced plan, Megatron over the
    model axis, runs 19 collectives instead of 43, its program-order estimate
    13% lower, but holds each layer's residual stream replicated over that
    axis: hoisted, it is estimated 42% larger, and XLA's peak is 35% larger
    (1.07x GSPMD's).

    ``effort``: what the bytes-first solve left of ``options.effort``, so that
    the option bounds the plan's whole solve. Decision: the second solve gets
    no effort of its own. Where the first proved its plan (most programs) it
    spent a small part and the second gets nearly all (at least half where
    :func:`bytes_alone` solved too); where it could not,
    the second solve is skipped (``explain()`` says so), whether the first
    spent the effort or its search stopped finding better plans: two
    heuristic solves of a 2-D GPT took minutes, the bytes-first plan, kept,
    moves the fewest bytes found, and on the scanned GPT with FSDP and
    tensor parallelism of ``tests/compiler/test_held_out_steps.py`` the
    second heuristic solve took a quarter of the layout choice's time (3.6
    of 13.7 s) for a plan that was not kept (at 3 and 4 layers, skipping it
    left the same bytes)."""
    if not options.fewer_collectives or kept.choice is None:
        return kept
    choice = kept.choice
    if choice.gap is not None and choice.gap > 0:
        note(choice, "not solved again with ring latency: the bytes-first solve was not proven optimal")
        return kept
    if spent(effort, options.effort):
        note(choice, "not solved again with ring latency: the bytes-first solve spent the effort")
        return kept
    # the first solve's problem, its boxings planned and priced by the ring's latency
    alt, _ = solved_again(
        program, kept, form, in_sbp, cost_model, options, caches, memory_budget, effort, ring=True
    )
    if alt is None:
        return kept
    kept_bytes, alt_bytes = kept.bytes, alt.bytes
    kept_launched, alt_launched = emitted_collectives(kept), emitted_collectives(alt)
    kept_count, alt_count = count_collectives(kept, kept_launched), count_collectives(alt, alt_launched)
    why = traded(
        alt_bytes,
        kept_bytes,
        alt_count,
        kept_count,
        options.fewer_collectives,
        dear_peak_larger=lambda: any(larger_peak(alt, kept, h) for h in (False, True)),
    )
    if why is None:
        return kept
    kept_time = emitted_price(kept, cost_model, ring=True, launched=kept_launched, options=options)
    alt_time = emitted_price(alt, cost_model, ring=True, launched=alt_launched, options=options)
    if alt_time >= kept_time or alt_count >= kept_count:
        return kept
    note(
        choice,
        f"then solved again with each collective's ring latency, and that plan kept: {alt_bytes} B "
        f"in place of {kept_bytes} B ({100 * (alt_bytes / max(kept_bytes, 1) - 1):+.1f}%, {why}), "
        f"{alt_count} collectives in place of {kept_count}, "
        f"{(kept_time - alt_time) / 1e6:.2f} MB-equivalent faster by the cost model",
    )
    if choice.method == "greedy":
        choice.method = "ilp"
    return replaced(kept, alt, program, pairs, form.placement.shape)


def as_given(kept: Propagation, in_sbp, plan_of, price_of, fits=None) -> Propagation:
    """``kept``, a plan that chose the layouts of ``AUTO`` arguments, or the
    plan ``sj.jit`` makes given those same layouts by hand (``plan_of``),
    where that is cheaper by ``price_of``; under a memory budget (``fits``
    given), where it moves fewer bytes and ``fits(plan)`` (the results'
    layouts, free in the given plan, may hold more). Bytes there, as the
    budget promises them (``hand_layouts.no_worse_than_by_hand``): by price,
    a 2-layer GPT step with AdamW under a budget on 2x4 traded 1,207,808 B
    for 1,450,496 B in fewer collectives.

    The two solves search different spaces. Where the chosen layouts leave
    an axis idle (no argument split or partial over it:
    ``propagation.idle_axes``), an ``AUTO`` argument may be laid out over any
    axis, so its solve holds each contraction to use every device; given the
    layouts, a contraction may run whole on the idle axis, as GSPMD runs
    replicated data parallelism. A tied-embedding MLP with AdamW on 2x4
    (batch over x, parameters and state ``AUTO``) chose every argument whole
    and moved 302,400 B, where the same layouts given by hand move 172,032 B.
    Elsewhere too: each solve keeps the candidates of each op around its own
    greedy pass (``Domains``), and the greedy pass starts an ``AUTO``
    argument whole, a given one in its layout. An embedding and head LM
    step with Adam on 2x4 (batch over x, no axis idle) chose layouts whose
    plan moved 962,560 B where the same layouts given move 735,312 B (GSPMD
    given them: 968,736 B); under a budget a 4-layer MLP step with AdamW
    moved 588,800 B where given 390,176 B. Decision: always, at the cost of
    a solve of a problem with no ``AUTO`` argument (before, only where an
    axis was idle)."""
    if all(nd is not AUTO for nd in in_sbp):
        return kept
    given = plan_of(list(kept.in_sbp))
    given_price, kept_price = price_of(given), price_of(kept)
    if fits is None:
        better = given_price < kept_price
    else:
        better = given.bytes < kept.bytes and fits(given)
    if not better:
        return kept
    first = kept.choice.solve_s if kept.choice is not None else 0.0
    return _in_place_of(
        kept,
        given,
        f"AUTO's layouts, solved again as given ({first:.2f} s choosing them): {given.bytes} B priced "
        f"{given_price:.0f}, the AUTO solve's plan {kept.bytes} B priced {kept_price:.0f}",
    )


def _in_place_of(kept: Propagation, given: Propagation, note: str) -> Propagation:
    """``given``, a plan of layouts written by hand, in place of ``kept``, the
    ``AUTO`` solve's: a copy with its own Choice saying why (``note``), and
    ``kept``'s warnings."""
    given = own(given)
    if given.choice is not None:
        choice = given.choice
        choice.reason = f"{choice.reason}; {note}" if choice.reason else note
        choice.auto, choice.as_given = True, True  # restore derives boxings as given (their idle axes)
    given.warnings = kept.warnings
    return given


def by_hand_as_given(
    kept: Propagation, program, in_sbp, mirrors: dict, grid, plan_of, price_of
) -> Propagation:
    """``kept``, a plan that chose the layouts of ``AUTO`` arguments without
    a memory budget, or the cheapest by ``price_of`` of the layouts a user
    would write by hand instead, each as ``sj.jit`` plans them given
    (``plan_of``), where one is cheaper:

    * data parallelism (every ``AUTO`` argument ``B``). Where it leaves an
      axis idle (a batch split over x on 2x4), the ``AUTO`` solve holds each
      contraction to every device and never sees its plan there (see
      ``as_given``): an MLP-Mixer step with AdamW on 4x2 chose Megatron's
      splits over y, 551,104 B priced 2,451,144, where data parallelism
      written by hand moves 519,984 B priced 1,919,984. With the batch over
      every axis too: a Switch MoE step (AdamW, tokens over both axes of
      2x4) lets its expert products run whole where the experts are
      replicated (``WholeProducts.whole_already``), which ``AUTO`` weights,
      free to split, never are; the solve kept 229,248 B priced 829,248
      where data parallelism moves 180,096 B priced 580,096.
    * the ZeRO layouts (``hand_layouts.candidates``: ZeRO-1/2, ZeRO-3/FSDP).
      The ``AUTO`` solve proves its plan optimal over the candidates
      ``Domains`` keeps for each op, and their plans may lie outside them
      (which narrowing leaves one out was not traced): a 3-layer MLP step
      with Adam on 8 devices (batch 64, weights up to 512 x 256) moved
      10,909,696 B "proven" where ZeRO-3 written by hand moves 2,637,824 B
      (and GSPMD given the chosen layouts 13,303,864 B).
    * the chosen layouts with ZeRO added over the batch's axis
      (``hand_layouts.on_chosen``): Megatron's splits with FSDP over the
      data axis, where the solve chose Megatron's splits.

    A budget is held to the ZeRO layouts by bytes instead
    (``hand_layouts.no_worse_than_by_hand``); data parallelism holds the most
    of any layout, so it is no candidate there. Costs a solve per layout, of
    problems with no ``AUTO`` argument (data parallelism's on that step: 120
    decisions against the ``AUTO`` solve's 457)."""
    if all(nd is not AUTO for nd in in_sbp):
        return kept
    replicated = (Broadcast(),) * len(grid)
    data_parallel = [replicated if nd is AUTO else nd for nd in in_sbp]
    written = [("data parallelism (every AUTO argument B)", data_parallel)]
    written += [
        (described(name), ins)
        for name, ins in to_try(program, in_sbp, list(kept.in_sbp), grid, mirrors, kept.placement.axis_names)
    ]
    kept_price = price_of(kept)
    best, best_price, best_name = kept, kept_price, ""
    for name, layouts in written:
        if layouts == list(kept.in_sbp):
            continue
        given = plan_of(layouts)
        given_price = price_of(given)
        if given_price < best_price:
            best, best_price, best_name = given, given_price, name
    if best is kept:
        return kept
    return _in_place_of(
        kept,
        best,
        f"{best_name}, planned as given: {best.bytes} B priced {best_price:.0f}, "
        f"the AUTO solve's plan {kept.bytes} B priced {kept_price:.0f}",
    )
