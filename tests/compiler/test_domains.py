"""The candidate screen's bitset index (sbpjax.compiler.screen.OperandIndex)
keeps exactly the candidates a test of each candidate's operands keeps, in
order; the local slices offered to a broadcast operand move no bytes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes

import sbpjax as sj
from sbpjax import B, P, S
from sbpjax.compiler.reachable import local_slices, partly_gathered
from sbpjax.compiler.screen import OperandIndex

LAYOUTS = [(B, B), (S(0), B), (B, S(0)), (S(1), S(0)), (P, B), (B, P), (S(0), S(1))]


def _candidates(rng, n_ins):
    n = int(rng.integers(1, 40))
    return [
        ([LAYOUTS[int(rng.integers(len(LAYOUTS)))] for _ in range(n_ins)], [LAYOUTS[int(rng.integers(3))]])
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(30))
def test_the_index_keeps_what_a_candidate_by_candidate_screen_keeps(seed):
    rng = np.random.default_rng(seed)
    n_ins = int(rng.integers(1, 4))
    cs = _candidates(rng, n_ins)
    index = OperandIndex()
    for _ in range(5):  # one list, screened for several ops (the index is built once)
        allow = [
            None if rng.random() < 0.2 else {nd for nd in LAYOUTS if rng.random() < 0.5} for _ in range(n_ins)
        ]
        want = [c for c in cs if all(al is None or nd in al for al, nd in zip(allow, c[0]))]
        got = index.reading(cs, allow)
        assert [id(c) for c in got] == [id(c) for c in want]
    assert index.reading([], []) == []


@pytest.mark.parametrize("seed", range(30))
def test_a_broadcast_operand_is_offered_exactly_its_free_local_slices(seed):
    """``local_slices`` offers exactly the splits of a layout's whole axes on
    dims longer than 1 that the boxing planner reaches moving no bytes."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(rng.choice([1, 4, 8])) for _ in range(int(rng.integers(1, 4))))
    pl = sj.placement((2, 4), ("x", "y"))
    per_axis = [B, P] + [S(d) for d in range(len(shape)) if shape[d] >= 4]
    src = tuple(per_axis[int(rng.integers(len(per_axis)))] for _ in range(2))
    whole = [a for a, q in enumerate(src) if q == B]
    dims = [None] + [S(d) for d, n in enumerate(shape) if n > 1]
    want = set()
    for pick in itertools.product(dims, repeat=len(whole)):
        nd = list(src)
        for a, q in zip(whole, pick):
            if q is not None:
                nd[a] = q
        if sj.plan_boxing(shape, np.float32, pl, src, tuple(nd)).bytes == 0:
            want.add(tuple(nd))
    assert local_slices({src}, shape) == want


def test_partly_gathered_lists_the_gathers_between():
    made, whole = (S(0), S(1)), (B, B)
    assert partly_gathered(made, whole) == {(B, S(1)), (S(0), B)}
    assert partly_gathered((S(0), S(1), S(2)), (B, B, S(2))) == {(B, S(1), S(2)), (S(0), B, S(2))}
    assert partly_gathered(made, (S(0), B)) == set()  # one axis gathered: nothing between
    assert partly_gathered(made, (S(1), B)) == set()  # more than a gather


@pytest.mark.parametrize(
    "fn",
    [lambda x: jnp.abs(jnp.fft.rfft(x, axis=1)), lambda x: jnp.sort(x, axis=1)[:, -4:]],
    ids=["rfft", "sort"],
)
def test_an_op_needing_one_dim_whole_gathers_only_the_axes_splitting_it(pl24, fn):
    """``abs(rfft(x, axis=1))`` of an (S(0), S(1)) ``x``: the greedy pass gathers
    ``x`` whole (43,008 B); gathering the columns over y alone keeps the rows
    split for the FFT (30,976 B with the result's gather, GSPMD's count)."""
    x = np.random.default_rng(0).normal(size=(16, 96)).astype(np.float32)
    f = sj.jit(fn, placement=pl24, in_sbp=((S(0), S(1)),), out_sbp=(B, B))
    assert_close(f(x).numpy(), np.asarray(jax.jit(fn)(x)), rtol=1e-5)
    whole = 8 * 16 * 96 * 4 * 7 // 8  # every device gathers the 7/8 of x it lacks
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes < whole
    assert moved <= gspmd_bytes(fn, pl24, ((S(0), S(1)),), (B, B), (x,))


