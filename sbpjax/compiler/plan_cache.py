"""Plans kept on disk, as JAX keeps compiled programs: a cell run again, a
second process or another machine plans a program once.

A plan is a pure function of the program, the placement's shape and axis
names, the layouts asked for, the cost model, the ``CompileOptions`` and the
sbpjax version (:mod:`sbpjax.compiler.choose`), so its key is a SHA-256 of
those (:func:`fingerprint`). An entry is data, never code: a JSON record of
the arguments' layouts and each op's signature, written as text. Reading one
back checks it against the program before use (:func:`load`): every
signature must be one the op's rule allows on these shapes
(``signatures.allowed``), so a foreign, tampered or truncated file is
rejected (with a ``PlanCacheWarning``) or, edited into another valid plan of
the same program, runs as that plan: the same values, maybe more bytes
(``explain()`` shows them). Nothing in it is ever run as code. Writes go to a
temporary file renamed over the entry (atomic on POSIX and Windows), so
processes sharing a directory never read half an entry.

Where (:func:`cache_dir`): ``sj.jit(..., plan_cache=...)`` (a directory, or
False for none); else the environment variable ``SBPJAX_PLAN_CACHE`` (a
directory, or ``0`` / ``off`` for none); else ``$XDG_CACHE_HOME/sbpjax/plans``
(``~/.cache/sbpjax/plans`` without it). Entries are a few kB to a few
hundred kB; nothing is evicted (delete the directory to clear it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import warnings

import numpy as np

from sbpjax._errors import SBPError, SBPWarning
from sbpjax._version import __version__
from sbpjax.boxing.cost import CostModel
from sbpjax.compiler.program import Var
from sbpjax.dtypes import constant_bits, dtype_name
from sbpjax.sbp import format_sbp, parse_sbp

SCHEMA = 1
ENV = "SBPJAX_PLAN_CACHE"


class PlanCacheWarning(SBPWarning):
    """A plan cache entry could not be used (corrupt, stale or not this
    program's) or written; the plan is made anew."""


def cache_dir(option=None) -> str | None:
    """The plan cache's directory, or None when caching is off: ``option``
    (a path, or False; an empty path is off, as the variable's), else
    ``$SBPJAX_PLAN_CACHE`` (a path, or 0 / off / false / no / empty), else the
    user's cache directory."""
    if option is False:
        return None
    if option is not None and option is not True:
        path = os.fspath(option)
        return path if path.strip() else None
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "false", "no") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sbpjax", "plans")


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _program_text(program) -> list:
    """The program as plain data: each op's primitive, parameters, operands
    (arguments and earlier results by position, constants by value) and
    results' shapes and dtypes. Object addresses in parameters' text are
    dropped (they differ from one process to the next)."""
    where: dict = {id(v): ("arg", i) for i, v in enumerate(program.inputs)}
    # conds are numbered by a counter that runs on from one trace to the next
    cond_number: dict = {}
    out: list = [[("in", tuple(v.shape), dtype_name(v.dtype)) for v in program.inputs]]
    for k, node in enumerate(program.nodes):
        ins = []
        for a in node.ins:
            if isinstance(a, Var):
                ins.append(where.get(id(a), ("?",)))
            else:
                value = constant_bits(a.value)  # a typed key: its key data
                dtype = str(getattr(a.value, "dtype", value.dtype))
                ins.append(("const", np.shape(a.value), dtype, hashlib.sha256(value.tobytes()).hexdigest()))
        params = _ADDRESS.sub("", node.params_text)
        branch = tuple((cond_number.setdefault(c, len(cond_number)), k) for c, k in node.branch)
        outs = [(tuple(o.shape), dtype_name(o.dtype)) for o in node.outs]
        out.append((node.name, params, ins, outs, branch, node.region > 0))
        for j, o in enumerate(node.outs):
            where[id(o)] = ("op", k, j)
    out.append([where.get(id(a), ("const",)) for a in program.outputs])
    return out


