"""Checkpoints of global tensors with orbax-checkpoint, restorable into any layout.

    from sbpjax import checkpoint
    checkpoint.save("/ckpt/step_100", {"params": params, "step": 100})
    state = checkpoint.restore("/ckpt/step_100", {
        "params": {"w": checkpoint.layout(pl_1d, sj.S(1))},  # a new placement and nd-SBP
        "step": 0,                                            # a Python int comes back
    })

A checkpoint stores each global tensor as its *logical* array (orbax writes it
with tensorstore, each shard once), not as per-device pieces, so it can be read
back into any placement and nd-SBP: restoring only moves stored bytes, so it is
bit-exact.

Partials are reduced when saving: a ``P`` over an axis is boxed to ``B`` on that
axis first (an all-reduce), because a partial's value exists only as the sum (or
max, min) of its terms. Saving does it rather than refusing, like ``t.numpy()``.

Restoring reads only each device's own piece where JAX can express the layout:
an even S/B layout becomes a ``jax.ShapeDtypeStruct`` with the equivalent
``NamedSharding`` and orbax reads each shard straight onto its device. An uneven
split (the first ``size % p`` pieces one longer) has no ``NamedSharding`` in JAX
0.10, so those tensors are read whole into host memory once and laid out with
``sj.to_global`` (on several hosts each process reads the whole tensor). A
partial target is restored reduced, then boxed to the partial (free: B -> P
moves no data).

Atomicity: orbax writes into ``<path>.orbax-checkpoint-tmp-<time>`` and renames it
to ``path`` only when every array is written, so ``path`` either holds a whole
checkpoint or does not exist. :func:`save` checks the leaves before writing and
removes the temporary folder if orbax fails, so nothing half-written is left.

Integrity: :func:`save` then lists every file of the checkpoint with its size
and SHA-256 in ``sbpjax_manifest.json``. :func:`restore` checks them before
reading anything and raises :class:`CheckpointError` whose ``kind`` says which
of three things is wrong, naming the file: ``"missing"`` (no checkpoint at the
path), ``"incomplete"`` (a save that did not finish, or a file that is gone)
or ``"corrupted"`` (a file whose size or contents changed since the save, or
that orbax cannot read). A checkpoint without the manifest (written by another
tool) is read as it is; what orbax cannot read is then reported as corrupted.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np
from jax.sharding import NamedSharding

from sbpjax._errors import SBPError
from sbpjax.boxing.plan import normalized_layout
from sbpjax.checkpoint_files import CheckpointError, check_present, unfinished_saves, write_manifest
from sbpjax.dtypes import check_partial_dtype, is_key, key_impl
from sbpjax.layout import Geometry
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, Partial, normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, to_global

_NO_ORBAX = (
    "sbpjax.checkpoint needs orbax-checkpoint, which is not installed. "
    "Install it with: pip install 'sbpjax[checkpoint]' (or pip install orbax-checkpoint)."
)


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """Where and how to restore one global tensor: a placement and an nd-SBP.
    The logical shape and dtype come from the checkpoint. Make one with :func:`layout`."""

    placement: Placement
    sbp: object


def layout(placement: Placement, sbp) -> LayoutSpec:
    """A restore target for one leaf: lay the stored tensor out over ``placement`` as ``sbp``.

    ``checkpoint.layout(sj.placement(8, "x"), sj.S(1))``; a 1-D placement takes a bare SBP.
    """
    checked_placement(placement, "checkpoint.layout")
    normalize_nd_sbp(sbp, placement.ndim, None, "checkpoint.layout")  # split dims are checked at restore
    return LayoutSpec(placement, sbp)


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError:  # pragma: no cover - the test environment has orbax
        raise SBPError(_NO_ORBAX) from None
    return ocp


def _is_leaf(x) -> bool:
    """Leaves as this module sees them: a GlobalTensor is a pytree node for JAX
    (its physical array is the child), but a checkpoint stores its logical value."""
    return isinstance(x, (GlobalTensor, LayoutSpec))


def _flatten(tree) -> tuple[list, list, object]:
    """(leaf names, leaves, treedef). Names are orbax's (keys joined by '.'), so they
    match the checkpoint's metadata; empty nodes (None, {}) have no leaves."""
    ocp = _ocp()
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return [".".join(ocp.tree.str_keypath(kp)) for kp, _ in flat], [x for _, x in flat], treedef


