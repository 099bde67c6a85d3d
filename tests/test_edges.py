"""Edges of the semantics: every (dtype, partial) pair, NaN / inf / integer
overflow, refusals at creation, and a seeded random boxing suite with a NumPy
oracle.

The random suite draws ``SBPJAX_EDGE_CASES`` cases (default 2000, the CI
size; ``SBPJAX_EDGE_CASES=20000`` for a nightly-size run) from a fixed seed
(``SBPJAX_EDGE_SEED``, default 0) over dtypes, partial kinds, 1-3-D and
permuted placements, uneven and 0-size shapes, transfers between placements,
eager boxing, boxing traced by ``jax.jit`` and by ``sj.jit`` (an output's
``out_sbp``), and creation from the logical value. Each configuration runs ``SBPJAX_EDGE_DRAWS``
(default 8) cases with fresh random data, so a compiled boxing serves several
cases (compiling dominates the time; ``SBPJAX_EDGE_DRAWS=1`` makes every case
a new configuration). Every case either builds and then boxes to exactly
the oracle's values, or is refused with an SBPError when the layout is made.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sbpjax as sj
from sbpjax.dtypes import partial_supported
from sbpjax.sbp import Partial, Split

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.int32,
    np.uint32,
    np.float16,
    jnp.bfloat16,
    np.float32,
    np.complex64,
    ml_dtypes.float8_e4m3fn,
]
DTYPES = [np.dtype(d) for d in DTYPES]
OPS = ("sum", "max", "min")


# ---------------------------------------------------------------------------
# The oracle: the logical tensor from local tensors, in each dtype's arithmetic
# ---------------------------------------------------------------------------


def _reduce(stack: np.ndarray, op: str, dtype: np.dtype) -> np.ndarray:
    """The op-reduction over axis 0 as the semantics define it: integers wrap in
    their own width, float sums in float64 (compared with a tolerance), max /
    min exact with NaN propagating (``np.max`` does, as ``jnp.max``)."""
    if op == "sum":
        if dtype.kind in "iu":
            return np.add.reduce(stack, axis=0, dtype=dtype)
        wide = np.complex128 if dtype.kind == "c" else np.float64
        with np.errstate(invalid="ignore"):  # inf + -inf is NaN, as on the devices
            return stack.astype(wide).sum(axis=0)
    if jnp.issubdtype(dtype, jnp.floating):
        wide = stack.astype(np.float64)
        return wide.max(axis=0) if op == "max" else wide.min(axis=0)
    return stack.max(axis=0) if op == "max" else stack.min(axis=0)


def oracle(locals_: np.ndarray, sbp, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(logical value, per element the largest |term| that went into it): axis 0
    applies first, so the last partial axis reduces first."""

    def go(prefix, axis):
        if axis == len(sbp):
            v = np.asarray(locals_[tuple(prefix)])
            mag = (
                np.abs(v.astype(np.complex128 if dtype.kind == "c" else np.float64))
                if v.dtype != np.bool_
                else np.zeros(v.shape)
            )
            return v, mag
        parts = [go(prefix + [i], axis + 1) for i in range(locals_.shape[axis])]
        s = sbp[axis]
        vals, mags = [p[0] for p in parts], [p[1] for p in parts]
        if isinstance(s, Split):
            return np.concatenate(vals, axis=s.dim), np.concatenate(mags, axis=s.dim)
        if isinstance(s, Partial):
            return _reduce(np.stack(vals), s.op, dtype), np.max(np.stack(mags), axis=0) * len(parts)
        return vals[0], mags[0]

    return go([], 0)


