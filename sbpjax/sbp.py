"""SBP values: Split(dim), Broadcast and Partial(op), and nd-SBP tuples.

An SBP says how one placement axis lays out a logical tensor:

* ``S(d)``: the devices along the axis hold the balanced split of dim ``d``
  (the first ``size % p`` pieces one element longer, as OneFlow's BalancedSplitter);
* ``B``: every device holds the whole tensor;
* ``P(op)``: every device holds a tensor of the logical shape; the logical tensor
  is the elementwise ``op`` (sum, max or min) over them.

An nd-SBP is a tuple with one SBP per placement axis, outer axis first. Values
print as ``S(0)``, ``B``, ``P``, ``P(max)``, ``P(min)``; :func:`parse_sbp` reads
the same text back.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Sequence

from sbpjax._errors import SBPError

PARTIAL_OPS = ("sum", "max", "min")


# SBPs are interned: ``S(0)`` is one object wherever it is made, so comparing
# two is an identity check and hashing one reads a stored number. The layout
# choice keys its cost tables' bounds by nd-SBPs and looks them up 1.1M times in
# a 2-D GPT's plan on 2x2x2, each lookup running the dataclasses' Python __eq__
# and __hash__ on every axis (interned: that plan 77 -> 73 s). The hash stays the
# contents' hash, as before, so nothing's iteration order depends on addresses.
_INTERNED: dict = {}


def _interned(cls, key: tuple, fields: dict):
    hit = _INTERNED.get((cls, key))
    if hit is None:
        hit = object.__new__(cls)
        for name, value in fields.items():
            object.__setattr__(hit, name, value)
        object.__setattr__(hit, "_hash", hash(key))
        _INTERNED[cls, key] = hit
    return hit


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Split:
    """``S(dim)``: the balanced split of tensor dim ``dim`` over a placement axis."""

    dim: int

    def __new__(cls, dim: int) -> Split:
        if not isinstance(dim, bool) and hasattr(dim, "__index__"):
            dim = operator.index(dim)  # numpy ints too
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
            raise SBPError(
                f"S({dim!r}): a split dim must be a non-negative int "
                "(the tensor dim to split; negative dims are not accepted because an "
                "SBP is written before the tensor's rank is known)."
            )
        return _interned(cls, (dim,), {"dim": dim})

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __reduce__(self):
        return (Split, (self.dim,))  # unpickled as the interned object

    def __repr__(self):
        return f"S({self.dim})"

    __str__ = __repr__


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Broadcast:
    """``B``: every device along the axis holds the whole tensor."""

    def __new__(cls) -> Broadcast:
        return _interned(cls, (), {})

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __reduce__(self):
        return (Broadcast, ())

    def __repr__(self):
        return "B"

    __str__ = __repr__


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Partial:
    """``P(op)``: the logical tensor is the elementwise ``op`` over the local tensors."""

    op: str = "sum"

    def __new__(cls, op: str = "sum") -> Partial:
        if op not in PARTIAL_OPS:
            raise SBPError(f"P({op!r}): unknown partial op; use one of {', '.join(PARTIAL_OPS)}.")
        return _interned(cls, (op,), {"op": op})

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __reduce__(self):
        return (Partial, (self.op,))

    def __repr__(self):
        return "P" if self.op == "sum" else f"P({self.op})"

    __str__ = __repr__


SBP = Split | Broadcast | Partial
NdSbp = tuple  # tuple[SBP, ...], one per placement axis, outer first


def S(dim: int) -> Split:
    """``S(dim)``: split tensor dim ``dim``."""
    return Split(dim)


split = S
B = broadcast = Broadcast()
P = partial_sum = Partial("sum")
P_max = partial_max = Partial("max")
P_min = partial_min = Partial("min")

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<split>S|split)\s*\(\s*(?P<dim>-?\d+)\s*\)
      | (?P<partial>P|partial)\s*(?:\(\s*(?P<op>[a-z_]+)\s*\))?
      | (?P<long_partial>partial_(?:sum|max|min))
      | (?P<bcast>B|broadcast)
    )\s*""",
    re.VERBOSE,
)


