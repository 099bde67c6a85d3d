"""``sj.CompileOptions``: every setting of ``sj.jit``'s front end in one frozen object.

A plan is a pure function of the program, the placement, the layouts, the
cost model, these options and the sbpjax version (the plan cache keys on
all of them, :mod:`sbpjax.compiler.plan_cache`). Users pass them to
``sj.jit(..., options=sj.CompileOptions(...))``; tests pass them too, rather
than patching module globals. ``dataclasses.replace(options, field=value)``
makes a variant.

Each default is justified where it is used; the figures behind them are in
``docs/concepts/compiler.md``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math

from sbpjax._errors import SBPError

# The solver's work limit (``sbpjax.solver``'s ``effort``): a count of table
# entries and search steps, never seconds, so the same program gets the same
# plan on any machine under any load. See ``CompileOptions.effort``.
DEFAULT_EFFORT = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """Settings of the layout choice and the lowering.

    Layout choice:

    * ``effort``: the solver's deterministic work limit (table entries
      computed plus search steps) for the whole layout choice: the settling
      rounds, the bytes-alone solve of a second look (given half of what
      they left) and the ring-latency solve of ``fewer_collectives`` share it
      (``sbpjax.compiler.backend.solve_settled``). Plans are exact wherever the
      program's graph can be eliminated within it (``explain()`` prints the
      proven gap). Elsewhere a larger effort usually finds a cheaper plan, but
      not always: the tables settle along another path.
    * ``latency``: price each collective's launch latency (``alpha / beta``
      of its group from the cost model, in bytes) besides its bytes; False:
      bytes alone, ties broken by 1/64 B per collective. Where the priced
      plan's prices miss what runs (an exchange two ops share, reductions
      the lowering buckets), the plan solved by bytes alone may replace it
      (``sbpjax.compiler.second_looks.bytes_alone``).
    * ``launch_priced``: plan a boxing whose fewest-bytes plan borrows an
      axis it has nothing to do on (one the program leaves idle, or one the
      value is whole on before and after) by bytes plus latency
      (``sbpjax.compiler.propagator.Propagator.plan``).
    * ``zero_fill_weight``: the price of each byte a zero-fill (S -> P) adds
      to a device's blocks, as a fraction of a byte moved.
    * ``fewer_collectives``: after the bytes-first solve, solve again with
      each collective at its ring latency and keep that plan where it runs
      fewer collectives, is faster by the cost model and moves at most this
      share more bytes (or runs at most half the collectives for at most
      twice the bytes, with no larger estimated peak); 0 turns the second
      solve off. The same share bounds the bytes a latency-priced plan may
      trade for collectives against the plan solved by bytes alone
      (``second_looks.bytes_alone``).
    * ``tie_layers``: give the alike ops of repeated layers one decision
      (``sbpjax.compiler.classes.layer_classes``): fewer decisions, but a
      restriction (the first and last layers may want other layouts), and a
      harder problem for the solver: one decision read by every layer ties the
      layers together, so the exact elimination that solves an untied chain of
      layers in a second does not apply, and the solve spends its effort for a
      proven gap (a 3-layer GPT step: 3.9% after the default effort, where the
      untied step is proven optimal in 2 s). Off by default for that reason.

    Lowering:

    * ``bucketing``, ``bucket_bytes``, ``gather_share``: combined
      collectives (``sbpjax.compiler.buckets``).
    * ``roll_loops``: roll a written-out scan's alike iterations back into
      one loop (``sbpjax.compiler.loops``); ``switches``: run a written-out
      cond as a ``lax.switch`` (``sbpjax.compiler.switches``).
    * ``regather_min_saving``, ``regather_margin``: FSDP-style regathers
      (``sbpjax.compiler.regather``).

    Tracing:

    * ``unroll_limit``: loops and branches are written out while the flat
      program stays within this many equations per loop or branch
      (``sbpjax.compiler.trace``); ``loop_slices``: each written-out scan
      slices its stacked operands itself.
    """

    effort: int = DEFAULT_EFFORT
    latency: bool = True
    launch_priced: bool = True
    zero_fill_weight: float = 1 / 16
    fewer_collectives: float = 0.10
    tie_layers: bool = False
    bucketing: bool = True
    bucket_bytes: int = 25 * 2**20
    gather_share: float = 1 / 16
    roll_loops: bool = True
    switches: bool = True
    regather_min_saving: float = 0.05
    regather_margin: float = 0.05
    unroll_limit: int = 20_000
    loop_slices: bool = True

    def __post_init__(self):
        for name in ("effort", "bucket_bytes", "unroll_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise SBPError(f"sj.CompileOptions: {name} must be a positive int, got {v!r}.")
        for name in ("zero_fill_weight", "fewer_collectives", "gather_share", "regather_min_saving"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise SBPError(f"sj.CompileOptions: {name} must be a finite number >= 0, got {v!r}.")
        v = self.regather_margin
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise SBPError(f"sj.CompileOptions: regather_margin must be in [0, 1), got {v!r}.")
        for name in (
            "latency",
            "launch_priced",
            "tie_layers",
            "bucketing",
            "roll_loops",
            "switches",
            "loop_slices",
        ):
            if not isinstance(getattr(self, name), bool):
                raise SBPError(
                    f"sj.CompileOptions: {name} must be True or False, got {getattr(self, name)!r}."
                )

    def fingerprint(self) -> tuple:
        """The settings as plain data (a plan cache key's part)."""
        return tuple(sorted(dataclasses.asdict(self).items()))


DEFAULT_OPTIONS = CompileOptions()


def _named_settings_only(generated):
    """The dataclass's ``__init__``, with a setting it does not have an
    SBPError naming the ones it has (Python's TypeError names neither)."""
    names = [f.name for f in dataclasses.fields(CompileOptions)]

    @functools.wraps(generated)
    def init(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            close = {k: difflib.get_close_matches(k, names, n=1) for k in unknown}
            hints = "".join(f" ({k!r}: did you mean {c[0]!r}?)" for k, c in close.items() if c)
            raise SBPError(
                f"sj.CompileOptions has no setting {', '.join(map(repr, unknown))}{hints}; its settings are "
                f"{', '.join(names)}."
            )
        generated(self, *args, **kwargs)

    return init


CompileOptions.__init__ = _named_settings_only(CompileOptions.__init__)  # type: ignore[method-assign]


def checked_options(value, where: str) -> CompileOptions:
    """``value`` (None: the defaults) as CompileOptions, or an SBPError naming ``where``."""
    if value is None:
        return DEFAULT_OPTIONS
    if not isinstance(value, CompileOptions):
        raise SBPError(
            f"{where}: options must be an sj.CompileOptions (e.g. sj.CompileOptions(effort=...)), got {value!r}."
        )
    return value


__all__ = ["CompileOptions", "DEFAULT_OPTIONS", "DEFAULT_EFFORT", "checked_options"]
