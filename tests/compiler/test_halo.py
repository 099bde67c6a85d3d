"""Windows that slide across split dims: convolutions and pooling split along
image height or width run with a halo exchange, cumulative ops split along
their axis complete each piece with the totals before it.

Three kinds of check:
* the halo geometry (``sbpjax.rules.halo.halo``) against a NumPy window op
  computed on the whole array, over a sweep of sizes, strides, paddings and
  dilations (the oracle knows nothing of halos);
* ``sj.jit`` programs against the same program on one device, with the plan's
  bytes equal to the compiled program's collectives;
* a small CNN with activations split along height: bytes at most GSPMD's and
  at most gathering the input.
"""

import itertools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes
from jax import lax

import sbpjax as sj
from sbpjax._errors import SBPWarning
from sbpjax.rules.halo import Slide, halo

# -- the geometry, against NumPy -------------------------------------------------


def _window_op(x, w, sl: Slide):
    """out[o] = sum_j xp[o * stride + j * rhs_dil] * w[j], xp = x dilated then padded."""
    xd = np.zeros((len(x) - 1) * sl.lhs_dil + 1)
    xd[:: sl.lhs_dil] = x
    xp = np.concatenate([np.zeros(max(sl.lo, 0)), xd, np.zeros(max(sl.hi, 0))])
    xp = xp[max(-sl.lo, 0) : len(xp) - max(-sl.hi, 0)]
    span = (len(w) - 1) * sl.rhs_dil + 1
    m = (len(xp) - span) // sl.stride + 1
    return np.array([sum(xp[o * sl.stride + j * sl.rhs_dil] * w[j] for j in range(len(w))) for o in range(m)])


def _out_len(sl: Slide) -> int:
    dilated = (sl.n - 1) * sl.lhs_dil + 1 + sl.lo + sl.hi
    return (dilated - ((sl.k - 1) * sl.rhs_dil + 1)) // sl.stride + 1


def _piece_with_halo(x, i, n_l, h):
    """Device i's piece of x with its halo: zeros past either end of x; where
    the windows drift from the pieces, the ``span`` rows device i reads from
    ``start + i * drift``."""
    lo, hi = i * n_l - h.left, (i + 1) * n_l + h.right
    out = np.zeros(hi - lo)
    src_lo, src_hi = max(lo, 0), min(hi, len(x))
    out[src_lo - lo : src_hi - lo] = x[src_lo:src_hi]
    if h.drift:
        at = h.start + i * h.drift
        assert 0 <= at and at + h.span <= len(out), (h, i)
        out = out[at : at + h.span]
    return out


def _cases():
    for n, k, stride, lo, hi, lhs_dil, rhs_dil in itertools.product(
        (8, 16, 24), (1, 2, 3, 5, 8, 12, 16), (1, 2, 3), (0, 1, 2), (0, 1, 2), (1, 2), (1, 2)
    ):
        sl = Slide(n, k, 0, stride, lo, hi, lhs_dil, rhs_dil)
        m = _out_len(sl)
        if m >= 1:
            yield Slide(n, k, m, stride, lo, hi, lhs_dil, rhs_dil)


@pytest.mark.parametrize("pieces", [2, 4])
def test_output_split_halo_equals_the_whole_window_op(pieces):
    rng = np.random.default_rng(0)
    runnable = drifting = 0
    for sl in _cases():
        h = halo(sl, pieces, split_window=False)
        if h is None:
            continue
        runnable += 1
        drifting += bool(h.drift)
        x, w = rng.normal(size=sl.n), rng.normal(size=sl.k)
        whole = _window_op(x, w, sl)
        n_l, m_l = sl.n // pieces, sl.m // pieces
        for i in range(pieces):
            piece = _piece_with_halo(x, i, n_l, h)
            local = Slide(len(piece), sl.k, m_l, sl.stride, *h.pad, sl.lhs_dil, sl.rhs_dil)
            got = _window_op(piece, w, local)
            np.testing.assert_allclose(
                got, whole[i * m_l : (i + 1) * m_l], rtol=1e-12, atol=1e-12, err_msg=str(sl)
            )
    assert runnable > 50  # the sweep reaches the runnable geometries, not only refusals
    assert drifting > 20  # and the windows that drift from the pieces ("VALID", their gradients)