def test_a_reshape_that_cannot_keep_a_split_reads_its_operand_gathered(pl24):
    """Two key/value heads of width 6 from a projection split by columns over 4
    devices: the reshape to (heads, width) cannot keep 3 columns per device.
    Gathering the projection moves half what a zero-fill into a partial and
    its all-reduce move."""
    b, t, d = 4, 16, 48
    rng = np.random.default_rng(0)
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    wk = rng.normal(size=(d, 12)).astype(np.float32)

    def heads(x, wk):
        return (x @ wk).reshape(b, t, 2, 6)

    f = sj.jit(heads, placement=pl24, in_sbp=((S(0), B), (B, S(1))), out_sbp=(S(0), B))
    assert_close(f(x, wk).numpy(), np.asarray(jax.jit(heads)(x, wk)), rtol=1e-5)
    gather = 8 * 3 * (b // 2) * t * 3 * 4  # each device receives the 3 other pieces of its rows
    assert moved_bytes(f, x, wk) == f.explain(x, wk).bytes == gather
    assert gather <= gspmd_bytes(heads, pl24, ((S(0), B), (B, S(1))), (S(0), B), (x, wk))


@pytest.mark.slow
def test_gathering_a_split_vector_is_offered_and_pays_on_the_demo_gpt(monkeypatch):
    """The demo GPT's column-split biases (a vector reshaped to be broadcast,
    constrained to its layout by the Trainer) may be read gathered: the plan
    moves fewer bytes than with those reads withheld (10.22 -> 7.26 MiB at the
    demo's size), and the same losses as without."""
    import importlib.util
    import pathlib

    import optax

    import sbpjax.compiler.domains as domains
    import sbpjax.flax as sjf

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "gpt_hybrid.py"
    spec = importlib.util.spec_from_file_location("gpt_hybrid_demo", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, (16, 33)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    pl = sj.placement((2, 4), ("x", "y"))

    def trained():
        model = sjf.annotate(demo.build(40, 32, 32, 4, 1), demo.HYBRID_RULES)
        t = sjf.Trainer(
            model, optax.adamw(3e-3), demo.loss_fn, pl, batch_sbp=demo.BATCH_SBP, options=sj.CompileOptions()
        )
        return t.explain(batch).bytes, [t.step(batch) for _ in range(2)]

    monkeypatch.setenv("SBPJAX_PLAN_CACHE", "0")
    with_reads, losses = trained()
    monkeypatch.setattr(domains, "gathered_splits", lambda made: set())
    without, want = trained()
    assert with_reads < without
    assert_close(np.asarray(losses), np.asarray(want), rtol=1e-5)


def test_group_norm_over_split_channels_moves_the_split_not_the_whole_input(pl8):
    """GroupNorm's reshape of channels into (groups, channels per group) cannot
    keep 8 channels per device in 4 groups of 16; where no candidate reads the
    input as it is, moving its split to another dim (an all-to-all to the
    rows) is offered beside gathering it. Gathered, it moved 14.7 MB at
    (8, 32, 32, 64); GSPMD splits the groups and their channels over the one
    axis, which an SBP layout cannot (docs/concepts/compiler.md, limits)."""
    x = np.random.default_rng(0).normal(size=(8, 16, 16, 64)).astype(np.float32)

    def group_norm(x):
        b, h, w, c = x.shape
        z = x.reshape(b, h, w, 4, c // 4)
        m = z.mean((1, 2, 4), keepdims=True)
        v = ((z - m) ** 2).mean((1, 2, 4), keepdims=True)
        return ((z - m) * jax.lax.rsqrt(v + 1e-5)).reshape(b, h, w, c)

    f = sj.jit(group_norm, placement=pl8, in_sbp=(S(3),))
    assert_close(f(x).numpy(), np.asarray(jax.jit(group_norm)(x)), rtol=1e-5)
    moved = moved_bytes(f, x)
    everything = 8 * 7 * x.nbytes // 8  # every device gathers the 7/8 it lacks
    moving = 7 * x.nbytes // 8  # an all-to-all: each device sends 7/8 of its piece
    assert moved == f.explain(x).bytes
    assert moved <= moving + 8 * 7 * 2 * 8 * 4 * 4 < everything  # and the statistics' all-reduces


def test_a_partial_over_both_axes_may_be_reduced_whole_at_once(pl24):
    """An AdamW step of two convolutions with the batch split over x and the
    image height over y: each kernel gradient is partial over both axes, and
    reducing it whole in one all-reduce (then updating the whole kernel and
    its moments) is offered, not only one axis at a time. Offered one axis at
    a time, the plan reduce-scattered the gradients and gathered the kernels
    and both moments back: 113,720 B against GSPMD's 93,776 (now 63,800)."""
    import optax

    from sbpjax.compiler.api import state_sbp
    from sbpjax.compiler.reachable import reductions

    assert (B, B) in reductions((P, P), 4) and (S(2), S(0)) in reductions((P, P), 4)
    rng = np.random.default_rng(8)
    dn = ("NHWC", "HWIO", "NHWC")

    def conv2(p, x):
        h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["a"], (2, 2), "SAME", dimension_numbers=dn))
        return jax.lax.conv_general_dilated(h, p["b"], (1, 1), "SAME", dimension_numbers=dn)

    opt = optax.adamw(1e-3, weight_decay=0.01)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((conv2(p, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p = {
        k: (rng.normal(size=s) * 0.2).astype(np.float32)
        for k, s in (("a", (3, 3, 4, 8)), ("b", (3, 3, 8, 8)))
    }
    st = opt.init(p)
    x, y = (
        rng.normal(size=(4, 16, 16, 4)).astype(np.float32),
        rng.normal(size=(4, 8, 8, 8)).astype(np.float32),
    )
    ps = {"a": (B, B), "b": (B, B)}
    ss = state_sbp(st, ps, (B, B))
    in_sbp, out_sbp = (ps, ss, (S(0), S(1)), (S(0), S(1))), (ps, ss, (B, B))
    f = sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp)
    args = (p, st, x, y)
    got = jax.tree.map(lambda t: t.numpy(), f(*args), is_leaf=lambda v: isinstance(v, sj.GlobalTensor))
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4), got, jax.jit(step)(*args))
    moved = moved_bytes(f, *args)
    assert moved == f.explain(*args).bytes
    assert moved <= gspmd_bytes(step, pl24, in_sbp, out_sbp, args)
    assert moved < 93_776


def _grad_step_matches_and_moves_no_more_than_gspmd(step, pl, layouts, args, rtol=1e-4):
    """``sj.jit`` of ``step`` (a ``jax.value_and_grad`` of a loss of ``(p, ...)``)
    with ``layouts`` (in, out) gives ``jax.jit``'s loss and gradients, moves
    what ``explain()`` plans, and no more bytes than GSPMD given the same layouts."""
    f = sj.jit(step, placement=pl, in_sbp=layouts[0], out_sbp=layouts[1])
    (got_loss, got_grads), (want_loss, want_grads) = f(*args), jax.jit(step)(*args)
    assert_close(got_loss.numpy(), np.asarray(want_loss), rtol=1e-5)
    for k in args[0]:
        assert_close(got_grads[k].numpy(), np.asarray(want_grads[k]), rtol=rtol, err_msg=k)
    moved = moved_bytes(f, *args)
    assert moved == f.explain(*args).bytes
    assert moved <= gspmd_bytes(step, pl, *layouts, args)


@pytest.mark.parametrize("act", [jnp.tanh, jax.nn.gelu, jax.nn.silu], ids=["tanh", "gelu", "silu"])
def test_a_weight_gradient_may_gather_the_cotangent_its_activation_meets_split(pl8, act):
    """An FSDP-style MLP step (the first kernel split by columns, the second by
    rows, the batch split): the second kernel's gradient ``dy^T h`` meets
    ``h`` split on its features, as the forward product read it, and ``dy``
    split on the batch it contracts; gathering ``dy`` there is offered
    whatever the greedy pass made ``h``. With gelu or silu it was not (the
    greedy pass left ``h`` partial) and the step moved 23,800 B against
    GSPMD's 18,424 (tanh: 14,840)."""
    rng = np.random.default_rng(0)
    p = {
        "w0": (rng.normal(size=(16, 32)) / 4).astype(np.float32),
        "b0": np.zeros(32, np.float32),
        "w1": (rng.normal(size=(32, 8)) / 6).astype(np.float32),
        "b1": np.zeros(8, np.float32),
    }
    x, y = rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 8)).astype(np.float32)

    def loss(p, x, y):
        return jnp.mean((act(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"] - y) ** 2)

    step = jax.value_and_grad(loss)
    psbp = {"w0": (S(1),), "b0": (S(0),), "w1": (S(0),), "b1": (B,)}
    layouts = ((psbp, (S(0),), (S(0),)), ((B,), psbp))
    _grad_step_matches_and_moves_no_more_than_gspmd(step, pl8, layouts, (p, x, y), rtol=1e-5)


def test_a_replicated_factor_is_read_sliced_beside_a_split_gradient(pl24):
    """optax.adafactor on a row-split kernel (2x4, batch over x, rows over y,
    factored moments replicated): the update scales the gradient by its row
    and column factors, values computed whole on every device from the
    replicated moments. Reading them locally sliced beside the gradient split
    by rows is offered (``Domains._whole_everywhere``), so the gradient is
    reduced over x as it is made, a quarter of the kernel per device. Before,
    it was all-reduced whole: 721,024 B against GSPMD's 337,120."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    p = {"w": (rng.normal(size=(128, 128)) / 10).astype(np.float32)}
    x = rng.normal(size=(64, 128)).astype(np.float32)
    opt = optax.adafactor(1e-2, min_dim_size_to_factor=16)
    state = opt.init(p)

    def step(p, s, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rep = (B, B)
    ssbp = jax.tree.map(lambda _: rep, state)
    layouts = (({"w": (B, S(0))}, ssbp, (S(0), B)), ({"w": (B, S(0))}, ssbp, rep))
    f = sj.jit(step, placement=pl24, in_sbp=layouts[0], out_sbp=layouts[1])
    got, want = f(p, state, x), jax.jit(step)(p, state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(np.asarray(g.numpy() if hasattr(g, "numpy") else g), np.asarray(w), rtol=1e-5)
    moved = moved_bytes(f, p, state, x)
    assert moved == f.explain(p, state, x).bytes
    assert moved <= gspmd_bytes(step, pl24, *layouts, (p, state, x))


def test_noise_drawn_whole_is_read_sliced_beside_its_split_scale(pl24):
    """A VAE's reparameterization, batch over x, the encoder Megatron over y:
    ``exp(0.5 * logvar)`` is split over the batch and whole over y, and the
    noise ``jax.random.normal(key, mu.shape)`` is drawn whole on every
    device. Reading the noise locally sliced to the scale's layout is offered
    (``Domains._elementwise_reads``); before, the product ran split over both
    axes and the latent was all-gathered over y for the decoder: 188,960 B in
    5 collectives against GSPMD's 185,888 B in 4."""
    rng = np.random.default_rng(0)
    d, h, z = 64, 96, 8
    shapes = {"e1": (d, h), "emu": (h, z), "elv": (h, z), "d1": (z, h), "d2": (h, d)}
    p = {k: (rng.normal(size=sh) / np.sqrt(sh[0])).astype(np.float32) for k, sh in shapes.items()}
    x = (rng.random((32, d)) < 0.3).astype(np.float32)

    def loss(p, x):
        hid = jax.nn.relu(x @ p["e1"])
        mu, logvar = hid @ p["emu"], hid @ p["elv"]
        eps = jax.random.normal(jax.random.key(42), mu.shape)
        lat = mu + jnp.exp(0.5 * logvar) * eps
        logits = jax.nn.relu(lat @ p["d1"]) @ p["d2"]
        rec = jnp.sum(jnp.logaddexp(0.0, logits) - x * logits, -1)
        kl = -0.5 * jnp.sum(1 + logvar - mu**2 - jnp.exp(logvar), -1)
        return jnp.mean(rec + kl)

    step = jax.value_and_grad(loss)
    psbp = {"e1": (B, S(1)), "emu": (B, S(0)), "elv": (B, S(0)), "d1": (B, S(1)), "d2": (B, S(0))}
    layouts = ((psbp, (S(0), B)), ((B, B), psbp))
    f = sj.jit(step, placement=pl24, in_sbp=layouts[0], out_sbp=layouts[1])
    (got_loss, got_grads), (want_loss, want_grads) = f(p, x), jax.jit(step)(p, x)
    assert_close(got_loss.numpy(), want_loss, rtol=1e-5)
    for k in p:
        assert_close(got_grads[k].numpy(), want_grads[k], rtol=1e-4)
    moved = moved_bytes(f, p, x)
    assert moved == f.explain(p, x).bytes
    assert moved <= gspmd_bytes(step, pl24, *layouts, (p, x))


@pytest.mark.parametrize("window", [6, 64], ids=["sliding", "causal"])
def test_attention_with_the_sequence_split_gathers_v_beside_probabilities_split_by_query(pl8, window):
    """Self-attention with the sequence split over 8 devices (context
    parallelism) and a sliding-window or causal mask: the scores gather K,
    and the probabilities, split by query, meet V split by key. Gathering V
    there is offered even where the greedy pass split the probabilities by
    key (``gathered_beside``); before, the plan moved the probabilities to a
    split by key and reduce-scattered the partial result: 258,048 B in 3
    collectives against GSPMD's 229,376 in 2."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 64, 32)).astype(np.float32)
    ws = [(rng.normal(size=(32, 32)) / 6).astype(np.float32) for _ in range(3)]

    def attend(x, wq, wk, wv):
        q, k, v = x @ wq, x @ wk, x @ wv
        i, j = jnp.arange(64)[:, None], jnp.arange(64)[None, :]
        s = jnp.einsum("bqd,bkd->bqk", q, k) / 4.0
        s = jnp.where(((j <= i) & (j > i - window))[None], s, -jnp.inf)
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, -1), v)

    layouts = (((S(1),), (B,), (B,), (B,)), (S(1),))
    f = sj.jit(attend, placement=pl8, in_sbp=layouts[0], out_sbp=layouts[1])
    assert_close(f(x, *ws).numpy(), np.asarray(jax.jit(attend)(x, *ws)), rtol=1e-5)
    moved = moved_bytes(f, x, *ws)
    assert moved == f.explain(x, *ws).bytes
    assert moved <= gspmd_bytes(attend, pl8, *layouts, (x, *ws))


def test_grouped_query_attention_with_the_sequence_split_gathers_v_where_greedy_reads_it_by_key(pl8):
    """A training step of grouped-query attention (4 query heads per
    key/value head, 2 key/value heads, causal) with the sequence split over
    8 devices. The greedy pass makes the probabilities whole and slices them
    by key beside V split by key, a partial product as its layouts are read
    (not as they are made); V gathered beside the probabilities split by
    query is offered there too (``Domains._product_reads``). Before, the plan
    moved the probabilities to a split by key and all-reduced the attention
    output: 544,768 B against GSPMD's 458,808 (now 401,464)."""
    rng = np.random.default_rng(3)
    b, t, d, kv, g, dh = 2, 32, 32, 2, 4, 8
    p = {
        "wq": rng.normal(size=(d, kv * g * dh)).astype(np.float32) / np.sqrt(d),
        "wk": rng.normal(size=(d, kv * dh)).astype(np.float32) / np.sqrt(d),
        "wv": rng.normal(size=(d, kv * dh)).astype(np.float32) / np.sqrt(d),
        "wo": rng.normal(size=(kv * g * dh, d)).astype(np.float32) / np.sqrt(kv * g * dh),
    }
    x, y = rng.normal(size=(2, b, t, d)).astype(np.float32)

    def loss(p, x, y):
        q = (x @ p["wq"]).reshape(b, t, kv, g, dh)
        k = (x @ p["wk"]).reshape(b, t, kv, dh)
        v = (x @ p["wv"]).reshape(b, t, kv, dh)
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) / np.sqrt(dh)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
        return jnp.mean((o @ p["wo"] - y) ** 2)

    step = jax.value_and_grad(loss)
    whole = {k: (B,) for k in p}
    layouts = ((whole, (S(1),), (S(1),)), ((B,), whole))
    _grad_step_matches_and_moves_no_more_than_gspmd(step, pl8, layouts, (p, x, y))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_a_packed_sequence_mask_gathers_the_segment_ids_it_broadcasts_by_key(pl24, grad):
    """Attention over packed sequences (each row several documents: a token
    sees the earlier tokens of its own segment), the batch split over x and
    the time over y. The mask compares the segment ids broadcast by query
    with those broadcast by key: made as the ids are, the two are split on
    different dims, so the comparison could only run after moving one of
    them at full (b, t, t) size. Reading the ids gathered where they are
    broadcast is offered (``Domains._gathered_or_moved_reads``), so the mask
    is made split by query, as the scores are; before, the forward pass
    moved 29,240 B against GSPMD's 25,808."""
    rng = np.random.default_rng(1)
    b, t, d = 4, 16, 16
    starts = rng.random((b, t)) < 0.25
    starts[:, 0] = True
    seg = np.cumsum(starts, 1).astype(np.int32)
    x = rng.normal(size=(b, t, d)).astype(np.float32)
    p = {k: (rng.normal(size=(d, d)) / 4).astype(np.float32) for k in ("wq", "wk", "wv")}

    def loss(p, x, seg):
        q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
        pos = jnp.arange(t)
        mask = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None] >= pos[None, :])
        s = jnp.where(mask, jnp.einsum("btd,bsd->bts", q, k) / 4.0, -1e9)
        return jnp.mean(jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v) ** 2)

    psbp = {k: (B, B) for k in p}
    if grad:
        layouts = ((psbp, (S(0), S(1)), (S(0), S(1))), ((B, B), psbp))
        _grad_step_matches_and_moves_no_more_than_gspmd(jax.value_and_grad(loss), pl24, layouts, (p, x, seg))
        return
    layouts = ((psbp, (S(0), S(1)), (S(0), S(1))), (B, B))
    f = sj.jit(loss, placement=pl24, in_sbp=layouts[0], out_sbp=layouts[1])
    assert_close(f(p, x, seg).numpy(), np.asarray(jax.jit(loss)(p, x, seg)), rtol=1e-5)
    moved = moved_bytes(f, p, x, seg)
    assert moved == f.explain(p, x, seg).bytes
    assert moved <= gspmd_bytes(loss, pl24, *layouts, (p, x, seg))