def _reduced_sbp(sbp: tuple) -> tuple:
    return tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)


# -- save --------------------------------------------------------------------------

_SAVABLE = "a GlobalTensor, a jax.Array, a numpy array or scalar, a Python int or float"


def _savable(name: str, leaf):
    if isinstance(leaf, GlobalTensor):
        if isinstance(leaf.physical, jax.core.Tracer):
            raise SBPError(
                f"checkpoint.save: leaf '{name}' is a traced value (inside jax.jit or "
                "jax.grad); save concrete values, outside the jitted function."
            )
        leaf._check_alive(f"checkpoint.save of leaf '{name}'")  # a donated one: named by the call made
        reduced = _reduced_sbp(leaf.sbp)
        if reduced != leaf.sbp:  # a partial's value is the reduction of its terms
            leaf = leaf.to_global(sbp=reduced)
        return leaf.to_jax()
    if isinstance(leaf, jax.core.Tracer):
        raise SBPError(
            f"checkpoint.save: leaf '{name}' is a traced value (inside jax.jit or "
            "jax.grad); save concrete values, outside the jitted function."
        )
    if is_key(leaf):  # a typed PRNG key: its key data (restore wraps it again)
        return jax.random.key_data(leaf)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or type(leaf) in (int, float):
        return leaf
    raise SBPError(
        f"checkpoint.save: leaf '{name}' is a {type(leaf).__name__}; a checkpoint leaf "
        f"must be {_SAVABLE}. Convert it or leave it out of the saved tree."
    )


def save(path, tree) -> None:
    """Write ``tree`` (a pytree of global tensors, arrays and scalars) to the new folder ``path``.

    Partial tensors are reduced first (see the module docstring). ``path`` must not
    exist yet: write each checkpoint to its own folder, e.g. one per step.

        checkpoint.save(tmp / "step_1", {"w": t, "step": 1})
    """
    ocp = _ocp()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise SBPError(
            f"checkpoint.save: {path} already exists; save each checkpoint to a new "
            "folder (e.g. one per step) or delete the old one first."
        )
    names, leaves, treedef = _flatten(tree)
    if not leaves:
        raise SBPError(
            f"checkpoint.save: the tree to save into {path} has no leaves ({tree!r}); save a tree that holds "
            "arrays, global tensors or numbers."
        )
    for n, x in zip(names, leaves):
        if isinstance(x, (GlobalTensor, jax.Array, np.ndarray)) and 0 in np.shape(x):
            # checked before anything is written: orbax refuses it midway, from its own threads
            raise SBPError(
                f"checkpoint.save: leaf '{n}' has no elements (shape {tuple(np.shape(x))}), which orbax "
                "cannot save; leave it out of the saved tree (it holds no values to restore) and rebuild "
                "it from its shape."
            )
    item = jax.tree_util.tree_unflatten(treedef, [_savable(n, x) for n, x in zip(names, leaves)])
    before = unfinished_saves(path)
    try:
        ocp.PyTreeCheckpointer().save(path, args=ocp.args.PyTreeSave(item))
    except BaseException:
        # orbax leaves its temporary folder behind when a write fails; remove ours only
        for entry in unfinished_saves(path) - before:
            shutil.rmtree(os.path.join(os.path.dirname(path), entry), ignore_errors=True)
        raise
    if jax.process_index() == 0:
        write_manifest(path)


# -- restore -----------------------------------------------------------------------


def _saved_leaves(ocp, path: str) -> dict | None:
    """Leaf name -> orbax metadata (shape, dtype) of what the checkpoint holds;
    None when ``path`` holds no finished checkpoint."""
    if not os.path.isdir(path):
        return None
    meta = ocp.PyTreeCheckpointer().metadata(path)
    if meta is None or meta.item_metadata is None:
        return None
    flat = jax.tree_util.tree_leaves(
        meta.item_metadata.tree, is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "name")
    )
    return {m.name: m for m in flat}