@pytest.mark.parametrize("pieces", [2, 4])
def test_window_split_halo_sums_to_the_whole_window_op(pieces):
    rng = np.random.default_rng(1)
    runnable = drifting = 0
    for sl in _cases():
        h = halo(sl, pieces, split_window=True)
        if h is None:
            continue
        runnable += 1
        drifting += bool(h.drift)
        x, w = rng.normal(size=sl.n), rng.normal(size=sl.k)
        n_l, k_l = sl.n // pieces, sl.k // pieces
        total = np.zeros(sl.m)
        for i in range(pieces):
            piece = _piece_with_halo(x, i, n_l, h)
            local = Slide(len(piece), k_l, sl.m, sl.stride, *h.pad, sl.lhs_dil, sl.rhs_dil)
            total += _window_op(piece, w[i * k_l : (i + 1) * k_l], local)
        np.testing.assert_allclose(total, _window_op(x, w, sl), rtol=1e-12, atol=1e-12, err_msg=str(sl))
    assert runnable > 5 and drifting > 5


@pytest.mark.parametrize(
    "sl, split_window",
    [
        (Slide(16, 3, 16, 1, 1, 1), False),  # 3x3 "SAME"
        (Slide(16, 3, 8, 2, 0, 1), False),  # 3x3 "SAME", stride 2
        (Slide(16, 2, 8, 2, 0, 0), False),  # 2x2 pooling, stride 2
        (Slide(8, 3, 16, 1, 2, 1, lhs_dil=2), False),  # the input gradient of the stride-2 conv
        (Slide(16, 8, 3, 1, 0, 1, rhs_dil=2), True),  # its kernel gradient
        (Slide(16, 16, 3, 1, 1, 1), True),  # the 3x3 SAME conv's kernel gradient
    ],
)
def test_the_windows_models_use_are_runnable(sl, split_window):
    assert _out_len(sl) == sl.m
    assert halo(sl, 4, split_window) is not None


def test_a_halo_wider_than_a_neighbour_is_refused():
    # a 7-tap SAME window on pieces of 2 would need 3 rows from each side
    assert halo(Slide(8, 7, 8, 1, 3, 3), 4, split_window=False) is None
    assert halo(Slide(16, 7, 16, 1, 3, 3), 4, split_window=False) is not None


# -- sj.jit on window ops ----------------------------------------------------------

DN = ("NHWC", "HWIO", "NHWC")


def _conv(stride):
    return lambda x, k: lax.conv_general_dilated(x, k, (stride, stride), "SAME", dimension_numbers=DN)


def _run(fn, args, pl, in_sbp, rtol=1e-5):
    """``fn`` under sj.jit: values equal one device's, no SBPWarning, plan bytes
    equal the compiled collectives'. Returns the explanation."""
    f = sj.jit(fn, placement=pl, in_sbp=in_sbp)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        got = f(*args)
        e = f.explain(*args)
        compiled = f.lower(*args).compile()
    want = fn(*args)
    leaves = jax.tree.leaves(got, is_leaf=lambda t: isinstance(t, sj.GlobalTensor))
    for g, w in zip(leaves, jax.tree.leaves(want)):
        assert_close(g.numpy(), np.asarray(w), rtol=rtol)
    assert e.bytes == sum(c.bytes for c in sj.collectives(compiled)), str(e)
    return e


def _boxed_bytes(e) -> int:
    """Bytes moved by boxings (a constant sliced to a split is free)."""
    return sum(b.bytes for b in e.boxings)


