"""``sj.AUTO`` arguments: what stands for one before the solver has chosen
its layout, the pairs the solver keeps (a donated argument and its result,
optimizer state and its parameter), and its placement once chosen.
"""

from __future__ import annotations

import jax
import numpy as np

from sbpjax.compiler.auto import AUTO
from sbpjax.described import describe
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


def place_chosen(gts: list, in_sbp: list, placement: Placement, abstract: bool = False) -> list:
    """The arguments laid out as the program takes them (AUTO ones as chosen;
    ``abstract``: described, not placed, ``described.describe``)."""
    out = []
    for t, nd in zip(gts, in_sbp):
        if isinstance(t, Unplaced):
            if abstract:
                t = describe(t.leaf, placement, nd)
            elif isinstance(t.leaf, GlobalTensor):
                t = t.leaf.to_global(sbp=nd)
            else:
                t = to_global(t.leaf, placement, nd)
        out.append(t)
    return out


def donated_result_ties(gts: list, donated: tuple, program, out_specs) -> dict:
    """{result index: argument index} for each donated AUTO argument: the
    first result of its shape and dtype not yet paired (the pairing XLA uses
    to alias a donated buffer), unless out_sbp gives that result a layout.
    The result takes the argument's layout, so a train step is a fixed
    point: its results are the next call's arguments, as they are."""
    ties: dict = {}
    for i in donated:
        if gts[i].sbp is not AUTO:
            continue
        for k, o in enumerate(program.outputs):
            if k in ties or (out_specs is not None and out_specs[k] is not None):
                continue
            if tuple(o.shape) == tuple(gts[i].shape) and np.dtype(o.dtype) == np.dtype(gts[i].dtype):
                ties[k] = i
                break
    return ties


def donated_aliases(gts: list, donated: tuple, program, ties: dict) -> dict:
    """{result index: argument index} for each donated argument not tied
    (one with a written layout, or an AUTO one whose results of its shape
    out_sbp lays out): the first result of its shape and dtype that no
    other donated argument is paired or tied with. Nothing ties its layout
    (the user's program chooses it, as without donation); a memory budget
    counts the pair once where the result has the argument's layout
    (``liveness.held_bytes``). XLA may pair buffers otherwise (by size), and
    share more: the count is an upper bound of its own. Decision: before,
    such a pair was counted twice, and a budget the step met was refused or
    bought with split parameters (the least any layout holds was quoted as
    1,235,532 B where XLA held 613,320)."""
    aliases: dict = {}
    tied = set(ties.values())
    for i in donated:
        if i in tied:
            continue
        for k, o in enumerate(program.outputs):
            if k in ties or k in aliases:
                continue
            if tuple(o.shape) == tuple(gts[i].shape) and np.dtype(o.dtype) == np.dtype(gts[i].dtype):
                aliases[k] = i
                break
    return aliases


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


__all__ = ["Unplaced", "donated_aliases", "donated_result_ties", "mirrored_state", "place_chosen"]
