"""Rewrites of a traced program before the layout choice: op pairs that run
better as one op (a zero pad and a window sum or a convolution),
``jnp.roll`` as one op (or, where a split of its dim may be uneven, spelled
with ops whose split dims move few rows), ``split`` as slices, and a sum
with zero as its operand (``identity_operand``). Each keeps the program's values;
``emit(fn, atoms, nodes, cse)`` appends the equations of a small JAX
function (``trace._emit``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax.compiler.program import Const, Var
from sbpjax.rules.roll import roll

# ops that make a zero of a zero: a broadcast, reshape or cast of one
_ZERO_KEEPING = frozenset(["broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims"])


def _kind(dtype) -> str | None:
    """ "int" (integers and bools), "float" (real floats, bf16 too) or None."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys
        return None
    if jnp.issubdtype(dtype, jnp.bool_) or jnp.issubdtype(dtype, jnp.integer):
        return "int"
    return "float" if jnp.issubdtype(dtype, jnp.floating) else None


def _constant_zero(value) -> tuple | None:
    """``(kind, negative)`` where every element of ``value`` is one zero of a
    real or integer dtype (for floats, every one of the same sign), else None."""
    value = np.asarray(value)
    kind = _kind(value.dtype)
    if kind is None or value.size == 0 or not np.all(value == 0):
        return None
    if kind == "int":
        return "int", False
    signs = set(np.signbit(value.astype(np.float32)).reshape(-1).tolist())
    return ("float", signs.pop()) if len(signs) == 1 else None


def zero_made(eqn, ins, zeros: dict) -> tuple | None:
    """The zero that ``eqn`` makes of every element, as ``(kind, negative)``
    (see :func:`_constant_zero`), or None: a broadcast, reshape or cast of a
    zero constant or of a value ``zeros`` (id -> zero) records, to a real or
    integer dtype (a complex zero is not tracked: casting -0.0 gives +0j)."""
    if eqn.primitive.name not in _ZERO_KEEPING or not ins:
        return None
    a = ins[0]
    zero = _constant_zero(a.value) if isinstance(a, Const) else zeros.get(id(a))
    out = _kind(eqn.outvars[0].aval.dtype)
    if zero is None or out is None:
        return None
    if out == "int":
        return "int", False
    return ("float", False) if zero[0] == "int" else zero


def identity_operand(eqn, ins, zeros: dict):
    """The operand ``eqn`` gives back exactly, or None: ``x - (+0)`` (IEEE
    arithmetic keeps every x, -0 and NaN too), ``x + (-0)``, and an integer
    ``x + 0`` or ``x - 0``, where the result has ``x``'s shape and dtype
    (``zeros``: see :func:`zero_made`). Linen's ``RMSNorm`` subtracts a zero
    mean: the difference and the input were boxed alike for their two
    readers, priced twice where XLA, folding ``x - 0``, runs one all-to-all
    (a T5 layer on 2x4: 24,960 B planned, 12,672 B compiled). ``x + (+0)``
    is not folded: in IEEE arithmetic it makes -0 into +0."""
    name = eqn.primitive.name
    if name not in ("sub", "add", "add_any") or len(ins) != 2:
        return None
    out = eqn.outvars[0].aval
    for k in (1,) if name == "sub" else (1, 0):
        x, z = ins[1 - k], ins[k]
        zero = _constant_zero(z.value) if isinstance(z, Const) else zeros.get(id(z))
        if zero is None or isinstance(x, Const) or tuple(x.shape) != tuple(out.shape):
            continue
        if _kind(out.dtype) != zero[0] or x.dtype != out.dtype:
            continue
        if zero[0] == "float" and zero[1] != (name != "sub"):
            continue  # x - (+0) and x + (-0) only
        return x
    return None