PLACEMENTS = {
    "h4": ((4,), ("h",), (sj.S(1),)),
    "batch2_h4": ((2, 4), ("d", "h"), (sj.S(0), sj.S(1))),
    "h2_w2": ((2, 2), ("h", "w"), (sj.S(1), sj.S(2))),
    "h8": ((2, 4), ("a", "b"), (sj.S(1), sj.S(1))),
}


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("stride", [1, 2])
def test_conv_split_along_height_forward_and_gradients(where, stride):
    shape, names, xs = PLACEMENTS[where]
    pl = sj.placement(shape, names)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 16, 16, 3)).astype(np.float32)
    k = (0.3 * rng.normal(size=(3, 3, 3, 4))).astype(np.float32)
    conv = _conv(stride)
    rep = (sj.B,) * len(shape)
    e = _run(conv, (x, k), pl, (xs, rep))
    assert e.bytes > 0 and {c.what for _, c in e.comm} == {"halo_exchange"}
    assert _boxed_bytes(e) == 0  # the activation keeps its split: only the halo moves
    grads = jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1))
    _run(grads, (x, k), pl, (xs, rep), rtol=2e-5)


def _split_by_height(grid, seed, x_shape, k_shape):
    """A placement of ``grid`` (8: height over h; 2-D: the batch over d,
    height over h), the activation's and the kernel's layouts, and random
    ``x`` and ``k`` (a 0.3-scaled kernel)."""
    pl = sj.placement(grid, ("d", "h") if len(grid) == 2 else ("h",))
    xs = (sj.S(0), sj.S(1)) if len(grid) == 2 else (sj.S(1),)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=x_shape).astype(np.float32)
    k = (0.3 * rng.normal(size=k_shape)).astype(np.float32)
    return pl, xs, (sj.B,) * len(grid), x, k


def _pads_traced(fn, args) -> int:
    """The pads left in ``fn``'s traced program, after sbpjax's rewrites."""
    from sbpjax.compiler.trace import trace

    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    program = trace(fn, avals, jax.tree_util.tree_structure((tuple(0 for _ in args), {})))
    return sum(n.name == "pad" for n in program.nodes)


@pytest.mark.parametrize(
    "height, taps, stride, grid",
    [(18, 3, 1, (4, 2)), (34, 4, 2, (4, 2)), (72, 9, 1, (8,))],  # (4, 2): the batch over d, height over h
)
def test_valid_conv_windows_drift_from_the_pieces_and_move_only_halos(height, taps, stride, grid):
    """A "VALID" convolution's output is shorter than its input, so the
    windows of a device's output rows drift from its piece (16 output rows
    over 18 input rows on 2 pieces: the first device needs a row of the
    second, the second a row of the first). Each device receives the most rows
    any device needs from each neighbour and reads its window at its own
    offset; the input gradient (longer than its cotangent) and the kernel
    gradient (a window split) drift alike. It once gathered the input (a 3x3
    one of a (4, 18, 18, 3) batch on 4x2 moved 15,552 B against GSPMD's
    1,728 B); now the halos alone, and the gradients no more than GSPMD's."""
    pl, xs, rep, x, k = _split_by_height(grid, height, (4, height, 6, 3), (taps, 3, 3, 4))

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (stride, 1), "VALID", dimension_numbers=DN)

    e = _run(conv, (x, k), pl, (xs, rep))
    assert _boxed_bytes(e) == 0 and {c.what for _, c in e.comm} == {"halo_exchange"}
    assert e.bytes <= gspmd_bytes(conv, pl, (xs, rep), xs, (x, k))
    grads = jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1))
    e = _run(grads, (x, k), pl, (xs, rep), rtol=2e-5)
    assert e.bytes <= gspmd_bytes(grads, pl, (xs, rep), (xs, rep), (x, k))

    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, taps, 1, 1), (1, stride, 1, 1), "VALID")

    e = _run(pool, (x,), pl, (xs,))
    assert _boxed_bytes(e) == 0 and {c.what for _, c in e.comm} == {"halo_exchange"}


