"""Slices and pads that move rows along a split dim (``sbpjax.rules.shifts``):
each device reads its result rows from its own piece and a few rows of its
neighbours, brought by one exchange per side, on even and uneven pieces, or,
for larger cuts and concatenations, from farther pieces, one exchange per
distance;
``slice(pad(x))`` and ``pad(pad(x))`` are one pad (``trace._fuse_padded_slices``).
Values against the one-device program, the plan's bytes against the compiled
program's collectives, and against GSPMD's where GSPMD takes the layout."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import gspmd_bytes, moved_bytes
from jax import lax

import sbpjax as sj
from sbpjax.compiler.trace import trace
from sbpjax.layout import balanced_piece
from sbpjax.rules.shifts import may_shift

S0, S1, B = sj.S(0), sj.S(1), sj.B


def _check(fn, x, pl, sbp):
    f = sj.jit(fn, placement=pl, in_sbp=(sbp,), out_sbp=sbp)
    np.testing.assert_array_equal(f(x).numpy(), np.asarray(jax.jit(fn)(x)))
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes
    return moved


@pytest.mark.parametrize("rows", [64, 30])
def test_every_small_cut_at_either_end(pl8, rows):
    """``x[k:rows - e]`` for cuts of up to 4 rows at each end. On 8 pieces of
    8, at most one exchange per side, of at most ``k`` (or ``e``) rows plus
    the row the pieces' new sizes move, never the value. On 30 rows the
    pieces' sizes drift further (4,4,3,3,3,3,3,3 against 4,4,4,4,4,4,3,3 for
    ``x[:26]``): where a piece needs rows from past its neighbours, the value
    is boxed first, never more than gathering its padded blocks."""
    x = np.random.default_rng(rows).normal(size=(rows, 4)).astype(np.float32)
    row = 4 * 4
    for k in range(5):
        for e in range(5):

            def cut(x, k=k, e=e):
                return x[k : rows - e] * 2.0

            moved = _check(cut, x, pl8, (S0,))
            # each of the 7 neighbouring pairs exchanges at most k + e + 1 rows
            assert moved <= 7 * (k + e + 1 if rows % 8 == 0 else 8 * -(-rows // 8)) * row, (k, e, moved)


def test_pads_and_cuts_over_two_axes(pl24):
    x = np.random.default_rng(2).normal(size=(30, 3)).astype(np.float32)
    for lo, hi in [(2, 0), (0, 3), (3, -2), (-2, 1), (1, 1)]:

        def shift(x, lo=lo, hi=hi):
            return lax.pad(x * 2.0, jnp.float32(-1.0), ((lo, hi, 0), (0, 0, 0)))

        moved = _check(shift, x, pl24, (S0, S0))
        assert moved <= 7 * (abs(lo) + abs(hi) + 1) * 3 * 4, (lo, hi, moved)


def test_a_causal_convolution_of_shifted_slices(pl8):
    """A depthwise causal convolution written as padded shifted slices of the
    sequence (Mamba's short convolution, by hand), split along the sequence:
    its value and gradient move what GSPMD's do, or less (they were boxed:
    all-to-all'd whole before)."""
    r = np.random.default_rng(3)
    x = r.normal(size=(4, 64, 16)).astype(np.float32)
    w = r.normal(size=(4, 16)).astype(np.float32)

    def conv(x):
        xp = jnp.pad(x, ((0, 0), (3, 0), (0, 0)))
        return sum(w[i] * xp[:, i : i + x.shape[1]] for i in range(4))

    step = jax.value_and_grad(lambda x: jnp.sum(jnp.tanh(conv(x))))
    f = sj.jit(step, placement=pl8, in_sbp=((S1,),), out_sbp=((B,), (S1,)))
    got, want = f(x), jax.jit(step)(x)
    np.testing.assert_allclose(got[0].numpy(), want[0], rtol=1e-5, atol=1e-5 * float(np.abs(want[0])))
    np.testing.assert_allclose(got[1].numpy(), want[1], rtol=1e-5, atol=1e-6 * float(np.abs(want[1]).max()))
    ours = moved_bytes(f, x)
    assert ours == f.explain(x).bytes
    assert ours <= gspmd_bytes(step, pl8, ((S1,),), ((B,), (S1,)), (x,)), ours


def test_a_pad_then_a_slice_is_one_shift(pl8):
    x = np.random.default_rng(4).normal(size=(4, 64, 16)).astype(np.float32)

    def fn(x):
        return jnp.pad(x, ((0, 0), (3, 1), (0, 0)))[:, 2:-2] * 2.0

    program = trace(fn, [jax.ShapeDtypeStruct(x.shape, x.dtype)], jax.tree_util.tree_structure(((x,), {})))
    assert [n.name for n in program.nodes if n.name in ("pad", "slice")] == ["pad"]
    moved = _check(fn, x, pl8, (S1,))
    assert moved == 7 * 4 * 16 * 4  # one row from each piece to the next, as x shifted by one


def test_rows_cut_then_padded_back_stay_padding(pl8):
    """``pad(pad(x, (-2, 0)), (2, 0))`` is not ``x``: the two pads are not fused."""
    x = np.arange(64 * 2, dtype=np.float32).reshape(64, 2)

    def fn(x):
        return lax.pad(
            lax.pad(x, jnp.float32(0), ((-2, 0, 0), (0, 0, 0))), jnp.float32(0), ((2, 0, 0), (0, 0, 0))
        )

    _check(fn, x, pl8, (S0,))


def test_which_ops_may_shift():
    def eqn(fn, shape=(64, 8)):
        return jax.make_jaxpr(fn)(jnp.zeros(shape)).jaxpr.eqns[0]

    def cut(starts, limits):
        return eqn(lambda x: lax.slice(x, starts, limits))

    def pad(cfg):
        return eqn(lambda x: lax.pad(x, 0.0, cfg))

    assert may_shift(cut((2, 0), (64, 8)))
    assert may_shift(cut((0, 0), (63, 8)))
    assert may_shift(pad(((3, 0, 0), (0, 0, 0))))
    assert may_shift(pad(((-3, 2, 0), (0, 0, 0))))
    assert may_shift(cut((32, 0), (64, 8)))  # rows of far pieces: a cut
    assert may_shift(cut((0, 0), (64, 4)))  # half of a dim of 8
    assert not may_shift(cut((0, 0), (64, 8)))  # nothing moves


@pytest.mark.parametrize("seed", range(4))
def test_only_candidates_splitting_a_moved_dim_communicate(seed):
    """The greedy pass ranks a slice's or pad's candidates by estimate and
    costs exactly only the best few, plus every candidate that splits a dim
    the op moves (``shifts.splits_moved_dim``): the estimate does not see an
    op's own exchanges. That holds only if no other candidate communicates:
    every product of the rule's 1-D candidates over 2x4 and 8 that splits no
    moved dim on any axis runs with no exchange of its own, for random
    slices (strided or not) and pads (interior or not) of a 3-D value."""
    from sbpjax.rules import RULES
    from sbpjax.rules.shifts import shift_comms, splits_moved_dim

    r = np.random.default_rng(seed)
    shape = tuple(int(v) for v in r.integers(3, 20, size=3))
    loud = 0  # candidates splitting a moved dim that do exchange rows (the test is not vacuous)
    for trial in range(20):
        if trial % 2:
            starts = tuple(int(r.integers(0, n // 2 + 1)) for n in shape)
            limits = tuple(int(r.integers(a + 1, n + 1)) for a, n in zip(starts, shape))
            strides = tuple(int(r.choice([1, 1, 2, 3])) for _ in shape)
            eqn = jax.make_jaxpr(lambda x, a=starts, b=limits, s=strides: lax.slice(x, a, b, s))(
                jnp.zeros(shape)
            ).jaxpr.eqns[0]
        else:
            cfg = tuple(
                (int(r.integers(-n // 3, 4)), int(r.integers(-n // 3, 4)), int(r.choice([0, 0, 1])))
                for n in shape
            )
            eqn = jax.make_jaxpr(lambda x, c=cfg: lax.pad(x, 0.0, c))(jnp.zeros(shape)).jaxpr.eqns[0]
        in_avals = [v.aval for v in eqn.invars]
        sigs = RULES[eqn.primitive.name].signatures(eqn, in_avals)
        quiet = [sg for sg in sigs if not splits_moved_dim(eqn, sg)]
        assert len(quiet) < len(sigs) or not may_shift(eqn), eqn
        for grid in ((2, 4), (8,)):
            for combo in itertools.product(quiet, repeat=len(grid)):
                ins = [tuple(sg.ins[j] for sg in combo) for j in range(len(eqn.invars))]
                outs = [tuple(sg.outs[0] for sg in combo)]
                # no exchange: nothing to send ([]), or a product that cannot run (None)
                assert shift_comms(eqn, in_avals, ins, outs, grid) in ([], None), (eqn, combo)
        for sg in sigs:
            if splits_moved_dim(eqn, sg):
                nds = [(q,) for q in sg.ins], [(q,) for q in sg.outs]
                loud += bool(shift_comms(eqn, in_avals, *nds, (8,)))
    assert loud


@pytest.mark.parametrize("solver", ["greedy", "ilp"])
def test_slices_whose_moved_split_cannot_run_take_the_cheapest_other(solver):
    """Where a slice's split of the dim it moves cannot run (a stride the
    pieces do not keep, a cut leaving a device empty), the greedy pass costs
    every candidate, not only the best few by estimate, whose free partials
    and unrunnable split left only a gather: each plan moves what it moved
    when every candidate of such ops was costed (the review of the few:
    ``x[:, 1::3]`` over 2x4 moved 50,176 B instead of 21,504)."""
    r = np.random.default_rng(5)
    pl8, pl24 = sj.placement(8, "x"), sj.placement((2, 4), ("x", "y"))
    cases = [
        (lambda x: jnp.tanh(x[13:]), (16, 64), pl8, (S0,), 3584),
        (lambda x: jnp.tanh(x[:, 13:]), (8, 16, 32), pl8, (S1,), 14336),
        (lambda x: jnp.tanh(x[:, 13:]), (8, 16, 32), pl24, (S1, S1), 14336),
        (lambda x: jnp.tanh(x[:, 1::3]), (8, 21, 32), pl24, (S1, S1), 21504),
        (lambda x: jnp.tanh(x[:, 1::3]), (8, 21, 32), pl8, (S1,), 21504),
        (
            lambda x: jnp.tanh(lax.pad(x, 0.0, [(0, 0, 0), (1, 0, 2), (0, 0, 0)])),
            (4, 12, 32),
            pl24,
            (S1, S1),
            7168,
        ),
    ]
    for fn, shape, pl, sbp, before in cases:
        x = r.normal(size=shape).astype(np.float32)
        f = sj.jit(fn, placement=pl, in_sbp=(sbp,), solver=solver)
        np.testing.assert_allclose(f(x).numpy(), np.asarray(jax.jit(fn)(x)), rtol=1e-6, atol=1e-6)
        moved = moved_bytes(f, x)
        assert moved == f.explain(x).bytes
        assert moved <= before, (shape, sbp, moved, before)


@pytest.mark.parametrize("rows", [64, 30])
def test_rolls_move_each_row_once(pl8, rows):
    """``jnp.roll`` along a split dim by any amount. On even pieces (64 rows)
    it is one ``roll`` op (``rewrites.rolls``): exactly the rows that change
    device move, as GSPMD moves them, in one collective permute per part of
    a piece that changes device (two where neither part stays: a roll by 17
    rows on pieces of 8). On pieces of 4 and 3 rows (30, where a
    split may be uneven) it stays two parts padded into place, each slice
    and pad one pad, so one shift or cut each: each distance's exchange
    sends the most rows any pair of pieces needs (at most 1.5x)."""
    x = np.random.default_rng(rows).normal(size=(rows, 4)).astype(np.float32)
    starts = [balanced_piece(rows, 8, c)[0] for c in range(8)]
    piece = [max(c for c in range(8) if starts[c] <= r) for r in range(rows)]
    for k in (1, -1, 3, -5, 7, 8, 17, rows // 2):

        def roll(x, k=k):
            return jnp.roll(x, k, axis=0) * 2.0

        program = trace(
            roll,
            [jax.ShapeDtypeStruct(x.shape, x.dtype)],
            jax.tree_util.tree_structure(((x,), {})),
            devices=8,
        )
        names = [n.name for n in program.nodes]
        assert "concatenate" not in names and ("roll" in names) == (rows % 8 == 0)
        moved = _check(roll, x, pl8, (S0,))
        changed = sum(piece[r] != piece[(r + k) % rows] for r in range(rows)) * 4 * 4
        if rows % 8 == 0:
            assert moved == changed, (k, moved, changed)
            permutes = len(
                sj.collectives(sj.jit(roll, placement=pl8, in_sbp=(S0,), out_sbp=S0).lower(x).compile())
            )
            # pieces of 8 rows: the last t rows go q + 1 pieces on, the rest q (mod 8; 0: kept)
            q, t = divmod(k % rows, 8)
            assert permutes == (t > 0 and (q + 1) % 8 != 0) + (q % 8 != 0), (k, permutes)
        else:
            assert changed <= moved <= 1.5 * changed, (k, moved, changed)


def test_a_roll_over_two_axes_rotates_the_pieces_in_group_order():
    """A roll of a dim split over both axes of 2x4 (8 pieces, the outer axis
    first), by fewer rows than a piece, and by more: the rows move as on 8
    devices of one axis, the values equal ``jnp.roll``'s, and the compiled
    program moves what explain() says, in one permute for the short roll.
    Rolled after a flip, the pair moves what GSPMD's collective permutes do
    (it once cost a third permute, the rows that wrap around)."""
    pl = sj.placement((2, 4), ("x", "y"))
    x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    for k, permutes in ((3, 1), (-1, 1), (17, 2)):
        moved = _check(lambda a, k=k: jnp.roll(a, k, 0) * 2.0, x, pl, (S0, S0))
        changed = sum(r // 8 != ((r + k) % 64) // 8 for r in range(64)) * 16 * 4
        assert moved == changed
        f = sj.jit(lambda a, k=k: jnp.roll(a, k, 0) * 2.0, placement=pl, in_sbp=((S0, S0),), out_sbp=(S0, S0))
        assert len(sj.collectives(f.lower(x).compile())) == permutes

    def flipped(a):
        return jnp.roll(jnp.flip(a, 0), 3, 0) + a

    moved = _check(flipped, x, pl, (S0, S0))
    assert moved <= gspmd_bytes(flipped, pl, ((S0, S0),), (S0, S0), (x,))


def test_a_short_piece_never_sends_holes(pl8):
    """35 rows padded by 5 at the start and cut by 3 at the end: the second
    piece needs 5 rows of the first, and the fifth 4 rows of the fourth (a
    piece of 4). Each piece sends its last ``left`` rows, one exchange for
    all, so a piece shorter than that would send a hole: the value is boxed
    first instead (it read a hole, before the check)."""
    x = np.arange(35 * 2, dtype=np.float32).reshape(35, 2)

    def fn(x):
        return lax.pad(x, jnp.float32(-1.0), ((5, -3, 0), (0, 0, 0))) * 2.0

    _check(fn, x, pl8, (S0,))


@pytest.mark.parametrize("seed", range(3))
def test_random_slices_and_pads(seed):
    """Slices and pads of random sizes and ends along a dim split over one
    axis or two, evenly or not: values equal the one-device program's and
    the plan's bytes the compiled program's."""
    r = np.random.default_rng(seed)
    layouts = [
        (sj.placement(8, "x"), (S0,)),
        (sj.placement((2, 4), ("x", "y")), (S0, S0)),
        (sj.placement((4, 2), ("x", "y")), (S0, S1)),
    ]
    for trial in range(12):
        pl, sbp = layouts[trial % len(layouts)]
        n = int(r.integers(16, 70))
        x = r.normal(size=(n, 6)).astype(np.float32)
        if trial % 2:
            a, b = int(r.integers(0, n // 3)), int(r.integers(n - n // 3, n + 1))

            def fn(x, a=a, b=b):
                return lax.slice(x, (a, 0), (b, 6)) * 2.0
        else:
            lo, hi = int(r.integers(-n // 4, n // 4)), int(r.integers(-n // 4, n // 4))

            def fn(x, lo=lo, hi=hi):
                return lax.pad(x * 2.0, jnp.float32(-3.0), ((lo, hi, 0), (0, 0, 0)))

        _check(fn, x, pl, sbp)


@pytest.mark.parametrize("seed", range(3))
def test_random_cuts_and_concatenations(seed):
    """Cuts by half or more (``shifts.Cut``: rows of pieces beyond the
    neighbours), ``jnp.split`` and concatenations of split operands along
    their split dim, of random sizes, over one axis or two, evenly or not:
    values equal the one-device program's and the plan's bytes the compiled
    program's."""
    r = np.random.default_rng(100 + seed)
    layouts = [
        (sj.placement(8, "x"), (S0,)),
        (sj.placement((2, 4), ("x", "y")), (S0, S0)),
        (sj.placement((4, 2), ("x", "y")), (S0, S1)),
    ]
    for trial in range(9):
        pl, sbp = layouts[trial % len(layouts)]
        n = int(r.integers(24, 90))
        x = r.normal(size=(n, 6)).astype(np.float32)
        kind = trial % 3
        if kind == 0:  # one cut of at least 8 rows, anywhere
            a = int(r.integers(0, n - 8))
            b = int(r.integers(a + 8, n + 1))

            def fn(x, a=a, b=b):
                return x[a:b] * 2.0
        elif kind == 1:  # uneven thirds, each scaled, put back together
            cuts = sorted(int(c) for c in r.choice(np.arange(8, n - 8), 2, replace=False))
            if cuts[1] - cuts[0] < 8:
                cuts[1] = cuts[0] + 8

            def fn(x, cuts=tuple(cuts)):
                a, b, c = jnp.split(x, cuts)
                return jnp.concatenate([c * 3.0, a, b * 2.0])
        else:  # the two halves swapped
            h = int(r.integers(8, n - 8))

            def fn(x, h=h):
                return jnp.concatenate([x[h:], x[:h] * 2.0])

        _check(fn, x, pl, sbp)


def test_a_fused_projection_cut_in_thirds_moves_only_changed_columns(pl24):
    """``q, k, v = jnp.split(x @ w, 3, -1)`` with ``w``'s 384 columns split
    over y (pieces of 96): each third's pieces of 32 come from wherever they
    lie (``splits_as_slices``, ``shifts.Cut``). The bytes are the columns
    that change device, counted here, and the gradient (a concatenation of
    split operands) matches the one-device program."""
    r = np.random.default_rng(5)
    args = (r.normal(size=(8, 32, 128)), r.normal(size=(128, 384)) / 11, r.normal(size=(128, 128)) / 11)
    args = tuple(a.astype(np.float32) for a in args)

    def attention(x, w, o):
        q, k, v = (t.reshape(8, 32, 4, 32) for t in jnp.split(x @ w, 3, -1))
        a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
        return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(8, 32, 128) @ o

    in_sbp = ((S0, B), (B, S1), (B, S0))
    f = sj.jit(attention, placement=pl24, in_sbp=in_sbp)
    np.testing.assert_allclose(f(*args).numpy(), jax.jit(attention)(*args), rtol=2e-5, atol=2e-5 * 30)
    # column c of the 384 lies on device c // 96 of y; third t's column j on device j // 32
    moved_columns = sum(c // 96 != (c % 128) // 32 for c in range(384))
    column = 4 * 32 * 4  # a device's column: the batch's half over x, 32 tokens, f32
    groups = 2  # the rows of x, each moving its columns over y
    assert moved_bytes(f, *args) == f.explain(*args).bytes == groups * moved_columns * column

    grads = jax.grad(lambda *a: jnp.sum(attention(*a) ** 2), argnums=(0, 1, 2))
    g = sj.jit(grads, placement=pl24, in_sbp=in_sbp)
    for got, want in zip(g(*args), jax.jit(grads)(*args)):
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))
    assert moved_bytes(g, *args) <= gspmd_bytes(grads, pl24, in_sbp, None, args)