def fuse_padded_windows(nodes, outputs, emit):
    """``reduce_window_sum(pad(x, 0, (lo, hi, interior)))`` as one
    ``reduce_window_sum(x)`` with that padding and ``base_dilation = interior
    + 1`` (the same zeros, in the same places). JAX writes the gradient of an
    average pool this way; a ``pad`` of a split dim changes its size, so the
    pair would gather the activation, where the fused window runs with a halo
    exchange (``sbpjax.rules.window``). Only where the padded value has no
    other use and no padding is negative."""
    readers = _readers(nodes, outputs)
    made = {id(o): n for n in nodes for o in n.outs}
    out = []
    for node in nodes:
        src = made.get(id(node.ins[0])) if node.name == "reduce_window_sum" else None
        p = node.eqn.params
        if (
            src is None
            or src.name != "pad"
            or len(readers[id(node.ins[0])]) != 1
            or not _zero_pad(src, made, interior=True)
            or any(tuple(c) != (0, 0) for c in p["padding"])
            or any(d != 1 for d in p["base_dilation"])
        ):
            out.append(node)
            continue
        cfg = src.eqn.params["padding_config"]
        window = (
            tuple(p["window_dimensions"]),
            tuple(p["window_strides"]),
            tuple((int(lo), int(hi)) for lo, hi, _ in cfg),
            tuple(int(i) + 1 for _, _, i in cfg),
            tuple(p["window_dilation"]),
        )
        fused: list = []
        emit(
            lambda x, w=window: jax.lax.reduce_window(x, np.zeros((), x.dtype), jax.lax.add, *w),
            [src.ins[0]],
            fused,
            {},
        )
        if len(fused) != 1 or fused[0].name != "reduce_window_sum":
            out.append(node)  # this JAX spells it otherwise: keep the pair
            continue
        out.extend(_in_place_of(node, fused))
    return out


def fuse_padded_convs(nodes, outputs, emit):
    """A zero pad into convolutions, and a crop of a convolution's result,
    as the convolutions' own padding (the same zeros in the same places):
    ``conv(pad(x, 0, (lo, hi, 0)), k)`` is a convolution of ``x`` padded
    ``lo``/``hi`` more, and ``pad(conv(x, k), _, (-a, -b, 0))`` (a crop, as
    JAX writes a pad's gradient) one padded ``a``/``b`` less where its window
    stride is 1. A user's ``jnp.pad`` before a "VALID" convolution is the
    common case: the pad makes a split dim's size uneven (16 rows on 8
    devices become 18), so the pair gathered the activation, where the fused
    convolution runs with a halo exchange (``sbpjax.rules.halo``). A 3x3
    convolution of a (4, 16, 16, 4) batch split by rows over 8 devices moved
    114,688 B, now 14,336 (GSPMD: 73,088); its train step (the kernel's
    gradient reads the padded value too, and the input's gradient is the
    crop of a convolution's result) 114,688 B, now 28,672 (GSPMD: 207,672).

    ``trace`` runs it after ``fuse_shifts``, which makes a slice of the
    padded value a pad of its own (``conv(xp) + xp[:, 1:-1, 1:-1]``: the
    convolution is then the pad's only reader).

    A pad is fused only where every reader takes it as a convolution input,
    on spatial dims, with no negative or interior padding and no input
    dilation of the convolution's own (an interior pad would leave windows
    the halo rule does not offer); a crop only where it undoes such a pad
    (``_undoing``), of a result nothing else reads, in the convolution's
    checkpoint region and branch."""
    readers = _readers(nodes, outputs)
    made = {id(o): n for n in nodes for o in n.outs}
    padded = {}
    for node in nodes:
        if node.name == "pad" and _zero_pad(node, made):
            uses = readers.get(id(node.outs[0]), [])
            if uses and all(_absorbs(r, k, node) for r, k in uses):
                padded[id(node.outs[0])] = node
    undone = {_undoing(pad) for pad in padded.values()}
    crops = {}
    for node in nodes:
        src = made.get(id(node.ins[0])) if node.name == "pad" else None
        if src is None or src.name != "conv_general_dilated" or len(readers.get(id(src.outs[0]), ())) != 1:
            continue
        if (node.region, node.branch) == (src.region, src.branch) and _undoing(node, crop=True) in undone:
            if _crops(node, src):
                crops[id(src.outs[0])] = node
    if not padded and not crops:
        return nodes
    out, fused_crops = [], set()
    for node in nodes:
        if id(node) in fused_crops:
            continue
        if node.name != "conv_general_dilated" or (
            id(node.ins[0]) not in padded and id(node.outs[0]) not in crops
        ):
            out.append(node)
            continue
        pad, crop = padded.get(id(node.ins[0])), crops.get(id(node.outs[0]))
        x = node.ins[0] if pad is None else pad.ins[0]
        params = dict(node.eqn.params, padding=_fused_padding(node, pad, crop))
        fused: list = []
        emit(
            lambda x, k, q=params, prim=node.eqn.primitive: prim.bind(x, k, **q), [x, node.ins[1]], fused, {}
        )
        if len(fused) != 1 or fused[0].name != "conv_general_dilated":
            out.append(node)  # this JAX spells it otherwise: keep the ops
            continue
        out.extend(_in_place_of(node, fused))
        if crop is not None:  # the fused convolution makes the crop's result, at the convolution's place
            out[-1].outs = list(crop.outs)
            fused_crops.add(id(crop))
    return out