def assert_matches(
    got: np.ndarray, want: np.ndarray, mag: np.ndarray, dtype: np.dtype, exact: bool, msg: str
):
    """Exact where the oracle is exact (integers, bool, max/min, layouts without
    partials); float sums within ``eps(dtype)`` times the summed magnitudes of the
    terms (the error of adding them in any order), elementwise. Non-finite
    results must match in kind (NaN where NaN, the same infinity)."""
    assert got.shape == want.shape, msg
    if not jnp.issubdtype(dtype, jnp.inexact):
        np.testing.assert_array_equal(got, want, err_msg=msg)
        return
    wide = np.complex128 if dtype.kind == "c" else np.float64
    g, want = got.astype(wide), want.astype(wide)  # numpy sees NaN in bfloat16 only once widened
    if exact:
        np.testing.assert_array_equal(g, want, err_msg=msg)  # NaN == NaN here
        return
    finite = np.isfinite(want)
    np.testing.assert_array_equal(g[~finite], want[~finite], err_msg=msg)
    eps = float(ml_dtypes.finfo(dtype).eps)
    tol = 2 * eps * mag[finite] + 1e-30
    err = np.abs(g[finite] - want[finite])
    assert np.all(err <= tol), f"{msg}: max error {err.max() if err.size else 0} above {tol.min()}"


# ---------------------------------------------------------------------------
# Random data
# ---------------------------------------------------------------------------


def random_values(rng, shape, dtype: np.dtype, special: bool, ops) -> np.ndarray:
    """Values of ``dtype``; ``special`` sprinkles NaN / +-inf (floats) or the
    dtype's extremes (integers, so sums overflow and wrap)."""
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = (max(info.min, -100), min(info.max, 100))
        x = rng.integers(lo, hi + 1, size=shape, dtype=np.int64)
        if special:
            pick = rng.random(shape)
            x = np.where(pick < 0.2, info.max, np.where(pick > 0.8, info.min, x))
        return x.astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    # float16 sums of 8 terms stay far below its 65504 limit
    x = rng.standard_normal(shape) * (4.0 if dtype.itemsize <= 2 else 100.0)
    if special:
        pick = rng.random(shape)
        x = np.where(pick < 0.06, np.nan, np.where(pick > 0.97, np.inf, np.where(pick > 0.94, -np.inf, x)))
    return x.astype(dtype)


def random_locals(rng, pl, sbp, shape, dtype, special):
    """One local tensor per device for ``sbp`` (partials: independent terms;
    broadcast axes: equal copies), with the shapes the balanced split gives."""
    probe = sj.to_global(
        np.zeros(shape, np.float32), pl, tuple(s if isinstance(s, Split) else sj.B for s in sbp)
    )
    shapes = np.empty(pl.shape, object)
    for c, v in np.ndenumerate(probe.local_tensors()):
        shapes[c] = v.shape
    out = np.empty(pl.shape, object)
    varying = [a for a, s in enumerate(sbp) if not isinstance(s, sj.Broadcast)]
    cache: dict = {}
    for c in np.ndindex(*pl.shape):
        key = tuple(c[a] for a in varying)
        if key not in cache:
            cache[key] = random_values(rng, shapes[c], dtype, special, ())
        out[c] = cache[key]
    return out


# ---------------------------------------------------------------------------
# Placements and cases
# ---------------------------------------------------------------------------


def placements():
    d = np.array(jax.devices()[:8])
    return {
        "1d8": sj.placement(8, "x"),
        "1d3": sj.Placement(d[[5, 0, 6]], ("x",)),
        "1d4perm": sj.Placement(d[[3, 1, 0, 2]], ("x",)),
        "2x4": sj.placement((2, 4), ("x", "y")),
        "4x2perm": sj.Placement(d[[7, 2, 5, 0, 3, 6, 1, 4]].reshape(4, 2), ("a", "b")),
        "1x4": sj.Placement(d[4:8].reshape(1, 4), ("u", "v")),
        "2x2x2": sj.placement((2, 2, 2), ("x", "y", "z")),
    }


# transfers go from devices 0-3 (in another order) to the disjoint devices 4-7
TRANSFER_DST = {"1d4perm": ["2x2hi", "1d4hi"]}
SHAPES = [(), (0,), (5,), (16,), (3, 7), (8, 4), (0, 3), (2, 3, 5), (4, 1, 6)]