def _check_names(path: str, saved: dict, wanted: list) -> None:
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the target has {_leaves(missing)} the checkpoint lacks: {_some(missing)}")
        if extra:
            parts.append(f"the checkpoint has {_leaves(extra)} the target lacks: {_some(extra)}")
        raise SBPError(
            f"checkpoint.restore({path}): the target's tree does not match the saved "
            f"tree; {'; '.join(parts)}. Give a target with the saved structure "
            f"(saved leaves: {_some(sorted(saved))})."
        )


def _leaves(names: list) -> str:
    return f"{len(names)} leaf" if len(names) == 1 else f"{len(names)} leaves"


def _some(names: list, shown: int = 8) -> str:
    """The first ``shown`` names, and how many more (a model's leaves run to hundreds)."""
    more = f", ... and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_shape_dtype(path: str, name: str, meta, shape, dtype) -> None:
    saved_shape, saved_dtype = tuple(meta.shape), np.dtype(meta.dtype)
    if saved_shape != tuple(shape) or saved_dtype != np.dtype(dtype):
        raise SBPError(
            f"checkpoint.restore({path}): leaf '{name}' was saved with shape {saved_shape} and dtype "
            f"{saved_dtype.name}, but the target asks for shape {tuple(shape)} and dtype "
            f"{np.dtype(dtype).name}. Restore into a target of the saved shape and dtype "
            "(checkpoint.layout(placement, sbp) takes them from the checkpoint), then convert."
        )


@dataclasses.dataclass
class _GlobalLeaf:
    """How one global tensor is read: its target layout, and whether orbax reads
    shards straight onto devices (``sharding``) or the whole array to host."""

    placement: Placement
    sbp: tuple
    shape: tuple
    dtype: np.dtype
    sharding: NamedSharding | None

    def finish(self, value) -> GlobalTensor:
        # the read layout is the target's with partials as B; B -> P moves no data
        t = to_global(value, self.placement, _reduced_sbp(self.sbp))
        return t.to_global(sbp=self.sbp)


def _plan_global(path, name, leaf, meta) -> _GlobalLeaf:
    if isinstance(leaf, GlobalTensor):
        _check_shape_dtype(path, name, meta, leaf.shape, leaf.dtype)
        placement, sbp = leaf.placement, leaf.sbp
    else:
        placement = leaf.placement
        sbp = normalize_nd_sbp(
            leaf.sbp, placement.ndim, len(meta.shape), f"checkpoint.restore: leaf '{name}'"
        )
    shape, dtype = tuple(meta.shape), np.dtype(meta.dtype)
    # checked before anything is read, naming the leaf
    check_partial_dtype(dtype, sbp, f"checkpoint.restore({path}): leaf '{name}'")
    read = normalized_layout(_reduced_sbp(sbp), len(shape), placement.shape)
    geom = Geometry(shape, placement.shape)
    sharding = None
    if geom.even(read):
        sharding = NamedSharding(placement.mesh, geom.partition_spec(read, placement.axis_names))
    return _GlobalLeaf(placement, sbp, shape, dtype, sharding)


def _restore_args(ocp, path, name, leaf, meta):
    """(orbax restore args, how to turn the value read into the restored leaf)."""
    if _is_leaf(leaf):
        plan = _plan_global(path, name, leaf, meta)
        if plan.sharding is not None:
            args = ocp.ArrayRestoreArgs(sharding=plan.sharding, global_shape=plan.shape, dtype=plan.dtype)
        else:
            args = ocp.RestoreArgs(restore_type=np.ndarray, dtype=plan.dtype)
        return args, plan.finish
    if isinstance(leaf, jax.Array) and is_key(leaf):  # saved as its key data
        impl, data = key_impl(leaf), jax.random.key_data(leaf)
        _check_shape_dtype(path, name, meta, data.shape, data.dtype)
        args = ocp.ArrayRestoreArgs(sharding=data.sharding, global_shape=data.shape, dtype=data.dtype)
        return args, lambda v: jax.random.wrap_key_data(v, impl=impl)
    if isinstance(leaf, jax.Array):
        _check_shape_dtype(path, name, meta, leaf.shape, leaf.dtype)
        return ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype), None
    if isinstance(leaf, (np.ndarray, np.generic)):
        _check_shape_dtype(path, name, meta, leaf.shape, leaf.dtype)
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype), (
            (lambda v: np.asarray(v, leaf.dtype)[()]) if isinstance(leaf, np.generic) else None
        )
    if type(leaf) in (int, float):
        kind = np.dtype(meta.dtype).kind
        if tuple(meta.shape) != () or (type(leaf) is int) != (kind in "iu"):
            raise SBPError(
                f"checkpoint.restore({path}): leaf '{name}' was saved with shape {tuple(meta.shape)} "
                f"and dtype {np.dtype(meta.dtype).name}, but the target is a Python {type(leaf).__name__}. "
                "Give a target leaf of the saved kind (an int for an integer scalar, a float for a "
                "floating one, an array otherwise)."
            )
        return ocp.RestoreArgs(restore_type=type(leaf)), None
    raise SBPError(
        f"checkpoint.restore: target leaf '{name}' is a {type(leaf).__name__}; a target "
        "leaf must be a GlobalTensor or checkpoint.layout(placement, sbp) (a global tensor "
        "comes back), a jax.Array (restored with its sharding), a numpy array or scalar, "
        "or a Python int or float."
    )