def _fused_padding(conv, pad, crop) -> tuple:
    """``conv``'s padding with ``pad``'s of its input and ``crop``'s of its
    result (either None) added, spatial dim by spatial dim."""
    p = conv.eqn.params
    padding = [list(lh) for lh in p["padding"]]
    for op, spec in ((pad, "lhs_spec"), (crop, "out_spec")):
        if op is not None:
            cfg = op.eqn.params["padding_config"]
            for i, d in enumerate(getattr(p["dimension_numbers"], spec)[2:]):
                padding[i] = [padding[i][0] + cfg[d][0], padding[i][1] + cfg[d][1]]
    return tuple((int(lo), int(hi)) for lo, hi in padding)


def _undoing(pad, crop: bool = False) -> tuple:
    """What a pad does, as (the unpadded shape, its padding): for a crop
    (``crop``), the shape it makes and the padding that made it. JAX's
    gradient of a pad is the crop undoing it; only such crops are fused, as
    they give back a size the program had (a crop of an even split to an odd
    size would leave the fused convolution's pieces uneven)."""
    cfg = pad.eqn.params["padding_config"]
    if crop:
        return tuple(pad.outs[0].shape), tuple((-lo, -hi) for lo, hi, _ in cfg)
    return tuple(pad.ins[0].shape), tuple((lo, hi) for lo, hi, _ in cfg)


def _readers(nodes, outputs) -> dict:
    """{id(value): [(node, operand index)]}, a program output read by None."""
    readers: dict = {}
    for n in nodes:
        for k, a in enumerate(n.ins):
            if isinstance(a, Var):
                readers.setdefault(id(a), []).append((n, k))
    for a in outputs:
        if isinstance(a, Var):
            readers.setdefault(id(a), []).append((None, 0))
    return readers


def _zero_pad(node, made: dict, interior: bool = False) -> bool:
    """A pad by zeros (a constant, or a constant's ``convert_element_type``,
    as ``jnp.pad`` writes it), with no negative padding, and no interior
    padding unless ``interior``."""
    value = node.ins[1]
    src = made.get(id(value))
    if src is not None and src.name == "convert_element_type":
        value = src.ins[0]
    return (
        isinstance(value, Const)
        and np.asarray(value.value).item() == 0
        and all(
            lo >= 0 and hi >= 0 and (interior or i == 0) for lo, hi, i in node.eqn.params["padding_config"]
        )
    )


def _absorbs(reader, k: int, pad) -> bool:
    """Whether ``reader`` (None: a program output) takes ``pad``'s result
    as the input of a convolution whose own padding can hold the pad's."""
    if reader is None or reader.name != "conv_general_dilated" or k != 0:
        return False
    p = reader.eqn.params
    spatial = set(p["dimension_numbers"].lhs_spec[2:])
    cfg = pad.eqn.params["padding_config"]
    return all(d in spatial or tuple(c) == (0, 0, 0) for d, c in enumerate(cfg)) and all(
        v == 1 for v in p["lhs_dilation"]
    )