def random_sbp(rng, n_axes, ndim):
    out = []
    for _ in range(n_axes):
        r = rng.random()
        if r < 0.3 and ndim:
            out.append(sj.S(int(rng.integers(ndim))))
        elif r < 0.5:
            out.append(sj.B)
        else:
            out.append(sj.Partial(OPS[int(rng.integers(3))]))
    return tuple(out)


def _even(shape, pl, sbp) -> bool:
    ways: dict = {}
    for a, s in enumerate(sbp):
        if isinstance(s, Split):
            ways[s.dim] = ways.get(s.dim, 1) * pl.shape[a]
    return all(shape[d] % w == 0 for d, w in ways.items())


def _bits(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a``, with every NaN written as the same NaN (its sign and
    payload depend on the path, as in jnp, where NaN-ness does not)."""
    a = np.array(np.atleast_1d(a))
    if jnp.issubdtype(a.dtype, jnp.floating):
        a[np.isnan(a.astype(np.float32))] = np.nan
    return a.view(np.uint8)


def _supported(dtype, sbp):
    return all(partial_supported(dtype, s.op) for s in sbp if isinstance(s, Partial))


def run_config(rng, pls, k, draws, seen):
    """One configuration (placement, shape, dtype, layouts, mode) and ``draws``
    cases on it, each with its own random data (so the compiled boxing is
    reused; the values differ). Returns what each case checked."""
    name = str(rng.choice(list(pls)))
    pl = pls[name]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    src = random_sbp(rng, pl.ndim, len(shape))
    mode = str(
        rng.choice(["eager", "eager", "traced", "logical"] + (["transfer"] if name in TRANSFER_DST else []))
    )
    dst_pl = pl
    if mode == "transfer":
        d = np.array(jax.devices()[:8])
        dst_pl = {
            "2x2hi": sj.Placement(d[4:8].reshape(2, 2), ("p", "q")),
            "1d4hi": sj.Placement(d[[6, 4, 7, 5]], ("p",)),
        }[str(rng.choice(TRANSFER_DST[name]))]
    dst = random_sbp(rng, dst_pl.ndim, len(shape))
    if mode == "traced" and rng.random() < 0.5 and _even(shape, pl, src) and _even(shape, pl, dst):
        mode = "sj.jit"  # the whole-program compiler's boxing of an output (it needs even splits)
    traced = None
    if mode == "traced":
        traced = jax.jit(lambda v: v.to_global(sbp=dst))
    elif mode == "sj.jit":
        traced = sj.jit(lambda v: v, placement=pl, out_sbp=dst)
    out = []
    for j in range(draws):
        special = bool(rng.random() < 0.4)
        msg = (
            f"config {k} draw {j}: {dtype.name} {shape} on {name} {sj.format_sbp(src)} -> "
            f"{sj.format_sbp(dst)} ({mode}{', NaN/inf/extremes' if special else ''})"
        )
        outcome = _one_case(rng, pl, dst_pl, shape, dtype, src, dst, mode, traced, special, msg)
        out.append(outcome)
        if outcome == "value":
            seen.update(
                {("dtype", dtype.name), ("placement", name), ("mode", mode), ("shape", shape)}
                | {("kind", str(s)) for s in src + dst if isinstance(s, Partial)}
            )
    return out


def _one_case(rng, pl, dst_pl, shape, dtype, src, dst, mode, traced, special, msg):
    if mode == "logical":  # to_global from the logical value, then read back
        x = random_values(rng, shape, dtype, special, ())
        if not _supported(dtype, src):
            with pytest.raises(sj.SBPError, match=dtype.name):
                sj.to_global(x, pl, src)
            return "refused"
        t = sj.to_global(x, pl, src)
        assert t.dtype == dtype and t.sbp == src, msg
        assert_matches(t.numpy(), x, np.zeros(shape), dtype, True, msg)
        return "value"

    locs = random_locals(rng, pl, src, shape, dtype, special)
    if not _supported(dtype, src):
        with pytest.raises(sj.SBPError, match=dtype.name):
            sj.from_local_tensors(locs, pl, src, shape)
        return "refused"
    t = sj.from_local_tensors(locs, pl, src, shape)
    want, mag = oracle(locs, src, dtype)
    exact = not any(isinstance(s, Partial) and s.op == "sum" for s in src)
    assert_matches(t.numpy(), want, mag, dtype, exact, msg + " [source numpy()]")
    if not _supported(dtype, dst):
        with pytest.raises(sj.SBPError, match=dtype.name):
            traced(t) if mode == "sj.jit" else t.to_global(sbp=dst, placement=dst_pl)
        return "refused"
    u = traced(t) if traced is not None else t.to_global(sbp=dst, placement=dst_pl)
    assert u.dtype == dtype and u.sbp == dst and u.placement == dst_pl, msg
    got = u.numpy()
    assert_matches(got, want, mag, dtype, exact, msg)
    # host and device agree bit for bit: numpy() of a partial is the devices' reduction
    if any(isinstance(s, Partial) for s in dst):
        reduced = u.to_global(sbp=tuple(sj.B if isinstance(s, Partial) else s for s in dst))
        np.testing.assert_array_equal(_bits(got), _bits(reduced.numpy()), err_msg=msg)
    return "value"


def _run_suite(n, seed, draws):
    rng = np.random.default_rng(seed)
    pls = placements()
    counts = {"value": 0, "refused": 0}
    seen: set = set()
    k = 0
    while sum(counts.values()) < n:
        for outcome in run_config(rng, pls, k, min(draws, n - sum(counts.values())), seen):
            counts[outcome] += 1
        k += 1
    return counts, seen, k


def test_random_boxing_suite():
    """``SBPJAX_EDGE_CASES`` cases (2000 in CI), ``SBPJAX_EDGE_DRAWS`` (8) random
    data draws per configuration, from seed ``SBPJAX_EDGE_SEED`` (0)."""
    n = int(os.environ.get("SBPJAX_EDGE_CASES", "2000"))
    draws = int(os.environ.get("SBPJAX_EDGE_DRAWS", "8"))
    seed = int(os.environ.get("SBPJAX_EDGE_SEED", "0"))
    counts, seen, configs = _run_suite(n, seed, draws)
    assert counts["value"] + counts["refused"] == n
    # the draw covers both outcomes, and every dtype, kind, placement and mode, in earnest
    assert counts["value"] > n // 2 and counts["refused"] > n // 20, counts
    if n >= 2000:
        supported_dtypes = {d.name for d in DTYPES} - {"float8_e4m3fn"}  # S/B only, still a value case
        assert {("dtype", d) for d in supported_dtypes} <= seen
        assert {("kind", k) for k in ("P", "P(max)", "P(min)")} <= seen
        assert {("placement", p) for p in placements()} <= seen
        assert {("mode", m) for m in ("eager", "traced", "sj.jit", "logical", "transfer")} <= seen
        assert ("shape", (0, 3)) in seen and ("shape", ()) in seen and ("shape", (2, 3, 5)) in seen
    print(f"{n} cases on {configs} configurations: {counts}")


# ---------------------------------------------------------------------------
# The table, enforced at every place a layout is made
# ---------------------------------------------------------------------------

UNSUPPORTED = [
    (np.bool_, "sum"),
    (np.complex64, "max"),
    (np.complex64, "min"),
    (ml_dtypes.float8_e4m3fn, "sum"),
    (ml_dtypes.float8_e4m3fn, "max"),
]


@pytest.mark.parametrize("dtype,op", UNSUPPORTED, ids=lambda v: getattr(v, "__name__", str(v)))
def test_unsupported_pairs_are_refused_where_the_layout_is_made(dtype, op, pl8):
    dtype = np.dtype(dtype)
    kind = str(sj.Partial(op))
    x = np.zeros((8, 2), dtype)
    match = re.escape(kind) + rf" .*dtype {dtype.name}; "
    with pytest.raises(sj.SBPError, match=match):
        sj.to_global(x, pl8, sj.Partial(op))
    with pytest.raises(sj.SBPError, match=match):
        sj.from_local_tensors([x] * 8, pl8, sj.Partial(op), x.shape)
    t = sj.to_global(x, pl8, sj.S(0))
    with pytest.raises(sj.SBPError, match=match):
        t.to_global(sbp=sj.Partial(op))
    with pytest.raises(sj.SBPError, match=match):
        jax.jit(lambda v: v.to_global(sbp=sj.Partial(op)))(t)
    with pytest.raises(sj.SBPError, match=match):
        sj.jit(lambda v: v, placement=pl8, in_sbp=sj.Partial(op))(x)
    with pytest.raises(sj.SBPError, match=match):
        sj.jit(lambda v: v, placement=pl8, out_sbp=sj.Partial(op))(x)
    assert t.numpy().shape == x.shape  # the refused tensor is untouched


def test_refusals_name_the_alternative(pl8):
    with pytest.raises(sj.SBPError, match=r"astype\(jnp.int32\).*P\(max\)"):
        sj.to_global(np.zeros(8, bool), pl8, sj.P)
    with pytest.raises(sj.SBPError, match=r"no order: use P\(sum\)"):
        sj.to_global(np.zeros(8, np.complex64), pl8, sj.P_min)


def test_dtype_is_what_the_devices_hold(pl8):
    assert not jax.config.jax_enable_x64
    for given, held in [
        (np.float64, np.float32),
        (np.int64, np.int32),
        (np.uint64, np.uint32),
        (np.complex128, np.complex64),
    ]:
        x = np.arange(8).astype(given)
        for t in (
            sj.to_global(x, pl8, sj.S(0)),
            sj.from_local_tensors(list(x.reshape(8, 1)), pl8, sj.S(0), (8,)),
            sj.to_global(x, pl8, sj.P),
        ):
            assert t.dtype == held and t.physical.dtype == held and t.numpy().dtype == held
            np.testing.assert_array_equal(t.numpy(), x.astype(held))


def test_bool_max_min_are_any_and_all(pl24):
    rng = np.random.default_rng(3)
    terms = rng.random((2, 4, 5, 3)) < 0.3
    locs = np.empty((2, 4), object)
    for c in np.ndindex(2, 4):
        locs[c] = terms[c]
    for sbp in [(sj.P_max, sj.P_min), (sj.P_min, sj.P_max)]:
        t = sj.from_local_tensors(locs, pl24, sbp, (5, 3))
        inner = terms.all(axis=1) if sbp[1] == sj.P_min else terms.any(axis=1)
        want = inner.any(axis=0) if sbp[0] == sj.P_max else inner.all(axis=0)
        np.testing.assert_array_equal(t.numpy(), want)
        for dst in [(sj.B, sj.B), (sj.S(0), sj.S(1)), (sj.B, sj.S(0))]:
            np.testing.assert_array_equal(t.to_global(sbp=dst).numpy(), want)


# ---------------------------------------------------------------------------
# NaN, +-inf and integer overflow for every partial kind, host and device agreeing
# ---------------------------------------------------------------------------

FLOATS = [np.dtype(np.float16), np.dtype(jnp.bfloat16), np.dtype(np.float32)]


def _terms_with_specials(dtype, shape=(8, 6)):
    """Eight terms; column 0 has a NaN on one device, column 1 +inf, column 2
    -inf, column 3 both infinities, column 4 -0.0 and +0.0, the rest finite."""
    rng = np.random.default_rng(7)
    t = rng.standard_normal((8,) + shape).astype(np.float32)
    t[3, :, 0] = np.nan
    t[5, :, 1] = np.inf
    t[0, :, 2] = -np.inf
    t[1, :, 3], t[6, :, 3] = np.inf, -np.inf
    t[:, :, 4] = 0.0
    t[2, :, 4] = -0.0
    return t.astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_follow_jnp_on_every_path(dtype, op, pl8, pl24):
    terms = _terms_with_specials(dtype)
    ref = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[op]
    # jnp in float32: sums of these few terms are exact enough that NaN/inf placement is what matters
    want = np.asarray(ref(jnp.asarray(terms.astype(np.float32)), axis=0))
    kind = sj.Partial(op)
    t = sj.from_local_tensors(list(terms), pl8, kind, terms.shape[1:])
    host = t.numpy().astype(np.float32)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(host), np.isnan(want))
    np.testing.assert_array_equal(host[~finite], want[~finite])
    if op != "sum":
        np.testing.assert_array_equal(host, want)  # max/min exact, NaN where jnp has NaN
    for dst in [sj.B, sj.S(0), sj.S(1)]:
        dev = t.to_global(sbp=dst).numpy()
        np.testing.assert_array_equal(_bits(dev), _bits(t.numpy()))  # bit for bit
    # the path: a NaN inside S(0) -> P(op) -> B
    x = terms[0].astype(np.float32).astype(dtype)
    x[2, 0] = np.nan
    out = sj.to_global(x, pl8, sj.S(0)).to_global(sbp=kind).to_global(sbp=sj.B).numpy()
    np.testing.assert_array_equal(out.astype(np.float32), x.astype(np.float32))  # NaN == NaN for bfloat16 too
    # 2-D: reduce over both axes (one group) and one axis at a time
    locs = np.empty((2, 4), object)
    for i, c in enumerate(np.ndindex(2, 4)):
        locs[c] = terms[i]
    t2 = sj.from_local_tensors(locs, pl24, (kind, kind), terms.shape[1:])
    for dst in [(sj.B, sj.B), (sj.S(0), kind), (kind, sj.S(1)), (sj.S(1), sj.S(0))]:
        got = t2.to_global(sbp=dst).numpy().astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(got[~finite], want[~finite])
        if op != "sum":
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["max", "min"])
def test_sj_jit_outputs_keep_nan(op, pl8):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    x[5, 1] = np.nan
    red = jnp.max if op == "max" else jnp.min
    # a reduction over the split dim gives P(op) inside; out_sbp=B reduces it on the devices
    f = sj.jit(lambda v: red(v, axis=0), placement=pl8, in_sbp=sj.S(0), out_sbp=sj.B)
    np.testing.assert_array_equal(f(x).numpy(), np.asarray(red(jnp.asarray(x), axis=0)))
    # a partial input reduced by the program
    t = sj.from_local_tensors(list(x), pl8, sj.Partial(op), (4,))
    g = sj.jit(lambda v: v * 1.0, placement=pl8, out_sbp=sj.B)
    np.testing.assert_array_equal(g(t).numpy(), np.asarray(red(jnp.asarray(x), axis=0)))
    np.testing.assert_array_equal(t.numpy(), g(t).numpy())


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint8, np.int16, np.int32, np.uint32], ids=lambda d: d.__name__
)
@pytest.mark.parametrize("op", OPS)
def test_integer_extremes_and_wraparound(dtype, op, pl8, pl24):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(11)
    terms = rng.integers(info.min, info.max, size=(8, 7, 3), dtype=np.int64, endpoint=True).astype(dtype)
    terms[:, 0, 0] = info.max  # eight times the largest value: wraps
    terms[:, 1, 0] = info.min
    terms[2, 2, :] = info.max
    terms[4, 2, :] = info.min
    want = _reduce(terms, op, np.dtype(dtype))
    if op == "sum":  # the wrap-around the docs promise: int8 100 + 100 = -56
        assert want.dtype == dtype
    kind = sj.Partial(op)
    t = sj.from_local_tensors(list(terms), pl8, kind, (7, 3))
    np.testing.assert_array_equal(t.numpy(), want)
    for dst in [sj.B, sj.S(0), sj.S(1)]:
        np.testing.assert_array_equal(t.to_global(sbp=dst).numpy(), want)
    locs = np.empty((2, 4), object)
    for i, c in enumerate(np.ndindex(2, 4)):
        locs[c] = terms[i]
    mixed = (sj.P_min, kind)  # the int8 (P(min), P) case among them
    t2 = sj.from_local_tensors(locs, pl24, mixed, (7, 3))
    inner = _reduce(terms.reshape(2, 4, 7, 3).swapaxes(0, 1), op, np.dtype(dtype))
    want2 = inner.min(axis=0)
    for dst in [(sj.B, sj.B), (sj.S(0), sj.B), (sj.B, sj.S(1))]:
        np.testing.assert_array_equal(t2.to_global(sbp=dst).numpy(), want2)
    np.testing.assert_array_equal(t2.numpy(), want2)


def test_int8_sum_wraps_as_documented(pl8):
    t = sj.from_local_tensors(
        [np.array([100], np.int8), np.array([100], np.int8)] + [np.zeros(1, np.int8)] * 6, pl8, sj.P, (1,)
    )
    assert t.numpy().tolist() == [-56] and t.to_global(sbp=sj.B).numpy().tolist() == [-56]


# ---------------------------------------------------------------------------
# sj.jit in_sbp / out_sbp: one reading for SBP values and text
# ---------------------------------------------------------------------------


def test_in_sbp_objects_and_text_mean_the_same(pl8, pl24):
    x, y = np.arange(64.0, dtype=np.float32).reshape(8, 8), np.ones((8, 8), np.float32)

    def seen(pl, spec, *args):
        f = sj.jit(lambda *a: a, placement=pl, in_sbp=spec)
        return [t.sbp for t in f(*args)]

    # 1-D placement: a tuple of single SBPs of another length is one per argument
    assert seen(pl8, (sj.S(0), sj.B), x, y) == seen(pl8, ("S(0)", "B"), x, y) == [(sj.S(0),), (sj.B,)]
    # one entry per placement axis: one nd-SBP for every argument, objects or text
    assert (
        seen(pl24, (sj.S(0), sj.B), x, y)
        == seen(pl24, ("S(0)", "B"), x, y)
        == seen(pl24, "S(0), B", x, y)
        == [(sj.S(0), sj.B)] * 2
    )
    # a string is always one nd-SBP
    assert seen(pl8, "S(1)", x, y) == [(sj.S(1),)] * 2
    assert seen(pl24, ((sj.S(0), sj.B), "B, S(1)"), x, y) == [(sj.S(0), sj.B), (sj.B, sj.S(1))]


def test_ambiguous_in_sbp_is_an_error(pl24):
    x = np.ones((8, 4), np.float32)
    with pytest.raises(sj.SBPError, match="mixes single SBPs"):
        sj.jit(lambda a, b: a, placement=pl24, in_sbp=(sj.S(0), "B, S(1)"))(x, x)
    with pytest.raises(sj.SBPError, match="has 3 entries but the placement has 2 axes"):
        sj.jit(lambda a, b, c: a, placement=pl24, in_sbp=("S(0)", "B", "B"))(x, x, x)


def test_two_axis_layout_on_a_one_axis_placement_says_why(pl8):
    """An array's layout written for a 2-D placement, given on a 1-D one, is
    read as one SBP per value (the rule above): the structure error says so
    and how to write it."""
    x, w = np.ones((8, 16), np.float32), np.ones((16, 4), np.float32)
    f = sj.jit(lambda a, b: a @ b, placement=pl8, in_sbp=((sj.B, sj.S(1)), (sj.S(0),)))
    with pytest.raises(
        sj.SBPError, match=r"one axis, so \(B, S\(1\)\) is read as one SBP for each of 2 values"
    ):
        f(x, w)
    # no hint where no such tuple stands on one array: none given, one SBP per
    # argument with one argument too many, a tuple that matches a tuple of arrays
    wrong = [
        (lambda a, b: a @ b, ({"k": sj.B}, sj.S(0)), (x, w)),
        (lambda a, b, c: a, (sj.S(0), sj.B), (x, x, x)),
        (lambda p, d: p[0], ((sj.S(0), sj.B), {"k": sj.B}), ((x, x), {"j": x})),
    ]
    for fn, spec, args in wrong:
        with pytest.raises(sj.SBPError, match="does not match the structure") as info:
            sj.jit(fn, placement=pl8, in_sbp=spec)(*args)
        assert "one axis" not in str(info.value), spec