@pytest.mark.parametrize("grid", [(8,), (2, 4)])
@pytest.mark.parametrize("pads, stride", [((1, 1, 1, 1), 1), ((2, 0, 0, 1), 1), ((1, 2, 1, 2), 2)])
def test_an_explicit_pad_before_a_valid_conv_becomes_its_padding(grid, pads, stride):
    """``jnp.pad`` then a "VALID" convolution: the pad made the split height
    uneven (16 rows on 8 devices became 18), and the pair gathered the
    activation (114,688 B on 8 devices, GSPMD 73,088); fused into the
    convolution's padding, only halos move. Under ``jax.grad`` the kernel's
    gradient reads the padded value too and takes the same padding, and the
    input's gradient, a crop of a convolution's result, is that convolution
    padded less (the train step moved 114,688 B, GSPMD 207,672)."""
    pl, xs, rep, x, k = _split_by_height(grid, sum(pads), (4, 16, 16, 4), (3, 3, 4, 4))
    lo_h, hi_h, lo_w, hi_w = pads

    def conv(x, k):
        y = jnp.pad(x, ((0, 0), (lo_h, hi_h), (lo_w, hi_w), (0, 0)))
        return lax.conv_general_dilated(y, k, (stride, stride), "VALID", dimension_numbers=DN)

    assert _pads_traced(conv, (x, k)) == 0
    e = _run(conv, (x, k), pl, (xs, rep))
    if stride == 1:  # strided, the solver may rather leave the result partial or move the batch
        assert _boxed_bytes(e) == 0 and {c.what for _, c in e.comm} == {"halo_exchange"}
    assert e.bytes <= gspmd_bytes(conv, pl, (xs, rep), None, (x, k))
    grads = jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2), argnums=(0, 1))
    assert _pads_traced(grads, (x, k)) == 0  # the forward pad (two readers) and its transpose, a crop
    e = _run(grads, (x, k), pl, (xs, rep), rtol=2e-5)
    assert e.bytes <= gspmd_bytes(grads, pl, (xs, rep), None, (x, k))


@pytest.mark.parametrize("grid", [(8,), (2, 4)])
def test_a_padded_value_read_by_a_convolution_and_a_slice_of_it(grid):
    """``xp = jnp.pad(x)`` read by a "VALID" convolution and by
    ``xp[:, 1:-1, 1:-1]`` (x again, as a residual): the slice of the pad is
    rewritten first (``fuse_shifts``), so the convolution is the pad's only
    reader and takes its padding. The pad was gathered: 86,016 B on 8
    devices against GSPMD's 57,920."""
    pl, xs, rep, x, k = _split_by_height(grid, 11, (2, 32, 12, 4), (3, 3, 4, 4))

    def residual(x, k):
        xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        return lax.conv_general_dilated(xp, k, (1, 1), "VALID", dimension_numbers=DN) + xp[:, 1:-1, 1:-1]

    e = _run(residual, (x, k), pl, (xs, rep))
    assert _boxed_bytes(e) == 0 and {c.what for _, c in e.comm} == {"halo_exchange"}
    assert e.bytes <= gspmd_bytes(residual, pl, (xs, rep), None, (x, k))


def test_pads_the_convolution_rewrite_leaves_alone():
    """A pad of a multi-output op's second result (``top_k``'s indices; the
    rewrite once read the first result's readers and raised a KeyError), a
    pad by a nonzero value, and a crop of a convolution's result that undoes
    no pad (fused, it would leave 14 rows on 8 devices: twice the bytes)
    keep their own ops and their values."""
    pl8, xs, rep, x, k = _split_by_height((8,), 5, (4, 16, 16, 4), (3, 3, 4, 4))

    def conv(x, k, pad="SAME"):
        return lax.conv_general_dilated(x, k, (1, 1), pad, dimension_numbers=DN)

    programs = {
        "top_k indices": lambda x, k: jnp.pad(lax.top_k(x, 2)[1], ((0, 0), (0, 0), (0, 0), (1, 1))),
        "pad by one": lambda x, k: conv(
            jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=1.0), k, "VALID"
        ),
        "odd crop": lambda x, k: lax.pad(conv(x, k), 0.0, ((0, 0, 0), (-1, -1, 0), (0, 0, 0), (0, 0, 0))),
    }
    for name, fn in programs.items():
        assert _pads_traced(fn, (x, k)) == 1, name
        _run(fn, (x, k), pl8, (xs, rep))


