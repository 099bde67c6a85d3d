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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from sbpjax.sbp import Broadcast, Partial

B = Broadcast()


@dataclasses.dataclass(frozen=True)
class Sig:
    """A 1-D signature: the SBP each input needs and the SBP of each output.

    ``None`` for an input means "any": the input is used identically on every
    device, so it must be B (kept for scalars and index operands)."""

    ins: tuple
    outs: tuple


@dataclasses.dataclass
class Rule:
    name: str
    signatures: Callable  # (eqn, in_avals) -> list[Sig]
    local: Callable | None = None  # (eqn, local_ins, ctx) -> list of local outputs


RULES: dict = {}


def register(*names: str, local: Callable | None = None):
    """Register a signature function for primitives named ``names``."""

    def deco(fn):
        for n in names:
            RULES[n] = Rule(n, fn, local)
        return fn

    return deco


def set_local(*names: str):
    """Register the local evaluation of primitives named ``names``."""

    def deco(fn):
        for n in names:
            RULES[n].local = fn
        return fn

    return deco


def P(op: str = "sum") -> Partial:
    return Partial(op)


def rank(aval) -> int:
    return len(getattr(aval, "shape", ()))


def shape_of(aval) -> Sequence[int]:
    return tuple(getattr(aval, "shape", ()))


# Import the families so their rules register themselves.
from sbpjax.rules import control, dot, elementwise, index, reduce, shape, window  # noqa: E402,F401
