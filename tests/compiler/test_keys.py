"""Typed PRNG keys (``jax.random.key``) through ``sj.jit`` and ``TrainStep``
(sbpjax/compiler/keys.py): as arguments (alone, split into an array of keys
and laid out by ``in_sbp``, of another implementation) and as results (typed
keys again, passed to the next call), and in an optimizer's state
(``optax.noisy_sgd``): values equal ``jax.jit``'s and optax's on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import sbpjax as sj
import sbpjax.flax as sjf
from sbpjax import B, S
from sbpjax.dtypes import is_key

# on both CI legs (pyproject.toml's markers): jax's key API (key_impl, wrap_key_data) differs by version
pytestmark = pytest.mark.jax_versions

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)


def noisy(key, x):
    return x + jax.random.normal(key, x.shape)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_a_typed_key_argument_draws_what_jax_jit_draws(impl, pl8):
    key = jax.random.key(7, impl=impl)
    f = sj.jit(noisy, placement=pl8, in_sbp=(None, S(0)))
    assert_close(f(key, X).numpy(), jax.jit(noisy)(key, X), rtol=1e-6)
    # a uint32 key of the same shape is another call signature: another program
    raw = jax.random.key_data(key)
    assert_close(f(jax.random.wrap_key_data(raw, impl=impl), X).numpy(), jax.jit(noisy)(key, X), rtol=1e-6)
    assert len(f._cache) == 1


def test_a_key_closed_over_draws_what_jax_jit_draws(pl8, pl24, tmp_path):
    """A key the function closes over is a constant of its program: merged with
    its equals, fingerprinted for the plan cache and read back by its key data."""
    key = jax.random.key(1)

    def f(x):
        again = jax.random.key(1)  # an equal key made inside: equal draws, one program
        return x + jax.random.normal(key, x.shape) + jax.random.uniform(jax.random.fold_in(again, 3), x.shape)

    want = jax.jit(f)(X)
    for pl, sbp in ((pl8, (S(0),)), (pl24, (S(0), S(1)))):
        for _ in range(2):  # solved, then read back from the plan cache
            g = sj.jit(f, placement=pl, in_sbp=(sbp,), out_sbp=(B,) * pl.ndim, plan_cache=str(tmp_path))
            assert_close(g(X).numpy(), want, rtol=1e-6)
    other = jax.random.key(2)
    h = sj.jit(lambda x: x + jax.random.normal(other, x.shape), placement=pl8, in_sbp=(S(0),))
    assert_close(h(X).numpy(), X + np.asarray(jax.random.normal(other, X.shape)), rtol=1e-6)


def test_a_typed_key_result_comes_back_typed_and_feeds_the_next_call(pl8):
    def step(key, x):
        key, sub = jax.random.split(key)
        return key, x * jax.random.uniform(sub, x.shape)

    f = sj.jit(step, placement=pl8, in_sbp=(None, S(0)))
    ref = jax.jit(step)
    k1 = k2 = jax.random.key(3)
    y1 = y2 = X
    for _ in range(3):
        k1, y1 = f(k1, y1)
        k2, y2 = ref(k2, y2)
        assert jax.dtypes.issubdtype(k1.dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(jax.random.key_data(k1), jax.random.key_data(k2))
        assert_close(y1.numpy(), y2, rtol=1e-6)
    assert len(f._cache) == 1  # the returned key is the same kind of argument


def test_an_array_of_keys_split_by_in_sbp(pl8):
    keys = jax.random.split(jax.random.key(11), 8)
    per_row = jax.vmap(lambda k, row: row + jax.random.normal(k, row.shape))
    f = sj.jit(per_row, placement=pl8, in_sbp=(S(0), S(0)))
    assert_close(f(keys, X).numpy(), jax.jit(per_row)(keys, X), rtol=1e-6)
    assert f.explain(keys, X).propagation.in_sbp[0] == (S(0),)  # the key data's rows, split


def _per_key_draws(keys, x):
    """What a per-example step draws from a key per row: a normal, a split
    key's bernoulli mask and a key folded in with its row's own message."""

    def row(k, xi, i):
        mask = jax.random.bernoulli(jax.random.split(k, 2)[1], 0.7, xi.shape)
        return jnp.where(
            mask, xi + jax.random.normal(k, xi.shape), jax.random.uniform(jax.random.fold_in(k, i))
        )

    return jax.vmap(row)(keys, x, jnp.arange(x.shape[0], dtype=jnp.uint32))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("rows", [16, 13])  # 13: an uneven split over 8
def test_keys_split_by_rows_draw_on_their_own_devices(impl, rows, pl8):
    """An array of threefry keys split on its rows draws each row's numbers
    on the device holding the row (``rules.control.PER_KEY``): nothing
    moves, and the numbers are those drawn whole, bit for bit. Before, the
    keys were gathered to every device (896 B for 16 rows). "rbg" keys draw
    as a batch, so they are still gathered, and draw the same numbers."""
    keys = jax.random.split(jax.random.key(3, impl=impl), rows)
    x = np.random.default_rng(1).normal(size=(rows, 24)).astype(np.float32)
    f = sj.jit(_per_key_draws, placement=pl8, in_sbp=(S(0), S(0)), out_sbp=S(0))
    np.testing.assert_array_equal(f(keys, x).numpy(), jax.jit(_per_key_draws)(keys, x))
    moved = sum(c.bytes for c in sj.collectives(f.lower(keys, x).compile()))
    assert moved == f.explain(keys, x).bytes
    assert (moved == 0) == (impl == "threefry2x32"), moved


def test_raw_uint32_keys_split_over_two_axes_draw_what_jax_jit_draws(pl24):
    """Old-style uint32 keys (``jax.random.PRNGKey``), a (4, 8) grid of them
    split over both axes of 2x4: ``random_wrap`` keeps their key dims split
    (the last dim, each key's two words, stays whole)."""
    raw = jax.vmap(jax.vmap(lambda i: jax.random.PRNGKey(i)))(jnp.arange(32).reshape(4, 8))

    def draw(raw_keys):
        return jax.vmap(jax.vmap(lambda k: jax.random.normal(k, (3,))))(raw_keys)

    f = sj.jit(draw, placement=pl24, in_sbp=((S(0), S(1)),), out_sbp=(S(0), S(1)))
    np.testing.assert_array_equal(f(raw).numpy(), jax.jit(draw)(raw))
    assert sum(c.bytes for c in sj.collectives(f.lower(raw).compile())) == 0


def test_a_scan_over_typed_keys_draws_what_jax_jit_draws(pl8):
    """A scan whose scanned inputs are typed keys (what ``nn.scan`` with
    ``split_rngs={"dropout": True}`` and ``nnx.scan`` over blocks holding a
    ``Dropout`` make): written out, each iteration slices its key off the
    stack. Before, the cache of those slices took a key's dtype for numpy's
    and raised a TypeError."""

    def dropout_stack(x, key):
        def layer(h, k):
            return h * jax.random.bernoulli(k, 0.8, h.shape) / 0.8, None

        return jax.lax.scan(layer, x, jax.random.split(key, 3))[0]

    f = sj.jit(dropout_stack, placement=pl8, in_sbp=(S(0), None), out_sbp=S(0))
    key = jax.random.key(5)
    np.testing.assert_array_equal(f(X, key).numpy(), jax.jit(dropout_stack)(X, key))


@pytest.mark.parametrize("kind", ["scan", "while"])
@pytest.mark.parametrize("layouts", [("S(0), B", "S(0), B"), ("B, S(0)", "S(0), S(1)")])
def test_a_loop_carrying_an_array_of_keys_draws_what_jax_jit_draws(kind, layouts, pl24):
    """A loop kept whole whose carry holds typed keys (a per-example sampler,
    or ``jax.vmap`` of a ``while_loop`` over keys): the plan re-lays out the
    key array itself, which moves as its key data. Before, planning that
    move read the key's dtype as numpy's and raised a TypeError."""
    x = np.random.default_rng(3).normal(size=(8, 16)).astype(np.float32)

    def draw(ks, h):
        nk = jax.vmap(jax.random.split)(ks)
        return nk[:, 0], h + jax.vmap(lambda k, r: jax.random.normal(k, r.shape))(nk[:, 1], h)

    def sampler(ks, h):
        if kind == "scan":
            return jax.lax.scan(lambda c, _: (draw(*c), c[1].sum()), (ks, h), None, length=3)
        n = 3 + (h.sum() > 1e9).astype(jnp.int32)  # a trip count known at run time: the loop stays whole
        return jax.lax.while_loop(lambda c: c[2] < n, lambda c: (*draw(c[0], c[1]), c[2] + 1), (ks, h, 0))

    keys = jax.random.split(jax.random.key(4), 8)
    is_global = lambda v: isinstance(v, sj.GlobalTensor)  # noqa: E731
    got = jax.tree.leaves(sj.jit(sampler, placement=pl24, in_sbp=layouts)(keys, x), is_leaf=is_global)
    want = jax.tree.leaves(jax.jit(sampler)(keys, x))
    np.testing.assert_array_equal(jax.random.key_data(got[0]), jax.random.key_data(want[0]))
    for g, w in zip(got[1:], want[1:]):
        assert_close(g.numpy(), w, rtol=1e-5)


def test_noisy_sgd_state_holds_a_typed_key(pl8):
    params = {"w": np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)}
    batch = np.random.default_rng(2).normal(size=(8, 16)).astype(np.float32)

    def loss(p, b):
        return jnp.mean((b @ p["w"]) ** 2)

    opt = optax.noisy_sgd(1e-2, key=jax.random.key(0))
    step = sjf.TrainStep(loss, opt, pl8, None, (S(0),))
    p, s = step.init(params)
    q, t = params, opt.init(params)

    @jax.jit
    def ref(q, t, b):
        value, g = jax.value_and_grad(loss)(q, b)
        u, t = opt.update(g, t, q)
        return optax.apply_updates(q, u), t, value

    for _ in range(3):
        p, s, value = step(p, s, batch)
        q, t, want = ref(q, t, batch)
        assert_close(value.numpy(), want, rtol=1e-5)
    assert_close(p["w"].numpy(), q["w"], rtol=1e-5)
    key = next(v for v in jax.tree.leaves(s) if is_key(v))
    want_key = next(v for v in jax.tree.leaves(t) if is_key(v))
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want_key))