def _crops(pad, conv) -> bool:
    """Whether ``pad`` only cuts rows off spatial dims of ``conv``'s result
    where its windows move by one row (so one window less per row cut), no
    more than the convolution pads there (a crop of rows that read the
    input itself stays a crop)."""
    if conv.name != "conv_general_dilated":
        return False
    p = conv.eqn.params
    spatial = p["dimension_numbers"].out_spec[2:]
    cfg = [tuple(c) for c in pad.eqn.params["padding_config"]]
    if any(lo > 0 or hi > 0 or interior for lo, hi, interior in cfg) or all(c == (0, 0, 0) for c in cfg):
        return False
    if any(c != (0, 0, 0) and d not in spatial for d, c in enumerate(cfg)):
        return False
    return all(
        cfg[d] == (0, 0, 0) or (p["window_strides"][i] == 1 and lo + cfg[d][0] >= 0 and hi + cfg[d][1] >= 0)
        for i, (d, (lo, hi)) in enumerate(zip(spatial, p["padding"]))
    )


def _in_place_of(node, emitted: list) -> list:
    """``emitted`` (the equations of a rewrite, its results last, one
    equation each) standing for ``node``: those make ``node``'s results, and
    all of them are attributed to its line, checkpoint region and branch."""
    for e, o in zip(emitted[len(emitted) - len(node.outs) :], node.outs):
        e.outs = [o]
    for e in emitted:
        e.source, e.region, e.branch = node.source, node.region, node.branch
    return emitted


def rolls(nodes, emit, devices: int | None = None):
    """``concatenate([x[s:], x[:s]])`` along one dim (``jnp.roll``'s static
    spelling) as one ``roll`` op (``sbpjax.rules.roll``) where the dim's size
    is a multiple of ``devices`` (the placement's), so that every split of it
    is even: each device's rows that change pieces move in one permute, as
    GSPMD moves them. Elsewhere (an uneven split, or the placement unknown)
    as ``where(row < n - s, pad(x[s:], (0, s)), pad(x[:s], (n - s, 0)))``:
    along a split dim each slice and its pad are one pad (``fuse_shifts``),
    a shift or a cut (``sbpjax.rules.shifts``), each row that changes pieces
    moved once, the rows that wrap around in a permute of their own.
    (The rewrite sees the whole-array spelling only, before layouts exist.)"""
    made = {id(o): n for n in nodes for o in n.outs}
    out = []
    for node in nodes:
        parts = _roll_parts(node, made) if node.name == "concatenate" else None
        if parts is None:
            out.append(node)
            continue
        x, d, n, s = parts
        emitted: list = []
        if devices is not None and n % devices == 0:
            emit(lambda a, d=d, k=n - s: roll(a, k, d), [x], emitted, {})
            out.extend(_in_place_of(node, emitted))
            continue
        head = [(0, 0, 0)] * len(node.outs[0].shape)

        def shifted(a, b, d=d, n=n, s=s, head=head):
            lead, tail = list(head), list(head)
            lead[d], tail[d] = (0, s, 0), (n - s, 0, 0)
            zero = np.zeros((), a.dtype)
            rows = lax.broadcasted_iota(np.int32, a.shape[:d] + (n,) + a.shape[d + 1 :], d)
            return lax.select(rows < n - s, lax.pad(a, zero, lead), lax.pad(b, zero, tail))

        emit(shifted, list(node.ins), emitted, {})
        out.extend(_in_place_of(node, emitted))
    return out


def _roll_parts(node, made) -> tuple | None:
    """(x, dim, size, s) where ``node`` concatenates ``x[s:]`` and ``x[:s]``
    of one ``x`` along that dim (whole along every other)."""
    if len(node.ins) != 2 or not all(isinstance(a, Var) for a in node.ins):
        return None
    first, second = (made.get(id(a)) for a in node.ins)
    if first is None or second is None or first.name != "slice" or second.name != "slice":
        return None
    x = first.ins[0]
    d = node.eqn.params["dimension"]
    if second.ins[0] is not x:
        return None
    n = x.shape[d]
    s = first.eqn.params["start_indices"][d]
    for sl, lo, hi in ((first, s, n), (second, 0, s)):
        p = sl.eqn.params
        strides = p["strides"] or (1,) * len(x.shape)
        want_lo = tuple(lo if e == d else 0 for e in range(len(x.shape)))
        want_hi = tuple(hi if e == d else x.shape[e] for e in range(len(x.shape)))
        if (
            tuple(p["start_indices"]) != want_lo
            or tuple(p["limit_indices"]) != want_hi
            or any(st != 1 for st in strides)
        ):
            return None
    return (x, d, n, s) if 0 < s < n else None