def parse_sbp(text: str) -> tuple:
    """Read an nd-SBP from text: ``"S(0), P(max)"`` -> ``(S(0), P(max))``.

    Accepts the printed forms (``S(d)``, ``B``, ``P``, ``P(sum)``, ``P(max)``,
    ``P(min)``) and the long names (``split(d)``, ``broadcast``, ``partial_sum``...),
    separated by commas, optionally in parentheses. Always returns a tuple.
    """
    if not isinstance(text, str):
        raise SBPError(f"parse_sbp expects a str, got {type(text).__name__}: {text!r}.")
    body = text.strip()
    if body.startswith("(") and body.endswith(")") and _balanced(body[1:-1]):
        body = body[1:-1]
    if not body.strip():
        raise SBPError(f"parse_sbp({text!r}): empty; write e.g. 'S(0), B'.")
    out: list[SBP] = []
    for part in _split_commas(body):
        m = _TOKEN.fullmatch(part)
        if m is None:
            raise SBPError(
                f"parse_sbp({text!r}): cannot read {part.strip()!r}. Each entry is one of "
                "S(<dim>), B, P, P(sum), P(max), P(min) (or split(<dim>), broadcast, "
                "partial_sum, partial_max, partial_min)."
            )
        if m.group("split"):
            out.append(Split(int(m.group("dim"))))
        elif m.group("bcast"):
            out.append(B)
        elif m.group("long_partial"):
            out.append(Partial(m.group("long_partial").split("_")[1]))
        else:
            out.append(Partial(m.group("op") or "sum"))
    return tuple(out)


def format_sbp(sbp) -> str:
    """Print an SBP or nd-SBP so that :func:`parse_sbp` reads it back."""
    if isinstance(sbp, (Split, Broadcast, Partial)):
        return str(sbp)
    return "(" + ", ".join(str(s) for s in sbp) + ")"


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            return False
    return depth == 0


def _split_commas(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def as_sbp(value, where: str = "sbp"):
    """One SBP from an SBP value or its text."""
    if isinstance(value, (Split, Broadcast, Partial)):
        return value
    if isinstance(value, str):
        parsed = parse_sbp(value)
        if len(parsed) != 1:
            raise SBPError(f"{where}: expected one SBP, got {len(parsed)} in {value!r}.")
        return parsed[0]
    raise SBPError(
        f"{where}: {value!r} is not an SBP; use sj.S(d), sj.B, sj.P, sj.P_max, sj.P_min "
        "or their text ('S(0)', 'B', 'P', 'P(max)', 'P(min)')."
    )


def normalize_nd_sbp(sbp, placement_ndim: int, tensor_ndim: int | None = None, where: str = "sbp") -> tuple:
    """Turn user input into an nd-SBP tuple and check it.

    Accepts a tuple/list of SBPs, text, or (for a 1-D placement) a bare SBP.
    Checks the length against the placement rank and split dims against the
    tensor rank; raises :class:`SBPError` with the fix otherwise.
    """
    if isinstance(sbp, str):
        items: Sequence = parse_sbp(sbp)
    elif isinstance(sbp, (Split, Broadcast, Partial)):
        items = (sbp,)
    elif isinstance(sbp, (tuple, list)):
        items = tuple(as_sbp(s, where) for s in sbp)
    else:  # a dict or a set too: iterating one would read its keys as SBPs
        raise SBPError(
            f"{where}: {sbp!r} is not an SBP or a tuple of SBPs; give one SBP per placement axis, in "
            'placement order, e.g. (S(0), B) or "S(0), B".'
        )
    items = tuple(items)
    if len(items) != placement_ndim:
        hint = (
            f"give one SBP per placement axis, e.g. {format_sbp(items + (B,) * (placement_ndim - len(items)))}"
            if len(items) < placement_ndim
            else "remove the extra entries"
        )
        raise SBPError(
            f"{where}: nd-SBP {format_sbp(items)} has {len(items)} entries but the placement "
            f"has {placement_ndim} axes; {hint}."
        )
    if tensor_ndim is not None:
        for axis, s in enumerate(items):
            if isinstance(s, Split) and s.dim >= tensor_ndim:
                raise SBPError(
                    f"{where}: {s} on placement axis {axis} splits dim {s.dim}, but the tensor "
                    f"has {tensor_ndim} dims (valid split dims: 0..{tensor_ndim - 1}); "
                    + ("a 0-d tensor can only be B or P." if tensor_ndim == 0 else "pick a dim in range.")
                )
    return items