def test_a_key_layout_that_splits_the_key_data_is_an_sbp_error(pl8):
    key = jax.random.key(0)  # a scalar key: its data has one dim, of 2
    f = sj.jit(noisy, placement=pl8, in_sbp=(S(0), S(0)))
    with pytest.raises(sj.SBPError):
        f(key, X)
    good = sj.jit(noisy, placement=pl8, in_sbp=(B, S(0)))
    assert_close(good(key, X).numpy(), jax.jit(noisy)(key, X), rtol=1e-6)


def test_a_partial_key_layout_is_an_sbp_error_naming_the_argument_or_result(pl24):
    """A PRNG key cannot be partial (keys are not summed): in_sbp and out_sbp
    say so, naming the argument's or result's path. A partial in_sbp ran (the
    key data, uint32, took P(sum)), and a partial out_sbp failed after the
    run in to_jax(). A key given to to_global says to lay out its key data."""
    keys = {"a": jax.random.key(0)}
    draw = sj.jit(lambda k: jax.random.uniform(k["a"], (3,)), placement=pl24, in_sbp=({"a": (sj.P, B)},))
    with pytest.raises(
        sj.SBPError, match=r"in_sbp of argument args\[0\]\['a'\] \(P, B\) is partial.*S .*or B"
    ):
        draw(keys)
    same = sj.jit(lambda k: {"out": [k["a"]]}, placement=pl24, out_sbp={"out": [(sj.P_max, B)]})
    with pytest.raises(sj.SBPError, match=r"out_sbp of the result\['out'\]\[0\] \(P\(max\), B\) is partial"):
        same(keys)
    with pytest.raises(sj.SBPError, match=r"a PRNG key's.*jax.random.key_data"):
        sj.to_global(jax.random.key(0), pl24, (B, B))
    ok = sj.jit(lambda k: jax.random.uniform(k["a"], (3,)), placement=pl24, in_sbp=({"a": (B, B)},))
    assert_close(ok(keys).numpy(), np.asarray(jax.random.uniform(keys["a"], (3,))), rtol=1e-6)
