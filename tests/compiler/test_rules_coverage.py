"""Oracle tests for rules real models need: top-k routing, qkv splits,
``.at[].set``, pooling and its derivatives, products and logical reductions.

Each case runs under ``sj.jit`` on 8 devices with its input split where the
rule allows, and is compared with the same function on one device; no
SBPWarning may appear (nothing runs whole on every device), the compiled
program moves what the plan says, and a split the rule keeps moves nothing.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes
from jax import lax

import sbpjax as sj
from sbpjax._errors import SBPWarning

# on both CI legs (pyproject.toml's markers): each JAX release spells these functions with its own primitives
pytestmark = pytest.mark.jax_versions

S0, S1, S3, B = sj.S(0), sj.S(1), sj.S(3), sj.B


def _pool_max(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _pool_avg(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9.0


def _pool_absmax(x):  # a computation XLA has no named primitive for: generic reduce_window
    return lax.reduce_window(
        x, 0.0, lambda a, b: jnp.maximum(jnp.abs(a), jnp.abs(b)), (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
    )


def _grad(f):
    return jax.grad(lambda x: (f(x) ** 2).sum())


MAT = (16, 24)
STACK = (8, 6, 6)  # a batch of matrices, split by matrix


def _spd(x):
    """Each matrix of the batch made symmetric positive definite (well conditioned)."""
    return x @ jnp.swapaxes(x, -1, -2) + x.shape[-1] * jnp.eye(x.shape[-1])


IMG = (8, 6, 6, 8)  # NHWC
KERNEL = np.random.default_rng(1).normal(size=(3, 3, 4, 8)).astype(np.float32)  # HWIO, two feature groups


def _grouped_conv(x, w=KERNEL):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
    )


CASES = {
    "top_k": (lambda x: lax.top_k(x, 3), MAT, S0),
    "approx_max_k": (lambda x: lax.approx_max_k(x, 3)[0], MAT, S0),
    "split_qkv": (lambda x: [a * 2 for a in jnp.split(x, 3, axis=-1)], MAT, S0),
    "device_put": (lambda x: jax.device_put(x) * 2, MAT, S1),
    "scatter_set_rows": (lambda x: x.at[:, 0].set(1.0), MAT, S0),
    "scatter_set_cols": (lambda x: x.at[3].set(-1.0), MAT, S1),
    "reduce_prod": (lambda x: jnp.prod(x, axis=1), MAT, S0),
    "reduce_and_or": (lambda x: (jnp.all(x > -2, axis=1), jnp.any(x > 2, axis=1)), MAT, S0),
    # over the split dim: partial and (P(min)) / or (P(max)) on booleans, as a loss scaler's finite check
    "reduce_and_or_split_dim": (lambda x: (jnp.all(jnp.isfinite(x)), jnp.any(x > 2, axis=0)), MAT, S0),
    "max_pool_batch": (_pool_max, IMG, S0),
    "max_pool_channel": (_pool_max, IMG, S3),
    "max_pool_grad": (_grad(_pool_max), IMG, S0),
    "avg_pool_grad": (_grad(_pool_avg), IMG, S3),
    "generic_pool": (_pool_absmax, IMG, S0),
    "iterate_rows": (lambda x: [r * 2 for r in x.reshape(4, 4, 24)], MAT, S1),  # unstack on jax 0.12
    "stack": (lambda x: jnp.stack([x, 2 * x], axis=1), MAT, S1),
    "stack_leading": (lambda x: jnp.stack([x, 2 * x]), MAT, S0),
    "log2": (lambda x: jnp.log2(jnp.abs(x) + 1), MAT, S0),
    # a loop of total-order comparisons (le_to / lt_to) against a whole table
    "searchsorted": (lambda x: jnp.searchsorted(jnp.linspace(-2.0, 2.0, 9), x), MAT, S0),
    # transforms of trailing dims, batched over a split leading dim (sbpjax.rules.linalg)
    "rfft_rows": (lambda x: jnp.abs(jnp.fft.rfft(x, axis=1)), MAT, S0),
    "fft2_batch": (lambda x: jnp.fft.fft2(x).real, STACK, S0),
    "cholesky_batch": (lambda x: jnp.linalg.cholesky(_spd(x)), STACK, S0),
    "eigh_batch": (lambda x: jnp.linalg.eigvalsh(_spd(x)), STACK, S0),
    "svd_batch": (lambda x: jnp.linalg.svd(x, compute_uv=False), STACK, S0),
    "qr_batch": (lambda x: jnp.abs(jnp.linalg.qr(_spd(x))[1]), STACK, S0),
    "lu_batch": (lambda x: jax.scipy.linalg.lu_factor(_spd(x))[0], STACK, S0),
    # lowered by platform (lax.platform_dependent: a platform_index and a cond)
    "diagonal": (lambda x: jnp.diagonal(x[:, :16]) * 2, MAT, S0),
    "inv_batch": (lambda x: jnp.linalg.inv(_spd(x)), STACK, S0),  # custom_linear_solve, inlined
    "solve_batch": (lambda x: jnp.linalg.solve(_spd(x), x[..., :2]), STACK, S0),
    # its input gradient reorders the kernel's groups with reshape's `dimensions`
    # (a transpose); its kernel gradient is a convolution with batch groups
    "grouped_conv_input_grad": (_grad(_grouped_conv), IMG, S0),
    "grouped_conv_kernel_grad": (
        lambda x: jax.grad(lambda w: (_grouped_conv(x, w) ** 2).sum())(KERNEL),
        IMG,
        S0,
    ),
    "reshape_transposing": (lambda x: lax.reshape(x, (6, 4, 16), dimensions=(1, 0)), MAT, S0),
    "solve_triangular_batch": (
        lambda x: jax.scipy.linalg.solve_triangular(_spd(x), x[..., :2], lower=True),
        STACK,
        S0,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_keeps_the_split_and_matches_one_device(pl8, name):
    fn, shape, sbp = CASES[name]
    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    f = sj.jit(fn, placement=pl8, in_sbp=(sbp,))
    t = sj.to_global(x, pl8, sbp)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        got = f(t)
        compiled = f.lower(t).compile()
    want = jax.jit(fn)(x)
    for g, w in zip(
        jax.tree.leaves(got, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)), jax.tree.leaves(want)
    ):
        g = g.numpy()
        assert g.shape == w.shape and g.dtype == w.dtype
        if np.issubdtype(w.dtype, np.floating):
            assert_close(g, np.asarray(w), rtol=1e-5)
        else:
            np.testing.assert_array_equal(g, np.asarray(w))
    e = f.explain(t)
    assert sum(c.bytes for c in sj.collectives(compiled)) == e.bytes
    assert e.bytes == 0, str(e)  # the split is kept end to end: nothing moves


DN = ("NHWC", "HWIO", "NHWC")
DEPTHWISE = np.random.default_rng(4).normal(size=(3, 3, 1, 8)).astype(np.float32)  # 8 groups of a channel
PER_EXAMPLE_HEAD = np.random.default_rng(5).normal(size=(8, 3)).astype(np.float32)


def _depthwise(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DN, feature_group_count=8)


def _per_example_kernel_grads(w, x):
    """``vmap(grad)`` over the batch: JAX writes the per-example kernel
    gradients as one convolution with a feature group per example."""

    def one(w, x):
        h = jax.nn.relu(lax.conv_general_dilated(x[None], w, (1, 1), "SAME", dimension_numbers=DN))
        return jnp.sum(jnp.tanh(h.mean((1, 2)) @ PER_EXAMPLE_HEAD))

    return jax.vmap(jax.grad(one), in_axes=(None, 0))(w, x)


GROUPED = {
    # name: (function of (w, x), w, w's layout, x's layout on 8 devices)
    "depthwise": (lambda w, x: _depthwise(x, w), DEPTHWISE, (S3,), (S3,)),
    "depthwise_input_grad": (
        lambda w, x: jax.grad(lambda x: jnp.sum(jnp.sin(_depthwise(x, w))))(x),
        DEPTHWISE,
        (S3,),
        (S3,),
    ),
    "depthwise_kernel_grad": (  # a convolution with batch groups
        lambda w, x: jax.grad(lambda w: jnp.sum(jnp.sin(_depthwise(x, w))))(w),
        DEPTHWISE,
        (S3,),
        (S3,),
    ),
    "per_example_kernel_grads": (
        _per_example_kernel_grads,
        np.random.default_rng(6).normal(size=(3, 3, 8, 8)).astype(np.float32) / 8,
        (B,),
        (S0,),
    ),
}


@pytest.mark.parametrize("name", sorted(GROUPED))
def test_a_grouped_convolution_split_by_whole_groups_runs_locally(pl8, name):
    """Channels of a depthwise convolution, or the examples of per-example
    kernel gradients, split over 8 devices: each holds whole groups and
    convolves them with its own group count, moving nothing (before, the
    input was gathered: 61,376 B for the depthwise forward; GSPMD moves
    32,256 B for the per-example gradients)."""
    fn, w, w_sbp, x_sbp = GROUPED[name]
    x = np.random.default_rng(7).normal(size=IMG).astype(np.float32)
    f = sj.jit(fn, placement=pl8, in_sbp=(w_sbp, x_sbp))
    got = f(w, x)
    assert_close(got.numpy(), np.asarray(jax.jit(fn)(w, x)), rtol=1e-5)
    assert sum(c.bytes for c in sj.collectives(f.lower(w, x).compile())) == f.explain(w, x).bytes == 0


@pytest.mark.parametrize(
    "sbp,x_sbp",
    [((B, S3), (B, S3)), ((S3, S3), (S3, S3)), ((B, S3), (S1, S3))],
    ids=["2 groups per device", "groups over both axes", "rows and groups: halo and groups"],
)
def test_several_groups_per_device_and_a_halo_beside_them(pl24, sbp, x_sbp):
    """Eight feature groups on 2x4: two groups on each of 4 devices, one on
    each of 8 (split over x, then y), and channels split beside image rows
    (each device holds its groups and exchanges a halo of rows)."""
    w = np.random.default_rng(9).normal(size=(3, 3, 1, 8)).astype(np.float32)
    x = np.random.default_rng(10).normal(size=IMG).astype(np.float32)
    fn = lambda w, x: _depthwise(x, w)  # noqa: E731
    f = sj.jit(fn, placement=pl24, in_sbp=(sbp, x_sbp), out_sbp=x_sbp)
    assert_close(f(w, x).numpy(), np.asarray(jax.jit(fn)(w, x)), rtol=1e-5)
    moved = sum(c.bytes for c in sj.collectives(f.lower(w, x).compile()))
    assert moved == f.explain(w, x).bytes
    rows = x_sbp[0] == S1
    assert (moved > 0) == rows  # only the halo moves: groups never do
    if rows:
        assert moved <= gspmd_bytes(fn, pl24, (sbp, x_sbp), x_sbp, (w, x))


def test_groups_the_pieces_do_not_divide_are_not_split_through(pl8, pl24):
    """Two feature groups cannot be held whole by 8 (or 4) channel pieces:
    the convolution gets its channels another way, with the same values;
    split 2 ways (over x of 2x4) each piece is one group and nothing moves."""
    w = KERNEL  # (3, 3, 4, 8): 2 groups of 4 input channels
    x = np.random.default_rng(8).normal(size=IMG).astype(np.float32)
    fn = lambda w, x: _grouped_conv(x, w)  # noqa: E731
    want = np.asarray(jax.jit(fn)(w, x))
    for pl, sbp in ((pl8, (S3,)), (pl24, (B, S3)), (pl24, (S3, B))):
        f = sj.jit(fn, placement=pl, in_sbp=(sbp, sbp), out_sbp=sbp)
        assert_close(f(w, x).numpy(), want, rtol=1e-5)
        moved = sum(c.bytes for c in sj.collectives(f.lower(w, x).compile()))
        assert moved == f.explain(w, x).bytes
        if sbp == (S3, B):
            assert moved == 0
        else:
            assert 0 < moved <= gspmd_bytes(fn, pl, (sbp, sbp), sbp, (w, x))


LOGITS = np.random.default_rng(2).normal(size=(8, 4096)).astype(np.float32)
LOGITS[3, [5, 3000]] = 100.0  # a tie across pieces: the first index wins
LOGITS[5, 2000] = np.nan  # argmax and argmin pick the first NaN
BITS = np.random.default_rng(3).integers(0, 1 << 20, size=(8, 64)).astype(np.int32)
OVER_SPLIT_DIM = {
    "argmax": (lambda z: jnp.argmax(z, axis=-1), LOGITS),
    "argmin": (lambda z: jnp.argmin(z, axis=-1), LOGITS),
    "reduce_prod": (lambda z: jnp.prod(1 + 1e-3 * z, axis=-1), np.nan_to_num(LOGITS)),
    "reduce_xor": (lambda z: lax.reduce(z, np.int32(0), lax.bitwise_xor, (1,)), BITS),
    "reduce_and": (lambda z: lax.reduce(z, np.int32(-1), lax.bitwise_and, (1,)), BITS),
    "reduce_or_bool": (lambda z: jnp.any(z > 1 << 19, axis=-1), BITS),
}


@pytest.mark.parametrize("name", sorted(OVER_SPLIT_DIM))
@pytest.mark.parametrize("layout", ["S(1) on 8", "S(1), S(1) on 2x4", "S(0), S(1) on 2x4"])
def test_a_reduction_over_a_split_dim_moves_the_pieces_results_not_the_input(pl8, pl24, name, layout):
    """Greedy decoding from logits split by vocabulary: each piece's winner
    (value and index) is gathered, not the logits (the input was gathered
    whole before: 896,224 B against GSPMD's 3,584 on 8 x 32,000)."""
    fn, x = OVER_SPLIT_DIM[name]
    pl, sbp = {
        "S(1) on 8": (pl8, (S1,)),
        "S(1), S(1) on 2x4": (pl24, (S1, S1)),
        "S(0), S(1) on 2x4": (pl24, (S0, S1)),
    }[layout]
    f = sj.jit(fn, placement=pl, in_sbp=(sbp,), out_sbp=(B,) * pl.ndim)
    got, want = f(x).numpy(), np.asarray(jax.jit(fn)(x))
    if name == "reduce_prod":  # 4,096 roundings in another order
        assert_close(got, want, rtol=1e-4)
    else:
        np.testing.assert_array_equal(got, want)
    moved = sum(c.bytes for c in sj.collectives(f.lower(x).compile()))
    assert moved == f.explain(x).bytes
    out = want.dtype.itemsize
    result = out + (x.dtype.itemsize if name.startswith("arg") else 0)  # an argmax: value and index
    if name.endswith("_bool"):  # a boolean or is partial (max): all-reduces of one flag per row
        assert moved <= 2 * 7 * 8 * out, str(f.explain(x))
    elif layout.startswith("S(0)"):  # y's 4 pieces' results for 4 rows, then the rows gathered over x
        assert moved == 8 * 3 * 4 * result + 8 * 1 * 4 * out, str(f.explain(x))
    else:  # each device gathers the 7 other pieces' results for its 8 rows
        assert moved == 8 * 7 * 8 * result, str(f.explain(x))
    if name.startswith("arg"):
        assert moved <= gspmd_bytes(fn, pl, (sbp,), (B,) * pl.ndim, (x,))


def test_two_reductions_of_one_split_operand_each_gather_their_own_results(pl8, pl24):
    """An argmax and an argmin (or a product) of one operand run an exchange
    each; the plan counted the second as shared with the first (7,168 B
    planned, 14,336 B compiled)."""
    x = np.random.default_rng(0).normal(size=(16, 16)).astype(np.float32)

    def fn(a):
        return (
            jnp.argmax(a, 0),
            jnp.argmin(a, 0),
            jnp.prod(1 + 0.01 * a, 0),
            jnp.all(a > -3, 0),
            lax.argmax(a, 0, jnp.int16),  # an argmax of another index dtype: an exchange of its own
        )

    for pl, sbp in ((pl8, (S0,)), (pl24, (S0, S1)), (pl24, (S0, S0))):
        f = sj.jit(fn, placement=pl, in_sbp=(sbp,))
        for got, want in zip(f(x), jax.jit(fn)(x)):
            assert_close(got.numpy(), np.asarray(want), rtol=1e-5)
        assert sum(c.bytes for c in sj.collectives(f.lower(x).compile())) == f.explain(x).bytes


def _argmax_pairs(a, b):
    """(value, index) pairs: the larger value, the first index among equals."""
    (av, ai), (bv, bi) = a, b
    first = (av > bv) | ((av == bv) & (ai < bi))
    return jnp.where(first, av, bv), jnp.where(first, ai, bi)


def _largest_magnitude(a, b):
    """The larger |x|, the larger x among equal magnitudes: a monoid JAX has
    no primitive for (a generic ``reduce``)."""
    return jnp.where((jnp.abs(a) > jnp.abs(b)) | ((jnp.abs(a) == jnp.abs(b)) & (a > b)), a, b)


GENERIC = {
    # an argmax written as lax.reduce over (value, index): rows of 8, a tie across pieces
    "argmax_pairs": (
        lambda x, i: lax.reduce((x, i), (np.float32(-np.inf), np.int32(0)), _argmax_pairs, (1,)),
        2,
    ),
    "largest_magnitude": (lambda x, i: lax.reduce(x, np.float32(0), _largest_magnitude, (1,)), 1),
}


@pytest.mark.parametrize("name", sorted(GENERIC))
@pytest.mark.parametrize("layout", ["S(1) on 8", "S(1), S(1) on 2x4", "S(0), S(1) on 2x4", "S(0) on 8"])
def test_lax_reduce_of_a_function_gathers_the_pieces_results(pl8, pl24, name, layout):
    """``lax.reduce`` with a function of its own (a generic ``reduce``) over
    a split dim reduces each piece and gathers the results, as GSPMD does;
    it had no rule and gathered its operands whole (10,752 B against GSPMD's
    2,688 for a (value, index) argmax over the 32 rows of a 32x6 array split
    by rows over 8). Split on a kept dim, only the results' rows move."""
    fn, results = GENERIC[name]
    x = np.random.default_rng(4).normal(size=(8, 64)).astype(np.float32)
    x[3, [5, 40]] = 9.0  # a tie across pieces: the first index wins
    x[6, [2, 50]] = (-7.0, 7.0)  # equal magnitudes: the larger value wins
    i = np.broadcast_to(np.arange(64, dtype=np.int32), x.shape).copy()
    pl, sbp = {
        "S(1) on 8": (pl8, (S1,)),
        "S(1), S(1) on 2x4": (pl24, (S1, S1)),
        "S(0), S(1) on 2x4": (pl24, (S0, S1)),
        "S(0) on 8": (pl8, (S0,)),
    }[layout]
    out_sbp = ((B,) * pl.ndim,) * results if results > 1 else (B,) * pl.ndim
    f = sj.jit(fn, placement=pl, in_sbp=(sbp, sbp), out_sbp=out_sbp)
    got, want = f(x, i), jax.jit(fn)(x, i)
    for g, w in zip(
        jax.tree.leaves(got, is_leaf=lambda v: isinstance(v, sj.GlobalTensor)),
        jax.tree.leaves(want),
        strict=True,
    ):
        np.testing.assert_array_equal(g.numpy(), np.asarray(w))
    moved = sum(c.bytes for c in sj.collectives(f.lower(x, i).compile()))
    assert moved == f.explain(x, i).bytes
    row = 4 * results  # the bytes of one row's results: f32 values (and i32 indices)
    if layout == "S(0) on 8":  # a kept dim: only the results' rows are gathered for out_sbp B
        assert moved == 8 * 7 * 1 * row, str(f.explain(x, i))
    elif layout.startswith("S(0)"):  # y's 4 pieces' results for 4 rows, then the rows gathered over x
        assert moved == 8 * 3 * 4 * row + 8 * 1 * 4 * row, str(f.explain(x, i))
    else:  # each device gathers the 7 other pieces' results for its 8 rows
        assert moved == 8 * 7 * 8 * row, str(f.explain(x, i))
    if (
        results > 1
    ):  # GSPMD refuses a one-operand reduce of such a function ("Unsupported reduction computation")
        assert moved <= gspmd_bytes(fn, pl, (sbp, sbp), out_sbp, (x, i))


@pytest.mark.parametrize(
    "name, fn, layout",
    [
        # an init the function does not keep (1 + 1 != 1): applied once per piece, it would count 8 times
        ("add_from_one", lambda x: lax.reduce(x, np.float32(1), lax.add, (1,)), "S(1) on 8"),
        # a computed init: not known to be kept
        ("computed_init", lambda x: lax.reduce(x, x[0, 0] * 0, _largest_magnitude, (1,)), "S(1) on 8"),
        # two reduced dims split over x and y: each device gathers the 7 other pieces' results
        ("two_dims", lambda x: lax.reduce(x, np.float32(0), _largest_magnitude, (0, 1)), "S(0), S(1) on 2x4"),
    ],
)
def test_lax_reduce_of_a_function_combines_pieces_only_where_its_init_is_kept(pl8, pl24, name, fn, layout):
    """Each piece reduces with the init, so the pieces' results are combined
    only where the init is a constant the function keeps (f(e, e) == e);
    otherwise the operand is gathered first. The first version counted 1
    once per piece (``lax.add`` from 1: 73 against 67)."""
    x = np.random.default_rng(5).normal(size=(8, 64)).astype(np.float32)
    pl, sbp = {"S(1) on 8": (pl8, (S1,)), "S(0), S(1) on 2x4": (pl24, (S0, S1))}[layout]
    f = sj.jit(fn, placement=pl, in_sbp=(sbp,), out_sbp=(B,) * pl.ndim)
    assert_close(f(x).numpy(), np.asarray(jax.jit(fn)(x)), rtol=1e-6)
    e = f.explain(x)
    moved = sum(c.bytes for c in sj.collectives(f.lower(x).compile()))
    assert moved == e.bytes
    (reduce,) = [d for d in e.propagation.decisions if d.node.name == "reduce"]
    if name == "two_dims":  # each device gathers the 7 other pieces' results, one scalar each
        assert moved == 8 * 7 * 4, str(e)
    else:  # the reduced dim is never read split: the rows are split instead (an all-to-all)
        assert not any(isinstance(s, sj.Split) and s.dim == 1 for s in reduce.in_sbp[0]), str(e)


def test_polyval_stays_split(pl8):
    """jax 0.12 evaluates ``jnp.polyval`` with one ``polynomial`` primitive;
    older releases loop (a ``scan``), which sj.jit writes out: split either way."""
    fn = lambda x: jnp.polyval(jnp.array([1.0, -2.0, 3.0]), x)  # noqa: E731
    CASES["polyval"] = (fn, MAT, S1)
    try:
        test_rule_keeps_the_split_and_matches_one_device(pl8, "polyval")
    finally:
        del CASES["polyval"]


def test_docs_coverage_page_is_the_registry():
    """docs/ops.md is generated from the rule registry; regenerate it with
    ``python -m sbpjax.rules.coverage > docs/ops.md`` after adding a rule."""
    import pathlib

    from sbpjax.rules.coverage import coverage, markdown

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "ops.md"
    assert page.read_text() == markdown()
    names = {r["primitive"] for r in coverage()}
    assert {"top_k", "split", "reduce_window_max", "select_and_scatter_add", "one_minus_square"} <= names


# A cast of a partial: reduce first unless the cast commutes with the reduction.
# Each case's values make the wrong order give a wrong answer.
CAST_CASES = {
    # per-device maxima -1 and 0: max is 0 -> False, but any(-1 != 0, 0 != 0) is True
    "max_to_bool": (
        lambda x: x.max(0).astype(bool),
        np.array([[-1.0], [-3.0], [0.0], [-2.0]] * 2, np.float32),
    ),
    # int32 200 and 100 -> int8: max is 200 -> -56, but max(-56, 100) is 100
    "max_narrowing": (lambda x: x.max(0).astype(jnp.int8), np.array([[200], [100]] * 4, np.int32)),
    # int8 sums wrap (8 x 100 = 800 -> 32); cast terms would sum to 800
    "sum_widening": (lambda x: x.sum(0, dtype=jnp.int8).astype(jnp.int32), np.full((8, 1), 100, np.int8)),
    "sum_int_to_float": (
        lambda x: x.sum(0, dtype=jnp.int8).astype(jnp.float32),
        np.full((8, 1), 100, np.int8),
    ),
    # these commute: the partial passes through the cast and is reduced after it
    "sum_float_narrowing": (
        lambda x: x.sum(0).astype(jnp.bfloat16),
        np.arange(8.0, dtype=np.float32)[:, None],
    ),
    "max_int_to_float": (lambda x: x.max(0).astype(jnp.float32), np.array([[3], [-7]] * 4, np.int32)),
}


@pytest.mark.parametrize("name", sorted(CAST_CASES))
def test_a_cast_of_a_partial_equals_the_cast_of_the_value(pl8, name):
    fn, x = CAST_CASES[name]
    got = sj.jit(fn, placement=pl8, in_sbp=(S0,), out_sbp=B)(x).numpy()
    np.testing.assert_array_equal(got, np.asarray(jax.jit(fn)(x)))