@functools.cache
def source_digest() -> str:
    """A SHA-256 of sbpjax's own source files: plans made by other code (an
    edited checkout with the same version number) are never read back."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def fingerprint(program, placement, in_sbp, out_sbp, settings: dict) -> str:
    """The key of a plan: a SHA-256 over the program's text, the placement's
    shape and axis names (not its devices: a plan holds on any devices of
    that shape), the layouts asked for (``AUTO`` included), ``settings``
    (solver, cost model, options, ties, budget...) and the sbpjax version
    (and its source, ``source_digest``)."""
    text = repr(
        (
            SCHEMA,
            __version__,
            source_digest(),
            _program_text(program),
            tuple(placement.shape),
            tuple(placement.axis_names),
            [repr(nd) for nd in in_sbp],
            None if out_sbp is None else [repr(nd) for nd in out_sbp],
            sorted((k, repr(v)) for k, v in settings.items()),
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()


def plan_key(
    program,
    placement,
    in_sbp,
    out_sbp,
    *,
    solver,
    cost_model,
    options,
    ties,
    same_layout,
    memory_budget,
    arg_names,
    aliases=None,
) -> str:
    """The key (``fingerprint``) of the plan ``choose`` makes with these
    arguments: everything that decides it."""
    settings = dict(
        solver=solver,
        cost_model=repr(cost_model if cost_model is not None else CostModel()),
        options=options.fingerprint(),
        ties=sorted(ties.items()),
        same_layout=sorted(same_layout.items()),
        memory_budget=memory_budget,
        # names find alike layers only where they share decisions
        arg_names=list(arg_names or ()) if options.tie_layers else None,
    )
    if aliases:  # what a budget counts, and the held bytes explain() shows
        settings["aliases"] = sorted(aliases.items())
    return fingerprint(program, placement, in_sbp, out_sbp, settings)


@dataclasses.dataclass
class Entry:
    """A cached plan: the arguments' layouts, each op's (ins, outs) signature,
    the results' layouts and the Choice's fields, for ``explain()``."""

    in_sbp: list
    signatures: list
    out_sbp: list
    choice: dict
    first: dict = dataclasses.field(default_factory=dict)  # value key -> layout boxed to first
    ring: bool = False  # boxings planned by the ring's latency

    def to_json(self, key: str, n_ops: int) -> str:
        return json.dumps(
            {
                "schema": SCHEMA,
                "sbpjax": __version__,
                "key": key,
                "ops": n_ops,
                "in_sbp": [format_sbp(nd) for nd in self.in_sbp],
                "out_sbp": [None if nd is None else format_sbp(nd) for nd in self.out_sbp],
                "signatures": [
                    [[format_sbp(nd) for nd in ins], [format_sbp(nd) for nd in outs]]
                    for ins, outs in self.signatures
                ],
                "first": [[list(k), format_sbp(nd)] for k, nd in self.first.items()],
                "ring": self.ring,
                "choice": self.choice,
            }
        )


def parse_entry(record, key: str, n_ops: int) -> Entry:
    """An Entry from a decoded JSON record, or SBPError saying what is off."""
    if not isinstance(record, dict):
        raise SBPError("not a JSON object")
    if record.get("schema") != SCHEMA or record.get("sbpjax") != __version__:
        raise SBPError(f"written by sbpjax {record.get('sbpjax')!r} (schema {record.get('schema')!r})")
    if record.get("key") != key or record.get("ops") != n_ops:
        raise SBPError("written for another program")

    parsed: dict = {}  # an entry names a few layouts many times over

    def nd(text):
        if not isinstance(text, str):
            raise SBPError(f"{text!r} is not an nd-SBP")
        layout = parsed.get(text)
        if layout is None:
            layout = parsed[text] = tuple(parse_sbp(text))
        return layout

    sigs = record.get("signatures")
    if not isinstance(sigs, list) or len(sigs) != n_ops:
        raise SBPError("its signatures do not match the program's ops")
    signatures = []
    for s in sigs:
        if not (isinstance(s, list) and len(s) == 2 and all(isinstance(x, list) for x in s)):
            raise SBPError(f"{s!r} is not a signature")
        signatures.append(([nd(t) for t in s[0]], [nd(t) for t in s[1]]))
    choice = record.get("choice")
    if not isinstance(choice, dict):
        raise SBPError("no choice record")
    for field in ("in_sbp", "out_sbp", "first"):
        if not isinstance(record.get(field, []), list):
            raise SBPError(f"its {field} is not a list")
    first = {}
    for item in record.get("first", []):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)):
            raise SBPError(f"{item!r} is not a version")
        name = tuple(item[0])
        if not (name[:1] in (("arg",), ("op",)) and all(isinstance(x, int) for x in name[1:])):
            raise SBPError(f"{item[0]!r} names no value")
        first[name] = nd(item[1])
    ring = record.get("ring", False)
    if not isinstance(ring, bool):
        raise SBPError(f"ring is {ring!r}")
    return Entry(
        [nd(t) for t in record.get("in_sbp", [])],
        signatures,
        [None if t is None else nd(t) for t in record.get("out_sbp", [])],
        choice,
        first,
        ring,
    )


def load(directory: str | None, key: str, n_ops: int) -> Entry | None:
    """The entry for ``key``, or None (no cache, no entry, or one that cannot
    be used: then a PlanCacheWarning says why, and the caller plans anew and
    writes it again). The caller checks the signatures against the program."""
    if directory is None:
        return None
    path = os.path.join(directory, key + ".json")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):  # no entry (yet)
        return None
    except OSError as e:
        warnings.warn(PlanCacheWarning(f"sj.jit: plan cache entry {path} unreadable ({e})"), stacklevel=4)
        return None
    try:
        # UnicodeDecodeError and JSONDecodeError are ValueErrors; a file nested
        # deeper than the parser recurses is no entry either
        return parse_entry(json.loads(data.decode("utf-8")), key, n_ops)
    except (ValueError, RecursionError, SBPError) as e:
        warnings.warn(
            PlanCacheWarning(f"sj.jit: plan cache entry {path} ignored ({e}); planning anew"), stacklevel=4
        )
        return None


def store(directory: str | None, key: str, entry: Entry, n_ops: int) -> None:
    """Write ``entry`` atomically (a temporary file in the directory renamed
    over the entry); a directory that cannot be written gets a warning."""
    if directory is None:
        return
    text = entry.to_json(key, n_ops)
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, key + ".json"))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as e:
        warnings.warn(PlanCacheWarning(f"sj.jit: plan cache {directory} not written ({e})"), stacklevel=4)


__all__ = [
    "cache_dir",
    "fingerprint",
    "load",
    "store",
    "parse_entry",
    "Entry",
    "PlanCacheWarning",
    "ENV",
    "SCHEMA",
]