@pytest.mark.parametrize("grid", [(8,), (2, 4)])
def test_a_shift_and_a_halo_of_one_block_send_its_edge_rows_once(grid):
    """A "SAME" convolution and a one-row shift of the same activation send
    the same rows to the same neighbour: the lowering runs that permute once
    (XLA would merge the two anyway), and ``explain()`` counts it once (it
    counted 21,504 B on 8 devices where 14,336 B moved)."""
    pl, xs, rep, x, k = _split_by_height(grid, 3, (4, 16, 16, 4), (3, 3, 4, 4))

    def conv_and_shift(x, k):
        shifted = jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :-1]
        return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DN) + shifted[..., :1]

    e = _run(conv_and_shift, (x, k), pl, (xs, rep))  # explain == compiled
    conv_alone = _run(
        lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=DN),
        (x, k),
        pl,
        (xs, rep),
    )
    assert e.bytes == conv_alone.bytes
    assert e.bytes <= gspmd_bytes(conv_and_shift, pl, (xs, rep), xs, (x, k))


def test_a_kernel_gradient_reuses_the_forward_halo():
    """The forward conv and its kernel gradient read the same rows of the same
    activation: one exchange, counted once, as XLA runs it."""
    pl = sj.placement(4, "h")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 16, 16, 3)).astype(np.float32)
    k = rng.normal(size=(3, 3, 3, 4)).astype(np.float32)
    conv = _conv(1)
    e = _run(jax.grad(lambda k, x: jnp.sum(conv(x, k) ** 2)), (k, x), pl, ((sj.B,), (sj.S(1),)))
    exchanges = [c for d in e.propagation.decisions for c in d.comm]
    assert len(exchanges) == 4 and len(e.comm) == 2  # one ppermute per side, each made once
    # 3 devices receive one row of 2 x 16 x 3 floats from above, 3 from below
    assert e.bytes == 2 * 3 * (2 * 16 * 3 * 4)
    assert "shared with an earlier op" in str(e)


POOLS = {
    "max2x2": lambda y: nn.max_pool(y, (2, 2), (2, 2)),
    "max3x3_s2": lambda y: nn.max_pool(y, (3, 3), (2, 2), padding="SAME"),
    "avg3x3": lambda y: nn.avg_pool(y, (3, 3), (1, 1), padding="SAME"),
    "avg2x2": lambda y: nn.avg_pool(y, (2, 2), (2, 2)),
    "min3x3": lambda y: -nn.max_pool(-y, (3, 3), (1, 1), padding="SAME"),
}


@pytest.mark.parametrize("where", PLACEMENTS)
@pytest.mark.parametrize("pool", POOLS)
def test_pooling_split_along_height(where, pool):
    shape, names, xs = PLACEMENTS[where]
    pl = sj.placement(shape, names)
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
    e = _run(POOLS[pool], (x,), pl, (xs,))
    assert _boxed_bytes(e) == 0
    if pool in ("max2x2", "avg2x2"):
        assert e.bytes == 0  # windows inside pieces: nothing to exchange
    # gradients (select_and_scatter_add for a max pool) and tangents
    # (select_and_gather_add) keep the split too
    grad = _run(jax.grad(lambda y: jnp.sum(POOLS[pool](y) ** 2)), (x,), pl, (xs,))
    tangent = _run(lambda y: jax.jvp(POOLS[pool], (y,), (y * y,))[1], (x,), pl, (xs,))
    assert _boxed_bytes(grad) == 0 and _boxed_bytes(tangent) == 0


def test_max_pool_gradient_shares_the_forward_halo():
    """A 3x3 stride-2 max pool reads one row below each piece; its gradient
    reads that row and two above. The row below is sent once."""
    pl = sj.placement(4, "h")
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
    e = _run(jax.grad(lambda y: jnp.sum(POOLS["max3x3_s2"](y) ** 2)), (x,), pl, ((sj.S(1),),))
    row = 2 * 16 * 3 * 4  # one row of the (2, 16, 16, 3) activation
    pooled_row = 2 * 8 * 3 * 4  # one row of the pooled gradient
    assert e.bytes == 3 * (1 + 2) * row + 3 * 1 * pooled_row


