"""Reading Flax's own sharding annotations as nd-SBP.

Models written for ``jax.sharding`` say how parameters are laid out with a
``PartitionSpec``-like tuple per parameter: ``nnx.with_partitioning(init,
(None, "model"))``, Linen's ``nn.with_partitioning`` / ``nn.with_logical_partitioning``
(logical names such as ``("embed", "mlp")`` mapped to mesh axes by logical
axis rules, as in the Flax lm1b/wmt examples and MaxText). sbpjax reads them
so such a model needs no second annotation. The mapping:

* entry ``d`` naming placement axis ``a`` (directly, or through a rule
  ``(logical, a)``): that axis splits dim ``d``, ``S(d)`` at position ``a``;
* an entry naming several axes (``("x", "y")``) splits the dim over each of
  them, the first named being the outermost, which is how nd-SBP nests
  splits when the axes are named in placement order; the other order has no
  nd-SBP with the same device order and is refused;
* ``None``, or a logical name whose rule maps to ``None``: not split;
* placement axes named by no entry: ``B``.
Partial values have no PartitionSpec form; write them with ``sjf.with_sbp``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sbpjax._errors import SBPError
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Split

SPEC_KEYS = ("out_sharding", "sharding", "sharding_names")  # Flax NNX metadata names, newest first


def context_rules():
    """The logical axis rules active in Flax's context (``nnx.logical_axis_rules``
    / ``nn.logical_axis_rules``), or ``()``."""
    try:
        from flax.core import spmd

        return tuple(spmd.get_logical_axis_rules() or ())
    except (ImportError, AttributeError):
        return ()


def _mesh_axes(entry, names: Sequence[str], rules, where: str) -> tuple:
    """The placement axes one spec entry names, logical names resolved by ``rules``."""
    if entry is None:
        return ()
    items = tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
    out: list = []
    for item in items:
        if item is None:
            continue
        if item in names:
            out.append(item)
            continue
        target = next((t for logical, t in rules if logical == item), _MISSING)
        if target is _MISSING:
            raise SBPError(
                f"{where}: sharding name {item!r} is neither an axis of the placement {tuple(names)} "
                f"nor a logical name with a rule (rules: {list(rules) or 'none'}). Pass rules=[(name, "
                f"axis), ...] or create the model inside nnx.logical_axis_rules(...)."
            )
        targets = tuple(target) if isinstance(target, (tuple, list)) else (target,)
        bad = [t for t in targets if t is not None and t not in names]
        if bad:
            raise SBPError(
                f"{where}: the rule ({item!r}, {target!r}) maps {item!r} to {bad[0]!r}, which is not an axis "
                f"of the placement {tuple(names)}. Name one of its axes (or None) in the rule."
            )
        out.extend(t for t in targets if t is not None)
    return tuple(out)


_MISSING = object()


def sbp_from_spec(
    spec: Sequence[Any], placement: Placement, ndim: int, rules=(), where: str = "parameter"
) -> tuple:
    """The nd-SBP a PartitionSpec-like ``spec`` (one entry per dim) means on ``placement``."""
    names = placement.axis_names
    spec = tuple(spec)
    if len(spec) > ndim:
        raise SBPError(f"{where}: sharding {spec} has {len(spec)} entries for a parameter with {ndim} dims.")
    nd: list = [Broadcast()] * placement.ndim
    for d, entry in enumerate(spec):
        axes = _mesh_axes(entry, names, tuple(rules), where)
        index = [names.index(a) for a in axes]
        if index != sorted(index):
            raise SBPError(
                f"{where}: sharding {spec} splits dim {d} over {axes}, outermost first; an nd-SBP "
                f"nests splits in placement axis order {tuple(names)}, so name them in that order "
                "(or order the placement's axes that way)."
            )
        for a in index:
            if not isinstance(nd[a], Broadcast):
                raise SBPError(f"{where}: sharding {spec} uses placement axis '{names[a]}' twice.")
            nd[a] = Split(d)
    return tuple(nd)


def sbp_from_value(value, placement: Placement, where: str) -> tuple | None:
    """The nd-SBP of a parameter that is already a ``jax.Array`` sharded on this
    placement's mesh (Flax's eager sharding), else ``None``."""
    sharding = getattr(value, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None:
        return None
    same = tuple(mesh.axis_names) == tuple(placement.axis_names) and tuple(
        d.id for d in mesh.devices.flat
    ) == tuple(placement.device_ids)
    if not same:
        return None
    return sbp_from_spec(spec, placement, len(value.shape), (), where)


def sbp_from_metadata(metadata: dict, value, placement: Placement, rules, where: str) -> tuple | None:
    """An NNX Variable's ``out_sharding`` (or older names) as nd-SBP; logical
    names through ``rules``, the metadata's own, or Flax's context; failing
    that, the value's own sharding when it lives on this placement."""
    spec = next((metadata[k] for k in SPEC_KEYS if metadata.get(k) is not None), None)
    if spec is None:
        return None
    given = bool(rules)
    rules = tuple(rules or metadata.get("sharding_rules") or context_rules())
    try:
        return sbp_from_spec(spec, placement, len(getattr(value, "shape", ())), rules, where)
    except SBPError:
        # rules the caller gave that do not resolve are a mistake to report (a
        # misspelt axis), not a reason to read the layout off the value instead
        from_value = None if given else sbp_from_value(value, placement, where)
        if from_value is None:
            raise
        return from_value