def test_a_kernel_split_over_the_batchs_axis_beside_tensor_parallelism_is_gathered(pl24):
    """An attention step on 2x4 with the batch over x, the heads over y
    (query, key and value kernels split by column over y) and the output
    kernel's rows split over x, a layout mixing FSDP and tensor parallelism.
    The output kernel may be gathered over x where a contraction reads it,
    and sliced by rows over y there to meet the heads (``Domains._gathered``;
    before, weights split over the batch's axis alone were gathered only on
    placements of one axis): 220,240 B in 14 collectives against GSPMD's
    151,584 before, 106,552 B in 7 now."""
    rng = np.random.default_rng(4)
    b, t, d, heads = 8, 16, 32, 4
    p = {k: (rng.normal(size=(d, d)) / np.sqrt(d)).astype(np.float32) for k in ("wq", "wk", "wv", "wo")}
    x = rng.normal(size=(b, t, d)).astype(np.float32)

    def loss(p, x):
        q, k, v = ((x @ p[n]).reshape(b, t, heads, -1) for n in ("wq", "wk", "wv"))
        a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads), -1)
        o = jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d)
        return jnp.mean((x + o @ p["wo"]) ** 2)

    step = jax.value_and_grad(loss)
    psbp = {"wq": (B, S(1)), "wk": (B, S(1)), "wv": (B, S(1)), "wo": (S(0), B)}
    layouts = ((psbp, (S(0), B)), ((B, B), psbp))
    _grad_step_matches_and_moves_no_more_than_gspmd(step, pl24, layouts, (p, x))