def test_average_pool_gradient_keeps_the_split():
    """JAX writes an average pool's gradient as a pad and a window sum; the two
    run as one padded window (a pad of a split dim would gather it)."""
    pl = sj.placement(4, "h")
    x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
    e = _run(jax.grad(lambda y: jnp.sum(POOLS["avg3x3"](y) ** 2)), (x,), pl, ((sj.S(1),),))
    assert _boxed_bytes(e) == 0 and "pad" not in [op for op, *_ in e.ops]


CUMULATIVE = {
    "cumsum": lambda v: jnp.cumsum(v, axis=1),
    "cumsum_reverse": lambda v: lax.cumsum(v, axis=1, reverse=True),
    "cumprod": lambda v: jnp.cumprod(v, axis=1),
    "cummax": lambda v: lax.cummax(v, axis=1),
    "cummin_reverse": lambda v: lax.cummin(v, axis=1, reverse=True),
    "cumlogsumexp": lambda v: lax.cumlogsumexp(v, axis=1),
}


@pytest.mark.parametrize("op", CUMULATIVE)
@pytest.mark.parametrize("where", ["h4", "h8"])
def test_cumulative_ops_along_the_split_dim(op, where):
    shape, names, xs = PLACEMENTS[where]
    pl = sj.placement(shape, names)
    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(3, 16, 5)).astype(np.float32)
    fn = CUMULATIVE[op]
    f = sj.jit(fn, placement=pl, in_sbp=(xs,), out_sbp=xs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        got = f(x)
        e = f.explain(x)
    assert_close(got.numpy(), np.asarray(fn(x)), rtol=1e-5)
    assert _boxed_bytes(e) == 0 and [c.what for _, c in e.comm] == ["all_gather"]
    # every device gathers one row (3 x 5 values) from each other piece
    p = int(np.prod(shape))
    assert e.bytes == p * (p - 1) * 3 * 5 * 4
    assert e.bytes == sum(c.bytes for c in sj.collectives(f.lower(x).compile()))


@pytest.mark.parametrize("rows", [256, 8])
@pytest.mark.parametrize(
    "first, second, exchanges",
    [
        ("cummax", "cummin_reverse", 2),
        ("cumsum", "cumsum_reverse", 2),
        ("cumsum", "cumprod", 2),
        ("cumsum", "cumsum", 1),  # the same op twice: its totals gathered once
    ],
)
def test_two_cumulative_ops_of_one_operand_gather_their_own_totals(first, second, exchanges, rows):
    """Each op gathers its own pieces' totals (a cummax its maxima, a cummin its
    minima): explain() counts every gather the program runs. It once took the
    second op's gather for the first's (the same operand and layout), counting
    half the bytes the compiled program moves. Pieces of one row (``rows`` 8 on
    8 devices) are their own totals whatever the op: one gather serves both.

    32 rows per device, so that the split wins by price: each gather of totals
    pays a collective's launch (100 kB on the default cost model), and with
    fewer rows one all-gather of the operand lets both ops run whole for less.
    With one row per device the two plans move the same bytes in one
    collective; either is right, and explain() must count what runs."""
    pl = sj.placement(8, "h")
    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(3, rows, 5)).astype(np.float32)

    def fn(v):
        return CUMULATIVE[first](v), CUMULATIVE[second](v)

    f = sj.jit(fn, placement=pl, in_sbp=((sj.S(1),),), out_sbp=((sj.S(1),), (sj.S(1),)))
    got, e = f(x), f.explain(x)
    for g, want in zip(got, fn(x)):
        assert_close(g.numpy(), np.asarray(want), rtol=1e-5)
    one_gather = 8 * 7 * 3 * 5 * 4  # every device gathers one row (3 x 5) from each other piece
    gathers = exchanges if rows > 8 else 1
    if rows > 8:
        assert [c.what for _, c in e.comm] == ["all_gather"] * gathers
    assert e.bytes == gathers * one_gather
    assert e.bytes == sum(c.bytes for c in sj.collectives(f.lower(x).compile()))