def splits_as_slices(nodes, emit):
    """``split`` (``q, k, v = jnp.split(qkv, 3, axis=-1)``) as one slice per
    result: along a split dim a slice moves the rows that change pieces
    (``sbpjax.rules.shifts``), where the ``split`` rule keeps the dim whole,
    so a column-split fused projection was gathered, or its consumers moved
    to another layout, before its thirds were taken."""
    out = []
    for node in nodes:
        if node.name != "split":
            out.append(node)
            continue
        d, sizes = node.eqn.params["axis"], [int(z) for z in node.eqn.params["sizes"]]
        bounds = np.cumsum([0] + sizes)

        def cut(x, d=d, bounds=bounds):
            return tuple(lax.slice_in_dim(x, int(a), int(b), axis=d) for a, b in zip(bounds[:-1], bounds[1:]))

        emitted: list = []
        emit(cut, list(node.ins), emitted, {})
        if len(emitted) != len(node.outs) or any(e.name != "slice" for e in emitted):
            out.append(node)  # this JAX spells it otherwise: keep the split
            continue
        out.extend(_in_place_of(node, emitted))
    return out


def fuse_shifts(nodes, emit):
    """A slice or pad of a slice or pad, without interior padding or strides,
    as one pad: ``jnp.pad(x, ((3, 0),))[i:i + n]`` (a causal convolution
    written as shifted slices of a padded sequence), ``pad(x[:n - s], (s,
    0))`` (``rolls`` where a split may be uneven), and JAX's transposes of them. Along a split
    dim the pair moved rows twice across pieces of another size, where the
    one pad (a shift or a cut) moves each once. The first op stays while
    something else reads it."""
    made = {id(o): n for n in nodes for o in n.outs}
    out = []
    for node in nodes:
        src = made.get(id(node.ins[0])) if node.name in ("slice", "pad") else None
        fused = _composed(src, node) if src is not None and src.name in ("slice", "pad") else None
        if fused is None:
            out.append(node)
            continue
        cfg, value = fused
        emitted: list = []
        emit(lambda x, v, cfg=cfg: lax.pad(x, v, cfg), [src.ins[0], value], emitted, {})
        if len(emitted) != 1 or emitted[0].name != "pad":
            out.append(node)  # this JAX spells it otherwise: keep the pair
            continue
        made[id(node.outs[0])] = emitted[0]
        out.extend(_in_place_of(node, emitted))
    return out


def _as_padding(node) -> list | None:
    """A slice or pad as the (lo, hi) rows it adds per dim (negative: cut)."""
    if node.name == "pad":
        cfg = node.eqn.params["padding_config"]
        return None if any(c[2] for c in cfg) else [(int(lo), int(hi)) for lo, hi, _ in cfg]
    p, n = node.eqn.params, node.ins[0].shape
    if p["strides"] is not None and any(st != 1 for st in p["strides"]):
        return None
    return [(-int(a), int(b) - n[d]) for d, (a, b) in enumerate(zip(p["start_indices"], p["limit_indices"]))]


def _composed(first, second) -> tuple | None:
    """(padding config, padding value) of ``second`` applied to ``first``'s
    result as one pad of ``first``'s operand (an identity pad where the
    pair moves nothing), or None where the pair cuts rows and pads them back
    (which would read the operand where padding was), or pads with two
    values."""
    one, two = _as_padding(first), _as_padding(second)
    if one is None or two is None:
        return None
    values = [v.ins[1] for v in (first, second) if v.name == "pad"]
    if len(values) == 2 and not _same_value(*values):
        return None
    if not values or any(a1 < 0 < a2 or b1 < 0 < b2 for (a1, b1), (a2, b2) in zip(one, two)):
        return None
    return tuple((a1 + a2, b1 + b2, 0) for (a1, b1), (a2, b2) in zip(one, two)), values[0]


def _same_value(a, b) -> bool:
    if a is b:
        return True
    return (
        isinstance(a, Const)
        and isinstance(b, Const)
        and np.asarray(a.value).item() == np.asarray(b.value).item()
    )
