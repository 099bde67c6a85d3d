"""Run under ``python -m sbpjax.launch -n 2 --local-devices 4`` (tests/test_multihost.py).

Every process runs the same program on a 2x4 placement whose first row of
devices belongs to process 0 and whose second row to process 1; each check
compares with NumPy on the whole array, computed in every process. The last
line each process prints is ``OK <process index>``.
"""

import hashlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np

import sbpjax as sj
from sbpjax import B, S

assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
me = jax.process_index()
pl = sj.placement((2, 4), ("x", "y"))
assert {d.process_index for d in pl.devices[me]} == {me}  # row `me` of the grid is this process's


def check(got, want, what):
    np.testing.assert_array_equal(got, want, err_msg=what)


# -- boxing: every pair of a set of layouts, across the processes -------------------
layouts = [
    (S(0), S(1)),
    (S(1), S(0)),
    (S(0), S(0)),
    (B, S(1)),
    (S(1), B),
    (B, B),
    (sj.P, S(0)),
    (S(0), sj.P),
    (sj.P, sj.P),
    (sj.P_max, B),
]
pairs = 0
for shape in [(8, 8), (6, 10)]:  # even, and uneven on both axes
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) - 17
    for src, dst in itertools.product(layouts, layouts):
        t = sj.to_global(x, pl, src)
        u = t.to_global(sbp=dst)
        check(u.numpy(), x, f"{shape} {sj.format_sbp(src)} -> {sj.format_sbp(dst)}")
        pairs += 1
print("boxing pairs equal the logical array:", pairs)

# -- this process's pieces --------------------------------------------------------
x = np.arange(64, dtype=np.float32).reshape(8, 8)
t = sj.to_global(x, pl, (S(0), S(1)))
pieces = t.local_tensors()
assert all(p is None for p in pieces[1 - me]) and all(p is not None for p in pieces[me])
check(pieces[me][2], x[me * 4 : me * 4 + 4, 4:6], "local_tensors")
back = sj.from_local_tensors(pieces, pl, (S(0), S(1)), x.shape)  # other processes' entries: None
check(back.numpy(), x, "from_local_tensors")

# each process passes only its rows
rows = x[me * 4 : (me + 1) * 4]
t = sj.to_global(rows, pl, (S(0), B), process_local=True)
assert t.shape == (8, 8)
check(t.numpy(), x, "to_global(process_local=True)")
check(t.to_global(sbp=(B, S(1))).numpy(), x, "process-local then boxed")

# -- transfers between placements of different processes ------------------------------
first = sj.Placement(np.array(jax.devices()[:4]), ("d",))  # process 0's devices
second = sj.Placement(np.array(jax.devices()[4:]), ("d",))  # process 1's
t = sj.to_global(x, first, S(0))
if me == 0:
    check(t.numpy(), x, "a placement of one process, read there")
else:
    try:
        t.numpy()  # would wait for process 0 in a gather it never joins
    except sj.SBPError as e:
        assert "cannot gather it alone" in str(e), e
    else:
        raise AssertionError("numpy() of another process's tensor was not refused")


def read_where_it_lives(t, owner, what):
    """The value, read in the process that holds the placement (the other has a handle)."""
    if me == owner:
        check(t.numpy(), x, what)


# every process calls every transfer with the same arguments (SPMD); odd sizes included
odd = np.random.default_rng(1).normal(size=(6, 10)).astype(np.float32)
moved = 0
for value in (x, odd):
    for src_sbp, dst_sbp in itertools.product([S(0), S(1), B, sj.P], [S(0), S(1), B, sj.P]):
        for (a, b), owner in (((first, second), 1), ((second, first), 0)):
            t = sj.to_global(value, a, src_sbp)
            u = t.to_global(sbp=dst_sbp, placement=b)
            assert u.placement == b and u.sbp == (dst_sbp,)
            if me == owner:
                check(u.numpy(), value, f"transfer {src_sbp} -> {dst_sbp} to process {owner}")
            moved += 1
