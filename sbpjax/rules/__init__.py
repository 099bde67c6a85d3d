"""Signature rules: which SBPs make a JAX primitive correct on local tensors.

A rule is a small function registered for one or more primitives. Given the
equation (its params and the logical shapes of its operands) it returns the
valid **1-D** signatures: for one placement axis, the SBP each input must have
and the SBP each output then has. The compiler combines one 1-D signature per
placement axis into an nd-signature (OneFlow derives nd-SBP signatures the
same way: each axis acts on the pieces the earlier axes left).

Each rule's docstring shows the per-device equation that makes it correct. A
rule may also give the local evaluation (``local``): by default the primitive
is bound again on local tensors with shape parameters rescaled to local shapes.

Most rules move nothing themselves: every byte a program moves is a boxing
between ops. A few ops need their neighbours' data whatever layout they get
(a convolution split along image height needs the rows just past its piece; a
cumulative sum split along its axis needs the totals of the pieces before it).
Their rule also has a ``comm`` function: given an nd-signature it returns the
communication the local evaluation runs (``Comm`` records, priced like
boxings, which the layout choice adds to the signature's cost and ``explain()``
lists), or ``None`` when that nd-signature cannot be run locally (a halo wider
than a neighbour's piece).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from sbpjax.sbp import Broadcast, Partial, Split

B = Broadcast()


@dataclasses.dataclass(frozen=True)
class Sig:
    """A 1-D signature: the SBP each input needs and the SBP of each output.

    ``None`` for an input means "any": the input is used identically on every
    device, so it must be B (kept for scalars and index operands)."""

    ins: tuple
    outs: tuple


@dataclasses.dataclass(frozen=True)
class Comm:
    """Communication an op runs inside its own local evaluation.

    ``what``: e.g. "halo_exchange"; ``axes``: the placement axes it runs over;
    ``bytes``: bytes received, summed over all devices (OneFlow Table 2's
    convention, as for boxings). ``operand`` and ``detail`` say what is sent:
    two ops sending the same operand (in the same layout) with the same
    detail share one exchange (a convolution and its kernel gradient read the
    same halo), which the lowering runs once (``LocalCtx.memo``) and
    ``explain()`` counts once. ``launches``: the collectives it runs, each
    paying a launch's latency in the layout choice's price (one for an
    exchange; a loop planned as programs of its own, every collective of
    its iterations)."""

    what: str
    axes: tuple
    bytes: int
    operand: int = 0
    detail: tuple = ()
    launches: int = 1


def exchange_detail(chain: tuple, dim: int, side: str, rows: int, axes, own: str, edge: bool = True) -> tuple:
    """The ``Comm.detail`` (and ``LocalCtx.memo`` key) of an exchange of
    ``rows`` rows along ``dim`` over ``axes`` after the exchanges ``chain``
    of dims before. On an unchanged block (no ``chain``) sending its own
    ``edge`` rows ("left": its last rows to the next piece; "right": its
    first to the one before), a halo and a shift send the same permute, so
    they share one key: XLA would merge the two permutes, and ``explain()``
    then counts what runs. Otherwise the key is the rule's own (``own``)."""
    if edge and not chain:
        return ("edge rows", dim, side, rows, tuple(axes))
    return (own, chain, dim, side, rows, tuple(axes))


@dataclasses.dataclass
class Rule:
    name: str
    signatures: Callable  # (eqn, in_avals) -> list[Sig]
    local: Callable | None = None  # (eqn, local_ins, ctx) -> list of local outputs
    # (eqn, in_avals, ins_nd, outs_nd, grid) -> list[Comm] | None (None: not runnable)
    comm: Callable | None = None
    # (eqn) -> bool: whether ``comm`` may be more than nothing for this equation
    # (None: always); the greedy pass costs every signature of such ops exactly
    comm_if: Callable | None = None
    # (eqn, 1-D sig) -> bool: whether that candidate may communicate (None: any may)
    comm_sig_if: Callable | None = None


RULES: dict = {}


def register(*names: str, local: Callable | None = None):
    """Register a signature function for primitives named ``names``."""

    def deco(fn):
        for n in names:
            RULES[n] = Rule(n, fn, local)
        return fn

    return deco


def _setter(attr: str, what: str):
    def set_(*names: str):
        def deco(fn):
            for n in names:
                setattr(RULES[n], attr, fn)
            return fn

        return deco

    set_.__doc__ = f"Register the {what} of primitives named ``names``."
    return set_


set_local = _setter("local", "local evaluation")
set_comm = _setter("comm", "communication function (see ``Comm``)")
set_comm_if = _setter("comm_if", "test of whether an equation may communicate (see ``Rule``)")
set_comm_sig_if = _setter("comm_sig_if", "test of whether a candidate may communicate (see ``Rule``)")


def own_comm(eqn) -> bool:
    """Whether ``eqn``'s rule may run communication of its own (a halo)."""
    rule = RULES.get(eqn.primitive.name)
    return rule is not None and rule.comm is not None and (rule.comm_if is None or rule.comm_if(eqn))


def may_communicate(eqn, sig) -> bool:
    """Whether 1-D candidate ``sig`` of ``eqn`` may make its rule communicate
    (``Rule.comm_sig_if``; without one, any candidate of an op that may)."""
    rule = RULES.get(eqn.primitive.name)
    return rule is None or rule.comm_sig_if is None or rule.comm_sig_if(eqn, sig)


def prunes_quiet(eqn) -> bool:
    """Whether ``eqn`` may communicate and its rule tells which candidates
    cannot (``Rule.comm_sig_if``): the greedy pass then ranks those by
    estimate, as any op's."""
    rule = RULES.get(eqn.primitive.name)
    return own_comm(eqn) and rule is not None and rule.comm_sig_if is not None


def P(op: str = "sum") -> Partial:
    return Partial(op)


def rank(aval) -> int:
    return len(getattr(aval, "shape", ()))


def shape_of(aval) -> Sequence[int]:
    return tuple(getattr(aval, "shape", ()))


def split_axes(nd, dim) -> tuple[int, ...]:
    """The placement axes splitting ``dim`` in ``nd``, outer first."""
    return tuple(a for a, s in enumerate(nd) if isinstance(s, Split) and s.dim == dim)


def local_shape(dims, nd, grid) -> tuple:
    """The shape of each device's block of a tensor of shape ``dims``: its
    piece, padded to the largest piece where a split is uneven."""
    out = list(dims)
    for a, s in enumerate(nd):
        if isinstance(s, Split):
            out[s.dim] = -(-out[s.dim] // grid[a])
    return tuple(out)


# Import the families so their rules register themselves.
from sbpjax.rules import control, dot, elementwise, index, linalg, reduce, reverse, roll, shape, window  # noqa: E402,F401
