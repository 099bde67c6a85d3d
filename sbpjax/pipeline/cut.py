"""Stages cut from a model: balanced layers on sub-placements, no stage function by hand.

    pl = sj.placement((4, 2), ("pp", "tp"))              # 4 stages of 2 devices
    c = sjp.cut(model, pl, axis="pp", sample=tokens)       # an NNX model, or a LayerChain
    pipe = sjp.Pipeline(c.stages, loss_fn, optax.adam(1e-3), microbatches=8)
    result = pipe.step(tokens, labels)
    c.model_params(result.grads)                          # the gradients in the model's own tree

Each layer is priced by :func:`layer_costs` (XLA's flop count of its forward
and backward, or its measured time), the stages are balanced by the exact
dynamic program of :func:`sbpjax.pipeline.balance`, and stage ``s`` gets the
sub-placement at index ``s`` of the pipeline axis with its parameters laid out
as the model's own annotations say on that sub-placement (sbpjax.flax's
``with_sbp`` / ``annotate`` / ``sbp_module``, or ``nnx.with_partitioning``
names that match its axes). The embedding is in the first layer and the head
in the last, so they go to the first and last stages.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence

import jax
import numpy as np

from sbpjax._errors import SBPError, is_count
from sbpjax.pipeline.balance import Balance, balance, check_stages, range_costs
from sbpjax.pipeline.chain import LayerChain
from sbpjax.pipeline.group_balance import refined
from sbpjax.pipeline.registry import as_schedule
from sbpjax.pipeline.stage import Stage
from sbpjax.placement import Placement

COST_KINDS = ("flops", "time")


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # one dict per program on older JAX
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def _differentiable(x) -> bool:
    return bool(jax.numpy.issubdtype(x.dtype, jax.numpy.inexact))


def _backward(apply):
    """``(params, x, dy) -> cotangents`` of one layer (of its parameters only
    when its input is not a float, e.g. tokens)."""

    def backward(p, x, dy):
        if _differentiable(x):
            return jax.vjp(apply, p, x)[1](dy)
        return jax.vjp(lambda q: apply(q, x), p)[1](dy)

    return backward


def layer_flops(chain: LayerChain, examples: int | None = None) -> list[tuple[float, float]]:
    """Per layer, ``(forward, backward)`` flops as XLA counts them in the compiled
    programs (``cost_analysis``) on ``examples`` examples (default: the
    sample's). Alike layers (``LayerChain.ties``) are compiled once."""
    key = examples or chain.examples
    if key in chain.flops_cache:  # a cut and a search of one chain count once
        return chain.flops_cache[key]
    shapes = chain.boundaries(examples)
    out, seen = [], {}
    for layer, tie, x, y in zip(chain.layers, chain.ties(examples, shapes), shapes, shapes[1:]):
        if tie is None or tie not in seen:
            fwd = _flops(jax.jit(layer.apply).lower(layer.params, x).compile())
            both = _flops(jax.jit(_backward(layer.apply)).lower(layer.params, x, y).compile())
            # the backward program runs the forward again to get its residuals
            seen[tie] = (fwd, max(both - fwd, 0.0))
        out.append(seen[tie])
    chain.flops_cache[key] = out
    return out


def layer_times(chain: LayerChain, repeats: int = 5, device=None) -> list[tuple[float, float]]:
    """Per layer, ``(forward, backward)`` seconds measured on one device on the
    sample: the median of ``repeats`` runs after a warm-up (a wall-clock
    measure: it depends on the machine and its load). Alike layers
    (``LayerChain.ties``) are timed once."""
    device = device or jax.devices()[0]
    x = jax.device_put(np.asarray(chain.sample), device)
    out, seen = [], {}
    for layer, key in zip(chain.layers, chain.ties()):
        p = jax.device_put(layer.params, device)
        fwd = jax.jit(layer.apply)
        y = jax.block_until_ready(fwd(p, x))
        if key is None or key not in seen:
            bwd = jax.jit(_backward(layer.apply))
            dy = jax.tree_util.tree_map(jax.numpy.ones_like, y)  # the last layer's output may be a pytree
            jax.block_until_ready(bwd(p, x, dy))
            t_f = _median_time(fwd, (p, x), repeats)
            t_b = _median_time(bwd, (p, x, dy), repeats)
            seen[key] = (t_f, max(t_b - t_f, 0.0))
        out.append(seen[key])
        x = y
    return out


def _median_time(fn, args, repeats: int) -> float:
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def layer_costs(chain: LayerChain, costs="flops") -> np.ndarray:
    """One number per layer for :func:`balance`: forward plus backward ``"flops"``
    (machine independent), measured ``"time"``, or the given sequence."""
    if isinstance(costs, str):
        if costs not in COST_KINDS:
            raise SBPError(
                f"cut: costs={costs!r}; use one of {COST_KINDS} or a sequence of numbers per layer."
            )
        pairs = layer_flops(chain) if costs == "flops" else layer_times(chain)
        return np.asarray([f + b for f, b in pairs])
    values = np.asarray(costs, dtype=np.float64)
    if values.shape != (len(chain),):
        raise SBPError(
            f"cut: {values.size} costs for {len(chain)} layers ({', '.join(l.name for l in chain.layers)}); "
            "give one cost per layer."
        )
    return values


def stage_placements(placement, axis, stages: int | None, schedule) -> tuple[list[Placement], list[int]]:
    """The device groups (one per index of ``axis``, or the list given) and, per
    stage, the group it runs on (the schedule's ``device_of``)."""
    if isinstance(placement, Placement):
        a = placement.axis_index(axis)  # checked on a 1-D placement too: a wrong axis is a mistake
        if placement.ndim == 1:
            groups = [placement[i] for i in range(placement.size)]
        else:
            groups = [placement[(slice(None),) * a + (i,)] for i in range(placement.shape[a])]
    else:
        groups = list(placement)
        if not groups or not all(isinstance(g, Placement) for g in groups):
            raise SBPError(
                "cut: placement must be an sj.Placement with a pipeline axis (e.g. sj.placement((4, 2), "
                "('pp', 'tp')) with axis='pp') or a list of disjoint sj.Placement, one per device group."
            )
        for g, group in enumerate(groups):
            for h in range(g):
                if not group.is_disjoint(groups[h]):
                    d = min(set(group.device_ids) & set(groups[h].device_ids))
                    raise SBPError(
                        f"cut: device {d} is in device groups {h} and {g}; the groups of a pipeline are "
                        "disjoint (each device runs one group's stages)."
                    )
    sched = as_schedule(schedule) if schedule is not None else None
    if sched is None:
        n = stages if stages is not None else len(groups)
        return groups, [s % len(groups) for s in range(n)]
    runs = sched.stages(len(groups))
    n = stages if stages is not None else runs
    if n != runs:
        # refused here, as Pipeline would refuse the stages: device_of past the schedule's stages
        # names no group (ZB-V's 2p - 1 - s goes negative, and Python's lists read that from the end)
        raise SBPError(
            f"cut: stages={n} on {len(groups)} device groups, but {sched!r} runs {runs} stages there; "
            "leave stages out (the schedule's count), or give Interleaved1F1B(chunks=v) for v stages "
            "per group."
        )
    where = [sched.device_of(s, len(groups)) for s in range(n)]
    return groups, where


@dataclasses.dataclass
class Cut:
    """Stages cut from a :class:`LayerChain`: ``stages`` for :class:`Pipeline`,
    ``balance`` (bounds and stage costs), the per-layer ``costs`` it balanced."""

    chain: LayerChain
    balance: Balance
    costs: np.ndarray
    stages: list

    @property
    def bounds(self):
        return self.balance.bounds

    def layer_params(self, per_stage: Sequence) -> list:
        """Per layer, from per-stage lists (``pipe.params``, ``result.grads``)."""
        return [p for stage in per_stage for p in stage]

    def model_params(self, per_stage: Sequence):
        """Per-stage lists back in the model's own tree (host arrays)."""
        return self.chain.model_params(self.layer_params(per_stage))

    def __repr__(self):
        rows = [
            f"  stage {s}: {', '.join(self.chain[i].name for i in range(lo, hi))} (cost {c:.4g}) on {st.placement!r}"
            for s, ((lo, hi), c, st) in enumerate(zip(self.bounds, self.balance.stage_costs, self.stages))
        ]
        return "Cut(\n" + "\n".join(rows) + "\n)"


def cut(
    model,
    placement,
    *,
    axis=0,
    sample=None,
    costs="flops",
    stages: int | None = None,
    schedule=None,
    blocks: str | None = None,
    remat: bool = False,
    microbatches: int | None = None,
) -> Cut:
    """Cut ``model`` (a :class:`LayerChain`, or a Flax NNX model with ``sample``,
    its example input) into balanced stages on ``placement``.

    ``placement``: an ``sj.Placement`` whose ``axis`` indexes the device groups
    (a 1-D placement: one device per group), or a list of placements. ``stages``:
    how many (default: one per group; a ``schedule`` with several chunks per
    group, e.g. ``Interleaved1F1B(2)``, sets it and where each stage runs).
    ``costs``: "flops", "time" or one number per layer. ``remat``: each layer
    under ``jax.checkpoint``. ``microbatches``: with a ``schedule`` that runs
    several stages per group (interleaved, zb-v, dualpipev), the cut balanced
    stage by stage is refined to shorten that schedule's simulated step at
    this microbatch count (:mod:`sbpjax.pipeline.group_balance`); with one
    stage per group the stage-balanced cut is kept (it already balances the
    groups)."""
    if microbatches is not None and not is_count(microbatches):
        raise SBPError(f"cut: microbatches={microbatches!r}; give the number of microbatches, an int >= 1.")
    if microbatches is not None and schedule is None:
        raise SBPError(
            "cut: microbatches= refines the cut for the schedule it runs under; give schedule= too "
            "(interleaved, zb-v or dualpipev: several stages per group), or leave microbatches out."
        )
    if isinstance(model, LayerChain):
        chain = model
    else:
        if sample is None:
            raise SBPError(
                "cut: a model needs sample=, an example input (a batch of the model's input), to find its "
                "layers and price them; or pass a LayerChain."
            )
        chain = LayerChain.from_model(model, sample, blocks=blocks)
    groups, where = stage_placements(placement, axis, stages, schedule)
    n = len(where)
    check_stages(n, len(chain), f"cut of {chain!r}")
    values = layer_costs(chain, costs)
    split = balance(values, n)
    if microbatches is not None and schedule is not None:
        split = refined(values, split, as_schedule(schedule), len(groups), int(microbatches))
    built = []
    for s, (lo, hi) in enumerate(split.bounds):
        pl = groups[where[s]]
        built.append(
            Stage(
                chain.stage_fn(lo, hi, remat=remat),
                [chain[i].params for i in range(lo, hi)],
                pl,
                param_sbp=[chain[i].param_sbp(pl) for i in range(lo, hi)],
                name=f"stage{s}",
            )
        )
    return Cut(chain, split, values, built)


def slowest_stage(costs: Sequence[float], bounds) -> float:
    """The slowest stage of ``bounds`` priced with ``costs`` (e.g. other costs than
    the cut was balanced with)."""
    table = range_costs(costs)
    return float(max(table[a, b] for a, b in bounds))