def restore(path, target):
    """Read the checkpoint at ``path`` into a tree shaped like ``target``.

    ``target`` has the saved tree's structure; each leaf says how to restore it:
    a ``GlobalTensor`` (its placement and nd-SBP; its shape and dtype must match
    the checkpoint), ``checkpoint.layout(placement, sbp)``, a ``jax.Array`` (its
    sharding), a numpy array or scalar, or a Python int or float.

        state = checkpoint.restore(tmp / "step_1", {"w": checkpoint.layout(pl, (sj.B, sj.S(1))), "step": 0})
    """
    ocp = _ocp()
    path = os.path.abspath(os.fspath(path))
    check_present(path)
    try:
        saved = _saved_leaves(ocp, path)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds on bad metadata
        saved, cause = None, e
    else:
        cause = None
    if saved is None:
        meta = os.path.join(path, "_METADATA")
        if not os.path.exists(meta):
            raise CheckpointError(
                f"checkpoint.restore: the checkpoint at {path} is incomplete: {meta} is "
                "missing. Save it again, or restore an earlier checkpoint.",
                "incomplete",
                meta,
            )
        raise CheckpointError(
            f"checkpoint.restore: the checkpoint at {path} is corrupted: orbax cannot read its "
            f"metadata ({meta} or the files it names)"
            + (f": {type(cause).__name__}: {cause}" if cause else "")
            + ".",
            "corrupted",
            meta,
        )
    names, leaves, treedef = _flatten(target)
    _check_names(path, saved, names)
    per_leaf = [_restore_args(ocp, path, n, x, saved[n]) for n, x in zip(names, leaves)]
    restore_args = jax.tree_util.tree_unflatten(treedef, [args for args, _ in per_leaf])
    # orbax takes the tree structure from the item; the restore args say what to read
    item = jax.tree_util.tree_unflatten(treedef, [0] * len(leaves))
    try:
        values = ocp.PyTreeCheckpointer().restore(
            path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
        )
    except Exception as e:  # noqa: BLE001 - tensorstore / orbax read errors
        if "tree structures do not match" in str(e):
            # the files passed the manifest's check and every leaf name matched:
            # the trees differ in their empty parts, which hold no leaf
            orbax_says = " ".join(str(e).split())[:400]
            raise SBPError(
                f"checkpoint.restore({path}): the target has the saved leaves but another tree "
                "structure around them, in parts that hold no leaf (an optax.adamw state holds an "
                "EmptyState where optax.adam's holds none). Restore into a target built as the saved "
                f"tree was (the same optimizer chain); the checkpoint itself is intact. (orbax: {orbax_says})"
            ) from e
        raise CheckpointError(
            f"checkpoint.restore: the checkpoint at {path} is corrupted: reading its arrays "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}).",
            "corrupted",
            None,
        ) from e
    read = treedef.flatten_up_to(values)
    return jax.tree_util.tree_unflatten(
        treedef, [v if finish is None else finish(v) for v, (_, finish) in zip(read, per_leaf)]
    )


__all__ = ["CheckpointError", "LayoutSpec", "layout", "restore", "save"]
