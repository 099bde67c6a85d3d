"""Static arguments of ``sj.jit``: ``static_argnums`` / ``static_argnames``.

As in ``jax.jit``: a static argument is a hashable Python value (a mode
string, a flag, a config dataclass) that selects the program rather than
being an input to it. Each distinct value compiles (and plans) a program of
its own; the value keys the compile cache, and the plan cache is keyed by the
traced program, which the value shapes. ``in_sbp`` describes the other
(dynamic) positional arguments, as ``jax.jit``'s ``in_shardings`` does;
``donate_argnums`` counts every positional argument, static ones included
(donating a static one is an error).

Names and positions are matched through the function's signature where it has
one, as ``jax.jit`` does: ``static_argnames=("mode",)`` also makes ``mode``
static when it is passed by position, and ``static_argnums=(1,)`` when the
second parameter is passed by name.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect

from sbpjax._errors import SBPError


@dataclasses.dataclass(frozen=True)
class StaticArgs:
    """Which arguments are static: positions (non-negative, or negative from
    the end of the call's positional arguments) and keyword names."""

    nums: tuple[int, ...] = ()
    names: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.nums or self.names)

    def split(self, args: tuple, kwargs: dict):
        """``(dynamic args, dynamic kwargs, key)``: the call without its static
        arguments, and the static values as a hashable key (positions
        resolved against this call) that ``bind`` puts back."""
        if not self:
            return args, kwargs, ()
        nums = {i + len(args) if i < 0 else i for i in self.nums}
        statics = tuple((i, args[i]) for i in sorted(nums) if 0 <= i < len(args))
        named = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.names))
        for where, value in [(f"positional argument {i}", v) for i, v in statics] + [
            (f"keyword argument {k!r}", v) for k, v in named
        ]:
            _check_hashable(value, where)
        dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        return dyn_args, dyn_kwargs, (len(args), statics, named)

    def dynamic_index(self, key, i: int) -> int | None:
        """Where positional argument ``i`` of the call sits among the dynamic
        ones, or None when it is static."""
        if not key:
            return i
        _, statics, _ = key
        static_positions = {j for j, _ in statics}
        if i in static_positions:
            return None
        return i - sum(1 for j in static_positions if j < i)

    def donated_leaves(self, donate_argnums: tuple, tree, key=()) -> tuple[int, ...]:
        """Flat leaf indices of the positional arguments in ``donate_argnums``,
        which count static arguments too; ``tree`` holds the call's dynamic
        ones, ``key`` the static values (``split``)."""
        if not donate_argnums:
            return ()
        arg_trees = tree.children()[0].children()
        n_args = key[0] if key else len(arg_trees)
        donated = set()
        for i in donate_argnums:
            if i >= n_args:
                raise SBPError(
                    f"sj.jit: donate_argnums names argument {i}, but the call passes {n_args} positional "
                    "argument(s). Donation covers positional arguments only (as jax.jit's donate_argnums)."
                )
            j = self.dynamic_index(key, i)
            if j is None:
                raise SBPError(
                    f"sj.jit: donate_argnums names argument {i}, which this call passes as a static "
                    "argument (static_argnums / static_argnames): a Python value, not a buffer to donate."
                )
            donated.add(j)
        out: list[int] = []
        start = 0
        for i, sub in enumerate(arg_trees):
            if i in donated:
                out.extend(range(start, start + sub.num_leaves))
            start += sub.num_leaves
        return tuple(out)


def bind(fn, key):
    """``fn`` taking the dynamic arguments only, the static ones of ``key``
    put back where the call had them."""
    if not key:
        return fn
    n_args, statics, named = key

    def with_statics(*dyn_args, **dyn_kwargs):
        it = iter(dyn_args)
        fixed = dict(statics)
        args = [fixed[i] if i in fixed else next(it) for i in range(n_args)]
        return fn(*args, **dyn_kwargs, **dict(named))

    return with_statics


def static_args(fn, static_argnums, static_argnames) -> StaticArgs:
    """The checked settings, each completed from ``fn``'s signature (the
    parameter a name or position refers to), as ``jax.jit`` does."""
    nums = _as_tuple(static_argnums, int, "static_argnums")
    names = _as_tuple(static_argnames, str, "static_argnames")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have none
        params = []
    positional = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    by_name = {p.name: p for p in params}
    takes_more = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    beyond = [i for i in nums if i >= len(positional) or i < -len(positional)]
    if params and beyond and not takes_more:
        raise SBPError(
            f"sj.jit: static_argnums={nums} names position(s) {beyond}, but {getattr(fn, '__name__', fn)!r} "
            f"takes {len(positional)} positional argument(s) ({positional}); count from 0."
        )
    for name in names:
        if (
            params
            and name not in by_name
            and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        ):
            raise SBPError(
                f"sj.jit: static_argnames names {name!r}, which {getattr(fn, '__name__', fn)!r} has no "
                f"parameter of (it has {[p.name for p in params]})."
            )
        if name in by_name and by_name[name].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise SBPError(
                f"sj.jit: static_argnames names {name!r}, a positional-only parameter; "
                f"give its position in static_argnums instead."
            )
    nums_all = set(nums) | {positional.index(n) for n in names if n in positional}
    names_all = set(names) | {
        positional[i]
        for i in nums
        if 0 <= i < len(positional) and by_name[positional[i]].kind is not inspect.Parameter.POSITIONAL_ONLY
    }
    return StaticArgs(tuple(sorted(nums_all)), tuple(sorted(names_all)))


def _as_tuple(value, kind, what: str) -> tuple:
    if value is None:
        return ()
    items = (value,) if isinstance(value, kind) else value
    try:
        items = tuple(items)
    except TypeError:
        items = (items,)
    bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise SBPError(f"sj.jit: {what} must be {kind.__name__}s or one {kind.__name__}, got {value!r}.")
    return items


def _check_hashable(value, where: str) -> None:
    try:
        hash(value)
    except TypeError as e:
        raise SBPError(
            f"sj.jit: static {where} is {value!r:.60} ({type(value).__name__}), which is not hashable ({e}). "
            "A static value keys the compile cache; pass a hashable one (a tuple rather than a list, a "
            "frozen dataclass), or make the argument dynamic (an array)."
        ) from None


def fingerprint_text(key) -> str:
    """The static values as text that is the same in every process: plain
    Python values (numbers, strings, None, enums and tuples of them) by their
    repr, other objects by their type only (their repr may hold an address)."""
    if not key:
        return ""
    n_args, statics, named = key
    return repr((n_args, [(i, _plain(v)) for i, v in statics], [(k, _plain(v)) for k, v in named]))


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes, enum.Enum)):
        return v
    if isinstance(v, (tuple, frozenset)):
        return type(v).__name__, [_plain(x) for x in (sorted(v, key=repr) if isinstance(v, frozenset) else v)]
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


__all__ = ["StaticArgs", "bind", "fingerprint_text", "static_args"]