def test_an_op_that_communicates_pays_a_launch_per_collective_as_a_boxing_does():
    """A cumsum and its reverse on (8, 16) split along their axis over 8
    devices: kept split, each cumsum gathers its pieces' totals and each
    reversal permutes the pieces (4,608 B in 4 collectives). Priced by bytes
    alone (as until 2026-12) those exchanges looked cheaper than a boxing's
    collective, which pays a launch; priced alike,
    one all-to-all lets both run whole and another brings the result back:
    two collectives, 896 B."""
    pl = sj.placement(8, "x")
    x = np.random.default_rng(0).uniform(0.5, 1.5, size=(8, 16)).astype(np.float32)

    def fn(a):
        return jnp.cumsum(a, 1) + jnp.cumsum(a[:, ::-1], 1)[:, ::-1]

    f = sj.jit(fn, placement=pl, in_sbp=((sj.S(1),),), out_sbp=(sj.S(1),))
    got, e = f(x), f.explain(x)
    assert_close(got.numpy(), np.asarray(fn(x)), rtol=1e-5)
    assert e.comm == []
    assert e.bytes == 2 * 8 * 7 * (1 * 2 * 4)  # twice: every device receives a 1 x 2 block from each other
    compiled = sj.collectives(f.lower(x).compile())
    assert e.bytes == sum(c.bytes for c in compiled) and len(compiled) == 2


def test_cumsum_of_integers_along_the_split_dim(pl8):
    x = np.arange(64, dtype=np.int32).reshape(16, 4)
    f = sj.jit(lambda v: jnp.cumsum(v, axis=0), placement=pl8, in_sbp=(sj.S(0),), out_sbp=sj.S(0))
    np.testing.assert_array_equal(f(x).numpy(), np.cumsum(x, axis=0))


# -- a CNN split along height -------------------------------------------------------


def _cnn(params, x):
    y = jax.nn.relu(lax.conv_general_dilated(x, params["c1"], (1, 1), "SAME", dimension_numbers=DN))
    y = nn.max_pool(y, (2, 2), (2, 2))
    y = jax.nn.relu(lax.conv_general_dilated(y, params["c2"], (1, 1), "SAME", dimension_numbers=DN))
    y = jax.nn.relu(lax.conv_general_dilated(y, params["c3"], (2, 2), "SAME", dimension_numbers=DN))
    y = nn.avg_pool(y, (3, 3), (1, 1), padding="SAME")
    return jnp.mean(y**2)


def _cnn_params():
    rng = np.random.default_rng(0)
    shapes = {"c1": (3, 3, 3, 8), "c2": (3, 3, 8, 8), "c3": (3, 3, 8, 8)}
    return {k: (0.3 * rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["h4", "batch2_h4", "h2_w2"])
def test_cnn_split_along_height_moves_less_than_gspmd_and_gathering(where):
    shape, names, xs = PLACEMENTS[where]
    pl = sj.placement(shape, names)
    rep = (sj.B,) * len(shape)
    params = _cnn_params()
    x = np.random.default_rng(1).normal(size=(4, 32, 32, 3)).astype(np.float32)
    step = jax.value_and_grad(_cnn)
    in_sbp = ({k: rep for k in params}, xs)
    out_sbp = (rep, {k: rep for k in params})
    e = _run(step, (params, x), pl, in_sbp, rtol=2e-5)
    f = sj.jit(step, placement=pl, in_sbp=in_sbp, out_sbp=out_sbp)
    ours = f.explain(params, x).bytes
    assert ours == sum(c.bytes for c in sj.collectives(f.lower(params, x).compile()))
    assert e.bytes <= ours  # (out_sbp adds the gradients' reduction to B)

    gspmd = gspmd_bytes(step, pl, in_sbp, out_sbp, (params, x))

    # the alternative without halos: gather the input, run every layer on the other dims
    gathered = (
        sj.jit(lambda p, v: step(p, sj.constrain(v, rep)), placement=pl, in_sbp=in_sbp, out_sbp=out_sbp)
        .explain(params, x)
        .bytes
    )
    assert ours <= gspmd, (ours, gspmd)
    assert ours <= gathered, (ours, gathered)
