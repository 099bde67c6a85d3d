"""A sweep of the jnp / lax / jax.nn / linalg functions users reach for, each
on a row-split matrix: none may run whole on every device (an SBPWarning),
and each value equals the one-device program's.

Each JAX release spells these functions with its own primitives (jax 0.12
writes ``jnp.searchsorted`` and ``jnp.nonzero(size=...)`` as a
``call_hi_primitive``; jax 0.10.2's searchsorted compares with ``le_to``), so
a release that introduces a primitive sbpjax has no rule for fails here,
naming it. On 2026-12-03 it found ten primitives that ran whole on both legs
(``fft``, ``cholesky``, ``lu``, ``qr``, ``svd``, ``eigh``,
``custom_linear_solve``, ``scatter-max`` / ``-min`` / ``-mul``). Where a
function transforms the split dim itself (a matrix inverse of the whole
matrix), its operand is boxed to B by the rule's own signature: that is a
plan, not a warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax import lax

import sbpjax as sj
from sbpjax._errors import SBPWarning
from sbpjax.tensor import is_global

# on both CI legs (pyproject.toml's markers): each JAX release spells these with its own primitives
pytestmark = pytest.mark.jax_versions


def _square(a):
    return a[:, :16] @ a[:, :16].T


FUNCTIONS = {
    "cumprod": lambda a: jnp.cumprod(a, 1),
    "cummax": lambda a: lax.cummax(a, 1),
    "cumlogsumexp": lambda a: lax.cumlogsumexp(a, 1),
    "argsort": lambda a: jnp.argsort(a, 1),
    "sort": lambda a: jnp.sort(a, 1),
    "median": lambda a: jnp.median(a, 1),
    "quantile": lambda a: jnp.quantile(a, 0.3, axis=1),
    "unique_sized": lambda a: jnp.unique(jnp.round(a), size=5, fill_value=0.0),
    "nonzero_sized": lambda a: jnp.nonzero(a[0] > 0, size=4)[0],
    "clip": lambda a: jnp.clip(a, -1, 1),
    "searchsorted": lambda a: jnp.searchsorted(jnp.linspace(-2, 2, 9), a),
    "digitize": lambda a: jnp.digitize(a, jnp.linspace(-2, 2, 9)),
    "histogram": lambda a: jnp.histogram(a, bins=5, range=(-3, 3))[0],
    "bincount": lambda a: jnp.bincount(jnp.abs(a * 3).astype(jnp.int32).ravel(), length=10),
    "tril": jnp.tril,
    "roll": lambda a: jnp.roll(a, 3, 1),
    "flip": lambda a: jnp.flip(a, 1),
    "pad": lambda a: jnp.pad(a, ((0, 0), (2, 2))),
    "diff": lambda a: jnp.diff(a, axis=1),
    "convolve_rows": lambda a: jax.vmap(lambda r: jnp.convolve(r, jnp.ones(3), mode="same"))(a),
    "rfft": lambda a: jnp.abs(jnp.fft.rfft(a, axis=1)),
    "inv": lambda a: jnp.linalg.inv(_square(a) + 16 * jnp.eye(16)),
    "svd": lambda a: jnp.linalg.svd(a, compute_uv=False),
    "qr": lambda a: jnp.abs(jnp.linalg.qr(a)[1]),
    "cholesky": lambda a: jnp.linalg.cholesky(_square(a) + 16 * jnp.eye(16)),
    "eigvalsh": lambda a: jnp.linalg.eigvalsh(_square(a)),
    "norm": lambda a: jnp.linalg.norm(a, axis=1),
    "logsumexp": lambda a: jax.nn.logsumexp(a, 1),
    "softmax": lambda a: jax.nn.softmax(a, 1),
    "gelu": jax.nn.gelu,
    "erfinv": lambda a: jax.scipy.special.erfinv(jnp.tanh(a) * 0.9),
    "gammaln": lambda a: jax.scipy.special.gammaln(jnp.abs(a) + 1),
    "top_k": lambda a: lax.top_k(a, 3)[0],
    "argmax": lambda a: jnp.argmax(a, 1),
    "take_columns": lambda a: jnp.take(a, jnp.array([0, 5, 7]), axis=1),
    "dynamic_slice": lambda a: lax.dynamic_slice_in_dim(a, 3, 5, 1),
    "dynamic_update_slice": lambda a: lax.dynamic_update_slice_in_dim(a, jnp.zeros((16, 2)), 4, 1),
    "at_add": lambda a: a.at[:, jnp.array([1, 1, 3])].add(1.0),
    "at_max": lambda a: a.at[:, jnp.array([1, 1, 3])].max(0.5),
    "at_multiply": lambda a: a.at[:, 2].multiply(3.0),
    "at_subtract": lambda a: a.at[jnp.array([0, 0, 5])].subtract(1.0),
    "segment_max": lambda a: jax.ops.segment_max(a, jnp.arange(16) // 4, num_segments=4),
    "segment_min": lambda a: jax.ops.segment_min(a, jnp.arange(16) // 4, num_segments=4),
    "segment_prod": lambda a: jax.ops.segment_prod(a, jnp.arange(16) // 4, num_segments=4),
    "reduce_precision": lambda a: lax.reduce_precision(a, 5, 10),
    "nan_to_num": lambda a: jnp.nan_to_num(a / (a > 0)),
    "isclose": lambda a: jnp.isclose(a, 0.5),
    "round": lambda a: jnp.round(a, 2),
    "copysign": lambda a: jnp.copysign(a, -1.0),
    "hypot": lambda a: jnp.hypot(a, 2.0),
    "logaddexp": lambda a: jnp.logaddexp(a, 0.5),
    "sinc": jnp.sinc,
    "i0": jnp.i0,
    "random_uniform": lambda a: a + jax.random.uniform(jax.random.key(0), a.shape),
    "cond": lambda a: lax.cond(True, lambda v: v * 2, lambda v: v, a),
    "while_loop": lambda a: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.1), (0, a))[1],
    "map": lambda a: lax.map(lambda r: r * 2, a),
    "associative_scan": lambda a: lax.associative_scan(jnp.add, a, axis=1),
    "bitcast": lambda a: lax.bitcast_convert_type(a, jnp.int32),
    "population_count": lambda a: lax.population_count(a.astype(jnp.int32)),
    "outer_sum": lambda a: jnp.einsum("ij,ik->ijk", a, a).sum(-1),
    "var": lambda a: jnp.var(a, axis=1),
    "polyval": lambda a: jnp.polyval(jnp.array([1.0, 2.0, 3.0]), a),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_runs_split_and_matches_one_device(pl8, name):
    fn = FUNCTIONS[name]
    x = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)
    f = sj.jit(fn, placement=pl8, in_sbp=(sj.S(0),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SBPWarning)
        got = f(x)
    want = jax.jit(fn)(x)
    for g, w in zip(jax.tree.leaves(got, is_leaf=is_global), jax.tree.leaves(want)):
        g, w = g.numpy(), np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if np.issubdtype(w.dtype, np.floating):
            assert_close(g, w, rtol=1e-4, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
