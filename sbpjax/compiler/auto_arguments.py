"""``sj.AUTO`` arguments: what stands for one before the solver has chosen
its layout, the pairs the solver keeps (a donated argument and its result,
optimizer state and its parameter), and its placement once chosen.
"""

from __future__ import annotations

import jax
import numpy as np

from sbpjax.compiler.auto import AUTO
from sbpjax.placement import Placement
from sbpjax.tensor import GlobalTensor, to_global


class Unplaced:
    """An AUTO argument before the solver has chosen its layout: its shape
    and dtype key the compile cache (the layout it comes in does not)."""

    sbp = AUTO

    def __init__(self, leaf, shape):
        self.leaf = leaf
        self.shape = tuple(shape)
        self.dtype = (
            leaf.dtype
            if isinstance(leaf, GlobalTensor)
            else jax.dtypes.canonicalize_dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf))
        )


def place_chosen(gts: list, in_sbp: list, placement: Placement) -> list:
    """The arguments laid out as the program takes them (AUTO ones as chosen)."""
    out = []
    for t, nd in zip(gts, in_sbp):
        if isinstance(t, Unplaced):
            t = (
                t.leaf.to_global(sbp=nd)
                if isinstance(t.leaf, GlobalTensor)
                else to_global(t.leaf, placement, nd)
            )
        out.append(t)
    return out


def donated_result_ties(gts: list, donated: tuple, program, out_specs) -> dict:
    """{result index: argument index} for each donated argument: the first
    result of its shape and dtype not yet paired (the pairing XLA uses to
    alias a donated buffer). The result takes the argument's layout, so a
    train step is a fixed point (its results are the next call's arguments,
    as they are) and the pair holds one buffer, which is what a memory
    budget counts.

    A result out_sbp gives a layout is passed over, unless the argument is
    not AUTO and the layout is its own. Decision: before, only AUTO arguments were tied, so
    a donated parameter with a written layout and its result were counted
    twice under a budget (the least any layout holds was quoted as 1,235,532 B
    where XLA held 613,320), and the result could come back in another
    layout, re-laid out before the next call and its buffer not reused."""
    ties: dict = {}
    for i in donated:
        fixed = gts[i].sbp is not AUTO
        for k, o in enumerate(program.outputs):
            if k in ties:
                continue
            if tuple(o.shape) != tuple(gts[i].shape) or np.dtype(o.dtype) != np.dtype(gts[i].dtype):
                continue
            want = None if out_specs is None else out_specs[k]
            if want is None or (fixed and tuple(want) == tuple(gts[i].sbp)):
                ties[k] = i
                break
    return ties


def mirrored_state(gts: list, paths: list) -> dict:
    """{argument leaf: earlier argument leaf} for AUTO leaves that mirror an
    AUTO leaf of an earlier positional argument: same shape, and a path
    within its argument that ends with the other's path (optax's ``mu`` /
    ``nu`` of a parameter, as ``state_sbp`` matches them); ``paths``: each
    leaf's key path in the call (``arguments.leaf_paths``). Such state takes
    its parameter's layout: the gradient meets both in one layout, and the
    solver has a third of the choices. Under a memory budget the state is
    chosen on its own where the plan chosen without it does not fit, so
    that it can be split where the parameters stay whole (ZeRO's
    optimizer-state sharding), and the pairs say which arguments are
    optimizer state (``choose`` holds the plan to ZeRO's hand-written
    layouts: ``sbpjax.compiler.hand_layouts``)."""
    auto = [k for k, t in enumerate(gts) if t.sbp is AUTO and paths[k][0].idx == 0 and len(paths[k]) > 2]
    out: dict = {}
    for k in auto:
        arg_k, inner_k = paths[k][1], jax.tree_util.keystr(paths[k][2:])
        for j in auto:
            if j >= k or paths[j][1] == arg_k or gts[j].shape != gts[k].shape or j in out:
                continue
            if inner_k.endswith(jax.tree_util.keystr(paths[j][2:])):
                out[k] = j
                break
    return out


__all__ = ["Unplaced", "donated_result_ties", "mirrored_state", "place_chosen"]