# 2-D grids: one process's 2x2 devices to the other's
grid0 = sj.Placement(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
grid1 = sj.Placement(np.array(jax.devices()[4:]).reshape(2, 2), ("a", "b"))
for src_sbp, dst_sbp in [((S(0), S(1)), (B, S(0))), ((sj.P, S(0)), (S(1), sj.P)), ((B, B), (S(1), S(0)))]:
    u = sj.to_global(x, grid0, src_sbp).to_global(sbp=dst_sbp, placement=grid1)
    if me == 1:
        check(u.numpy(), x, f"2x2 transfer {src_sbp} -> {dst_sbp}")
    moved += 1
try:
    sj.to_global(x, first, S(0)).to_global(sbp=(S(0), B), placement=grid1)
except sj.SBPError as e:
    assert "one grid shape" in str(e), e
else:
    raise AssertionError("a transfer across processes between grids (4,) and (2, 2) was not refused")
print(f"transfers across processes: {moved} equal the logical array; other grid shapes refused")

# -- sj.jit: a Megatron MLP train step, against the same step on one local device ---
rng = np.random.default_rng(0)
w1 = (rng.normal(size=(16, 32)) / 4).astype(np.float32)
w2 = (rng.normal(size=(32, 16)) / 6).astype(np.float32)
batch = rng.normal(size=(8, 16)).astype(np.float32)


def loss(w1, w2, v):
    return jnp.mean((jnp.tanh(v @ w1) @ w2 - v) ** 2)


def step(w1, w2, v):
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, v)
    return value, w1 - 0.1 * g1, w2 - 0.1 * g2


f = sj.jit(
    step,
    placement=pl,
    in_sbp=((B, S(1)), (B, S(0)), (S(0), B)),
    out_sbp=(None, (B, S(1)), (B, S(0))),
)
ref = jax.jit(step)  # inputs committed to this process's first device: a one-device run
a, b = (jax.device_put(w, jax.local_devices()[0]) for w in (w1, w2))
ga, gb = sj.to_global(w1, pl, (B, S(1))), sj.to_global(w2, pl, (B, S(0)))
for k in range(3):
    value, ga, gb = f(ga, gb, batch)
    want, a, b = ref(a, b, jax.device_put(batch, jax.local_devices()[0]))
    np.testing.assert_allclose(value.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=f"loss {k}")
np.testing.assert_allclose(ga.numpy(), np.asarray(a), rtol=1e-5, atol=1e-6, err_msg="w1 after 3 steps")
e = f.explain(ga, gb, batch)
measured = sum(c.bytes for c in sj.collectives(f.lower(ga, gb, batch).compile()))
assert e.bytes == measured, (e.bytes, measured)
print("sj.jit: 3 steps equal one device; bytes", e.bytes)
# process 0 planned the step and sent its plan: every process runs its signatures
signatures = [(tuple(d.in_sbp), tuple(d.out_sbp)) for d in e.propagation.decisions]
print("PLAN", e.choice.source, hashlib.sha256(repr(signatures).encode()).hexdigest())

# a process calling with another shape gets an SBPError (in every process), not a hang
wrong = batch if me == 0 else batch[:4]
try:
    f(ga, gb, wrong)
except sj.SBPError as err:
    assert "other argument shapes" in str(err), err
else:
    raise AssertionError("a call with different shapes in the two processes was not refused")
print("different shapes across processes: refused with SBPError")

# likewise a static argument whose value differs between the processes
scaled = sj.jit(lambda x, k: x * k, placement=pl, in_sbp=(S(0), B), static_argnums=1)
np.testing.assert_allclose(
    scaled(batch, 3).numpy(), batch * 3, rtol=1e-6, atol=1e-6 * 3 * np.abs(batch).max()
)
try:
    scaled(batch, 3 + me)
except sj.SBPError as err:
    assert "static arguments" in str(err), err
else:
    raise AssertionError("a call with different static values in the two processes was not refused")
print("different static values across processes: refused with SBPError")
print("OK", me)