def test_inputs_normalized_before_their_first_projection_are_the_batch():
    """A pre-norm MLP block's training step on 4x2: the batch over x, the
    first kernel split by columns over y, the second by columns over x. The
    inputs are read by an RMSNorm before any contraction; they count as data
    all the same (``data._read_as_data``), so x is the batch's axis and the
    second kernel, split over it alone, may be gathered where its product
    reads it. Before, no batch was seen, the kernel stayed split and the
    activations moved around it: 425,784 B in 24 collectives against
    GSPMD's 345,648 (now 280,368 in 7)."""
    rng = np.random.default_rng(5)
    d, h = 32, 128
    p = {
        "g": (1 + 0.1 * rng.normal(size=d)).astype(np.float32),
        "w1": (rng.normal(size=(d, h)) / np.sqrt(d)).astype(np.float32),
        "w2": (rng.normal(size=(h, d)) / np.sqrt(h)).astype(np.float32),
    }
    x, y = rng.normal(size=(2, 64, d)).astype(np.float32)

    def loss(p, x, y):
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * p["g"]
        return jnp.mean((x + jax.nn.gelu(normed @ p["w1"]) @ p["w2"] - y) ** 2)

    psbp = {"g": (B, B), "w1": (B, S(1)), "w2": (S(1), B)}
    layouts = ((psbp, (S(0), B), (S(0), B)), ((B, B), psbp))
    pl42 = sj.placement((4, 2), ("x", "y"))
    _grad_step_matches_and_moves_no_more_than_gspmd(jax.value_and_grad(loss), pl42, layouts, (p, x, y))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_an_associative_scan_over_a_split_sequence_moves_the_split_once(pl8, grad):
    """``lax.associative_scan`` of a linear recurrence (Mamba-style) over a
    sequence split over 8 devices: its levels slice the sequence with
    stride 2, local for the first levels only. A strided slice over a split
    dim may read its operand with that split moved to another dim
    (``domains._strided_on_split``), so the split moves to the channels once,
    at the inputs. Before, the greedy pass's route was the only one: each
    level's values moved as they lost their alignment, 25,088 B in 6
    collectives against GSPMD's 14,336 in 2 (the gradient: 50,176 B, its
    results left split by sequence; now 14,336)."""
    rng = np.random.default_rng(0)
    a = np.exp(-np.abs(rng.normal(size=(4, 32, 16)))).astype(np.float32)
    bx = rng.normal(size=(4, 32, 16)).astype(np.float32)

    def recurrence(a, bx):
        def op(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        return jax.lax.associative_scan(op, (a, bx), axis=1)[1]

    fn = jax.grad(lambda a, bx: jnp.sum(jnp.tanh(recurrence(a, bx))), argnums=(0, 1)) if grad else recurrence
    in_sbp = ((S(1),), (S(1),))
    f = sj.jit(fn, placement=pl8, in_sbp=in_sbp)  # the results' layouts are the plan's to choose
    got = jax.tree.leaves(f(a, bx), is_leaf=lambda t: isinstance(t, sj.GlobalTensor))
    for g, w in zip(got, jax.tree.leaves(jax.jit(fn)(a, bx)), strict=True):
        assert_close(g.numpy(), np.asarray(w), rtol=1e-5)
    moved = moved_bytes(f, a, bx)
    assert moved == f.explain(a, bx).bytes
    # GSPMD given the same results' layouts (its own choice keeps them split by sequence: 3x the bytes)
    out_sbp = tuple(g.sbp for g in got) if grad else got[0].sbp
    assert moved <= gspmd_bytes(fn, pl8, in_sbp, out_sbp, (a, bx))
