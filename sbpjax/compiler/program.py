"""The flat program the compiler plans: values (:class:`Var`, :class:`Const`),
primitive applications (:class:`Node`), the written-out scans and conds it
keeps a record of (:class:`Loop`, :class:`Iteration`, :class:`Cond`), and
where each equation came from in the user's code (:func:`source_of`).
:mod:`sbpjax.compiler.trace` builds it from a function.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import os
from typing import Any

import numpy as np

_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Var:
    """A value of the flat program."""

    shape: tuple
    dtype: np.dtype
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    name: str = ""

    def __repr__(self):
        return self.name or f"v{self.id}"


@dataclasses.dataclass(eq=False)
class Const:
    """A constant (a jaxpr literal or a captured array); always B."""

    value: object

    @property
    def shape(self):
        return tuple(np.shape(self.value))

    @property
    def dtype(self):
        return np.asarray(self.value).dtype if not hasattr(self.value, "dtype") else self.value.dtype


@dataclasses.dataclass(eq=False)
class Node:
    """One primitive application: the original equation (its params and avals
    feed the rules) with the flat program's inputs and outputs."""

    eqn: Any  # a jax.core.JaxprEqn (its module moved across JAX versions)
    ins: list
    outs: list
    source: str
    region: int = 0  # the jax.checkpoint region it recomputes (0: none); see trace.REMAT
    # the branches it lies in, outermost first: ((Cond.id, branch number), ...)
    branch: tuple = ()
    # what its candidate signatures depend on, computed once (propagation.op_key)
    op_key: Any = dataclasses.field(default=None, repr=False)
    # its equation's params as text, shared by the nodes of one equation (EqnText)
    texts: Any = dataclasses.field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.eqn.primitive.name

    @property
    def params_text(self) -> str:
        """``repr`` of the equation's params sorted by name (op keys and the plan
        cache's fingerprint read it)."""
        if self.texts is None:
            self.texts = EqnText(self.eqn)
        return self.texts.params


class EqnText:
    """An equation's user line and params as text, made once for all the
    nodes it becomes: a written-out scan's iterations are its body's
    equations again (a 32-layer scanned step: 8,693 nodes of 300 equations;
    the params' text took half a second on each plan cache hit)."""

    def __init__(self, eqn):
        self.eqn = eqn
        self._source: str | None = None
        self._params: str | None = None

    @property
    def source(self) -> str:
        if self._source is None:
            self._source = source_of(self.eqn)
        return self._source

    @property
    def params(self) -> str:
        if self._params is None:
            self._params = repr(sorted(self.eqn.params.items(), key=lambda kv: kv[0]))
        return self._params


@dataclasses.dataclass(eq=False)
class Iteration:
    """One iteration of a written-out scan: ``ins`` are its body's inputs
    (consts, carries, then the slices ``x[index]``), ``outs`` its results
    (carries, then the ``ys`` slices), ``made`` the ids of the Vars its body's
    nodes compute (no node is shared with another iteration: each iteration is
    written out without merging equal equations across iterations),
    ``slicing`` the nodes before the body that index its slices out of the
    stacked operands, in the order they were written (the same in every
    iteration)."""

    index: int
    ins: list
    outs: list
    made: set
    slicing: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class Loop:
    """A ``scan`` written out as straight-line code (see ``trace.UNROLL_LIMIT``)."""

    reverse: bool
    n_consts: int
    n_carry: int
    xs: list  # the stacked operands, atoms of the enclosing program
    iterations: list  # Iteration, in the order they run
    stacked: list = dataclasses.field(default_factory=list)  # the Var stacking each ys slice
    source: str = ""  # the user's line that made the scan


@dataclasses.dataclass(eq=False)
class Cond:
    """A ``cond`` / ``switch`` written out: its branches' nodes (tagged with
    ``Node.branch``), then ``selects``, one ``select_n(index, *cases)`` node per
    result. Each branch is written out with its own copy of the merge table,
    so no code after the cond reads a value made inside a branch: a branch's
    values reach the rest of the program only through the selects, and the
    lowering may run the branches as a ``lax.switch``."""

    id: int
    index: Any  # the (clamped) branch number, an atom of the enclosing code
    n_branches: int
    selects: list  # Node per result
    source: str = ""


def common_path(paths) -> tuple:
    """The longest common prefix of branch paths (``Node.branch``): the
    innermost branch all of them lie in."""
    paths = list(paths)
    out = tuple(paths[0]) if paths else ()
    for p in paths[1:]:
        n = 0
        while n < min(len(out), len(p)) and out[n] == p[n]:
            n += 1
        out = out[:n]
    return out


@dataclasses.dataclass
class Program:
    inputs: list  # Var per flattened argument leaf
    nodes: list
    outputs: list  # Var or Const per flattened output leaf
    out_tree: object
    loops: list = dataclasses.field(default_factory=list)  # Loop, inner loops first
    conds: list = dataclasses.field(default_factory=list)  # Cond, inner conds first


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Folders whose frames are never the user's line: sbpjax itself and the
    libraries a model is written with (Flax's modules and transforms such as
    ``nnx.scan``, optax's updates), found without importing them."""
    dirs = [_PACKAGE]
    for name in ("flax", "optax", "orbax", "chex"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for d in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.abspath(d) + os.sep)
    return tuple(dirs)


UNKNOWN_SOURCE = "<unknown>"  # an equation whose traceback holds no frame at all


def source_of(eqn) -> str:
    """The user's line that made ``eqn``: the innermost frame outside JAX, the
    standard library, sbpjax itself, Flax and optax (``sj.constrain``, the Flax
    layers and transforms are called from the user's code, which is what a plan
    or a warning should point at)."""
    try:
        from jax._src import source_info_util

        frame = first = None
        for f in source_info_util.user_frames(eqn.source_info.traceback):
            first = first or f
            if not f.file_name.startswith(_library_dirs()):
                frame = f
                break
        frame = frame or first
        if frame is None:
            return UNKNOWN_SOURCE
        column = f":{frame.start_column}" if frame.start_column else ""
        return f"{frame.file_name}:{frame.start_line}{column} ({frame.function_name})"
    except Exception:  # noqa: BLE001 - source info is a nicety
        return UNKNOWN_SOURCE


def located(err, source: str):
    """``err`` (an SBPError a rule raised about one equation) with the user's
    line that made the equation appended, so the message says where as well
    as what: the rules see an equation, not the code it came from. The same
    error when the line is unknown or the message already names it."""
    if source == UNKNOWN_SOURCE or source in str(err):
        return err
    return type(err)(f"{err}\n  (at {source})")


__all__ = [
    "Var",
    "Const",
    "Node",
    "EqnText",
    "Iteration",
    "Loop",
    "Cond",
    "Program",
    "common_path",
    "source_of",
    "located",
    "UNKNOWN_SOURCE",
]
