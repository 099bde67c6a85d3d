"""Scans written out to choose layouts are rolled back into loops when lowered
(sbpjax.compiler.loops): the compiled program has one ``while`` per scan whose
iterations run alike, values equal ``jax.jit``'s, and the plan's bytes equal
the compiled program's (XLA's trip count multiplies the body's collectives)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, moved_bytes

import sbpjax as sj
from sbpjax import B, P, S
from sbpjax.compiler import loops

RNG = np.random.default_rng(0)
XS = RNG.normal(size=(5, 16, 8)).astype(np.float32)
NESTED = RNG.normal(size=(3, 4, 16, 8)).astype(np.float32)
W = (RNG.normal(size=(6, 32, 32)) / 6).astype(np.float32)
X = RNG.normal(size=(16, 32)).astype(np.float32)
# uneven splits in the loop body: 30 features on 4 devices, a batch of 13 on 2 and on 8
W_UNEVEN = (RNG.normal(size=(3, 30, 30)) / 6).astype(np.float32)
X_UNEVEN = RNG.normal(size=(13, 30)).astype(np.float32)


def reverse_scan(xs):
    def body(c, x):
        c = c * 0.5 + x
        return c, jnp.tanh(c)

    return jax.lax.scan(body, jnp.zeros(xs.shape[1:]), xs, reverse=True)


def nested_scan(xs):
    def inner(c, x):
        return c + jnp.sin(x), c * 2

    def outer(c, x):
        c2, ys = jax.lax.scan(inner, c, x)
        return c2 * 0.5, ys.sum(0)

    return jax.lax.scan(outer, jnp.zeros(xs.shape[2:]), xs)


def mlp(w, x):
    def body(h, w_i):
        return jnp.tanh(h @ w_i) + h, (h**2).sum()

    h, ys = jax.lax.scan(body, x, w)
    return (h**2).mean(), ys


def carry_as_ys(x):
    return jax.lax.scan(lambda c, _: (c + 1, c), x, None, length=4)


def outer_weight(w, x):
    """A weight from outside the loop (boxed once, before it) and constant xs."""
    return jax.lax.scan(lambda h, i: (jnp.tanh(h @ w[0]) + i, h.sum()), x, jnp.arange(4.0))


# (name, function, args, placement shape, in_sbp, while loops the compiled program keeps)
CASES = [
    ("reverse", reverse_scan, (XS,), (8,), (S(1),), 1),
    ("nested", nested_scan, (NESTED,), (8,), (S(2),), 2),
    ("megatron_forward", mlp, (W, X), (2, 4), ((B, S(2)), (S(0), B)), 1),
    (
        "megatron_grad",
        jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1)),
        (W, X),
        (2, 4),
        ((B, S(2)), (S(0), B)),
        2,
    ),
    ("data_parallel_grad", jax.grad(lambda w, x: mlp(w, x)[0]), (W, X), (8,), (B, S(0)), 2),
    (
        "megatron_grad_uneven",
        jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1)),
        (W_UNEVEN, X_UNEVEN),
        (2, 4),
        ((B, S(2)), (S(0), B)),
        2,
    ),
    (
        "data_parallel_grad_uneven",
        jax.grad(lambda w, x: mlp(w, x)[0]),
        (W_UNEVEN, X_UNEVEN),
        (8,),
        (B, S(0)),
        2,
    ),
    ("carry_as_ys", carry_as_ys, (X,), (8,), (S(0),), 1),
    ("outer_weight", outer_weight, (W, X), (2, 4), ((B, S(2)), (S(0), B)), 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_scans_stay_loops_with_exact_values_and_bytes(case):
    _, fn, args, shape, in_sbp, n_loops = case
    pl = sj.placement(shape, ("x", "y")[: len(shape)])
    f = sj.jit(fn, placement=pl, in_sbp=in_sbp)
    compiled = f.lower(*args).compile()
    assert compiled.as_text().count(" while(") == n_loops
    assert sum(c.bytes for c in sj.collectives(compiled)) == f.explain(*args).bytes
    got = jax.tree.leaves(jax.tree.map(lambda t: t.numpy(), f(*args), is_leaf=lambda t: hasattr(t, "numpy")))
    want = jax.tree.leaves(jax.jit(fn)(*args))
    for g, w in zip(got, want):
        assert_close(g, np.asarray(w), rtol=1e-5, scale=np.abs(w).max())


def test_rolled_and_written_out_lowerings_agree(monkeypatch):
    """The same plan lowered with its loops rolled and written out: equal values
    and equal bytes; only the program's shape differs."""
    fn = jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1))
    pl = sj.placement((2, 4), ("x", "y"))
    rolled = sj.jit(fn, placement=pl, in_sbp=((B, S(2)), (S(0), B)))
    unrolled = sj.CompileOptions(roll_loops=False)
    written = sj.jit(fn, placement=pl, in_sbp=((B, S(2)), (S(0), B)), options=unrolled)
    c_written = written.lower(W, X).compile()
    c_rolled = rolled.lower(W, X).compile()
    assert c_rolled.as_text().count(" while(") == 2 and c_written.as_text().count(" while(") == 0
    measured = [sum(c.bytes for c in sj.collectives(c)) for c in (c_rolled, c_written)]
    assert measured[0] == measured[1] == rolled.explain(W, X).bytes
    for a, b in zip(rolled(W, X), written(W, X)):
        assert_close(a.numpy(), b.numpy(), rtol=1e-6, scale=np.abs(b.numpy()).max())


def test_the_slicing_of_later_iterations_is_not_traced():
    """A rolled loop indexes each iteration's weight out of the stack in its
    body, so the tracer's slicing of the later iterations (a slice and a
    squeeze per weight and iteration) is left out of the lowering's walk
    (``LocalPlan.unread``): all of it, in both loops of a scanned MLP's
    gradient, and nothing else."""
    from sbpjax.compiler.local_plan import plan_local

    fn = jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1))
    pl = sj.placement((2, 4), ("x", "y"))
    f = sj.jit(fn, placement=pl, in_sbp=((B, S(2)), (S(0), B)))
    prop = f.explain(W, X).propagation
    plan = plan_local(prop)
    index_of = {id(d.node): i for i, d in enumerate(prop.decisions)}
    later = set()
    for r in plan.runs:
        for q in r.positions[1:]:
            later |= {index_of[id(n)] for n in r.loop.iterations[q].slicing if id(n) in index_of}
    assert later and plan.unread == later
    got = jax.tree.leaves(jax.tree.map(lambda t: t.numpy(), f(W, X), is_leaf=lambda t: hasattr(t, "numpy")))
    for g, w in zip(got, jax.tree.leaves(jax.jit(fn)(W, X)), strict=True):
        assert_close(g, np.asarray(w), rtol=1e-5, scale=np.abs(w).max())


def test_iterations_share_their_layouts():
    """The solver gives every iteration of a scan the same choices, so the
    carries' layouts are a fixed point and the whole loop rolls."""
    fn = jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1))
    pl = sj.placement((2, 4), ("x", "y"))
    prop = sj.jit(fn, placement=pl, in_sbp=((B, S(2)), (S(0), B))).explain(W, X).propagation
    runs = loops.plan_runs(prop)
    # each loop's carry is boxed at the start of every iteration but the first (it
    # arrives in the layout the body reads), so the loop boxes it at the end of the
    # body instead; the last iteration, whose carry is read otherwise after the
    # loop, is written out after it
    assert len(runs) == 2 and all(len(r.positions) == 5 for r in runs)
    for loop in prop.program.loops:
        index_of = {id(d.node): i for i, d in enumerate(prop.decisions)}
        sigs = []
        for it in loop.iterations:
            body = sorted(index_of[id(d.node)] for d in prop.decisions if id(d.node.outs[0]) in it.made)
            sigs.append(
                [
                    (prop.decisions[i].node.name, prop.decisions[i].in_sbp, prop.decisions[i].out_sbp)
                    for i in body
                ]
            )
        assert all(s == sigs[1] for s in sigs[1:-1])


@pytest.mark.parametrize("case", [c for c in CASES if c[0].endswith("grad")], ids=lambda c: c[0])
def test_slices_share_their_layouts(case):
    """The ops that index each iteration's slices out of the stacked operands
    share a class (classes.loop_classes), so every iteration gets its slices in
    the same layouts: a free slice made before the body or inside it is a tie
    the solver would otherwise break per iteration, and the iterations that
    break it otherwise are written out of the loop."""
    from sbpjax.compiler.classes import loop_classes

    _, fn, args, shape, in_sbp, n_loops = case
    pl = sj.placement(shape, ("x", "y")[: len(shape)])
    prop = sj.jit(fn, placement=pl, in_sbp=in_sbp).explain(*args).propagation
    classes = loop_classes(prop.program)
    class_of = {id(node): c for node, c in zip(prop.program.nodes, classes)}
    decision_of = {id(d.node): d for d in prop.decisions}
    for loop in prop.program.loops:
        # the k-th slicing op of every iteration (the first layer's may be dead code, dropped)
        alike = [
            [it.slicing[k] for it in loop.iterations if id(it.slicing[k]) in decision_of]
            for k in range(len(loop.iterations[0].slicing))
        ]
        assert any(len(nodes) == len(loop.iterations) for nodes in alike)
        for nodes in filter(None, alike):
            assert len({class_of[id(n)] for n in nodes}) == 1 and class_of[id(nodes[0])] is not None
            layouts = {(tuple(decision_of[id(n)].in_sbp), tuple(decision_of[id(n)].out_sbp)) for n in nodes}
            assert len(layouts) == 1, layouts
    # each loop rolls, but for its last iteration where the code after it reads the carry otherwise
    runs = loops.plan_runs(prop)
    assert len(runs) == n_loops and all(
        len(r.positions) >= len(prop.program.loops[0].iterations) - 1 for r in runs
    )


def test_explain_says_which_scans_stay_loops():
    fn = jax.grad(lambda w, x: mlp(w, x)[0], argnums=(0, 1))
    pl = sj.placement((2, 4), ("x", "y"))
    e = sj.jit(fn, placement=pl, in_sbp=((B, S(2)), (S(0), B))).explain(W, X)
    assert [(n, rolled) for _, n, rolled in e.loops] == [(6, 5), (6, 5)]
    assert all("test_loops.py" in src for src, _, _ in e.loops)
    assert "loops: 2 of 2 scans kept as loops" in str(e) and "1 written out" in e.summary()


def test_each_loop_boxes_its_own_slices(monkeypatch):
    """FSDP-style scanned layers (weights split over the devices, the batch
    too): the plan gathers each layer's weight. The backward loop slices the
    stacked weights and gathers them again (trace.LOOP_SLICES), as GSPMD and
    FSDP do, instead of receiving every layer's gathered weight from the
    forward loop: more bytes, less memory, both within GSPMD's bytes."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    w = (RNG.normal(size=(4, 32, 32)) / 6).astype(np.float32)
    x = RNG.normal(size=(2048, 32)).astype(np.float32)

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, w_i: (jnp.tanh(h @ w_i) + h, None), x, w)
        return jnp.mean(h**2)

    grad = jax.grad(loss, argnums=(0, 1))
    pl = sj.placement(8, "x")

    def compiled(options=None):
        f = sj.jit(grad, placement=pl, in_sbp=(S(1), S(0)), out_sbp=(S(1), S(0)), options=options)
        e = f.explain(w, x)
        c = f.lower(w, x).compile()
        assert sum(col.bytes for col in sj.collectives(c)) == e.bytes
        assert [(n, k) for _, n, k in e.loops] == [(4, 4), (4, 4)]
        from_stack = any(src is None for r in loops.plan_runs(e.propagation) for _, _, src in r.xs)
        gathers = [col for col in sj.collectives(c) if col.op == "all-gather" and col.count == 4]
        return f, e, c, from_stack, gathers

    f, own, c_own, from_stack, gathers = compiled()
    assert not from_stack and len(gathers) == 2  # one all-gather in each loop body
    _, shared, c_shared, from_stack, gathers = compiled(sj.CompileOptions(loop_slices=False))
    assert from_stack and len(gathers) == 1  # the backward reads the forward's gathered weights
    assert shared.bytes < own.bytes
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(c_own) < temp(c_shared)
    gspmd = (
        jax.jit(grad, out_shardings=(NamedSharding(pl.mesh, PS(None, "x")), NamedSharding(pl.mesh, PS("x"))))
        .lower(
            jax.device_put(w, NamedSharding(pl.mesh, PS(None, "x"))),
            jax.device_put(x, NamedSharding(pl.mesh, PS("x"))),
        )
        .compile()
    )
    assert own.bytes <= sum(col.bytes for col in sj.collectives(gspmd))
    for got, want in zip(f(w, x), jax.jit(grad)(w, x)):
        assert_close(got.numpy(), np.asarray(want), rtol=1e-5, scale=np.abs(want).max())


def test_a_carry_boxed_two_ways_in_each_iteration():
    """A partial carry the body reads in two layouts: two boxings of one carry
    move to the end of the previous iteration. Their layouts have no order
    (comparing them raised a TypeError); the loop is kept, values and bytes
    exact."""
    w = (RNG.normal(size=(4, 32, 32)) / 6).astype(np.float32)
    x = RNG.normal(size=(16, 32)).astype(np.float32)

    def f(w, x):
        def body(c, w_i):
            a = sj.constrain(c, (S(0), B))
            b = sj.constrain(c, (S(0), S(0)))
            return jnp.tanh(a) @ w_i + jnp.sin(b), None

        return jax.lax.scan(body, x, w)[0]

    g = sj.jit(f, placement=sj.placement((2, 4), ("x", "y")), in_sbp=((B, S(1)), (S(0), B)))
    e = g.explain(w, x)
    runs = loops.plan_runs(e.propagation)
    assert len(runs) == 1 and any(len({b.src for c, b in r.rotated if c == 0}) == 2 for r in runs)
    compiled = g.lower(w, x).compile()
    assert compiled.as_text().count(" while(") == 1
    assert sum(c.bytes for c in sj.collectives(compiled)) == e.bytes
    want = np.asarray(jax.jit(f)(w, x))
    assert_close(g(w, x).numpy(), want, rtol=1e-5, scale=np.abs(want).max())


def _program_text(program) -> list:
    """Each equation of a traced program as text: primitive, params and where its
    operands come from (a program input, an earlier equation's output, a constant)."""
    where: dict = {id(v): f"in{i}" for i, v in enumerate(program.inputs)}
    lines = []
    for k, node in enumerate(program.nodes):
        ins = [where.get(id(a), "const") for a in node.ins]
        params = sorted((name, repr(v)) for name, v in node.eqn.params.items())
        lines.append((node.name, params, ins, [tuple(o.shape) for o in node.outs]))
        for j, o in enumerate(node.outs):
            where[id(o)] = f"n{k}.{j}"
    return lines


def _tanh_layers(with_sums):
    def layers(ws, bs, x):
        def body(h, wb):
            w, b = wb
            return jnp.tanh(h @ w + b), (h * 2).sum()

        h, sums = jax.lax.scan(body, x, (ws, bs))
        return h.sum() + (sums.sum() if with_sums else 0.0)

    return lambda ws, bs, x: jax.grad(layers, argnums=(0, 1))(ws, bs, x)


BS = RNG.normal(size=(6, 32)).astype(np.float32)


def test_a_written_out_scan_traces_alike_with_its_slices_jaxprs_made_once_per_shape():
    """trace writes a scan out by slicing each stacked operand per iteration
    (sbpjax.compiler.small_jaxprs): the slices' jaxprs are made once per shape
    and index and shared, and the program is the one made from fresh jaxprs."""
    from sbpjax.compiler import small_jaxprs
    from sbpjax.compiler.trace import trace

    step = _tanh_layers(True)
    leaves, tree = jax.tree_util.tree_flatten(((W, BS, X), {}))
    avals = [jax.ShapeDtypeStruct(np.shape(v), v.dtype) for v in leaves]
    small_jaxprs.clear()
    fresh = trace(step, avals, tree)
    kept = len(small_jaxprs._JAXPRS)
    # forward and backward scans each slice ws and bs and stack results, 6 iterations:
    # the slices of one shape and index, and the stacks of one shape, are one jaxpr each
    slices = sum(1 for n in fresh.nodes if n.name in ("slice", "squeeze"))
    assert 0 < kept < slices
    again = trace(step, avals, tree)
    assert len(small_jaxprs._JAXPRS) == kept  # nothing made again
    assert _program_text(again) == _program_text(fresh)


@pytest.mark.parametrize("shape,dtype", [((6, 32), "float32"), ((5, 3, 2), "int32"), ((4,), "bfloat16")])
def test_each_iterations_slice_is_the_jaxpr_jax_makes_and_jax_is_asked_once_per_shape(
    monkeypatch, shape, dtype
):
    """small_jaxprs.index_jaxpr moves index 0's slice to each index instead of
    tracing every index: the same equations as jax.make_jaxpr's, one trace."""
    from sbpjax.compiler import small_jaxprs

    small_jaxprs.clear()
    x = jax.ShapeDtypeStruct(shape, dtype)
    expected = [
        str(jax.make_jaxpr(lambda v, i=i: jax.lax.index_in_dim(v, i, 0, keepdims=False))(x))
        for i in range(shape[0])
    ]
    traced = []
    make_jaxpr = jax.make_jaxpr
    monkeypatch.setattr(jax, "make_jaxpr", lambda fn: traced.append(fn) or make_jaxpr(fn))
    got = [str(small_jaxprs.index_jaxpr(x, i)) for i in reversed(range(shape[0]))][::-1]
    assert got == expected
    assert len(traced) == 1


@pytest.mark.parametrize("with_sums", [False, True], ids=["h", "h-and-sums"])
def test_the_input_of_a_rolled_scan_is_its_first_residual_in_the_layout_the_body_splits_it(with_sums):
    """The weights of a scanned tanh layer split over y: the body makes its carry
    split over y and gathers it for the next layer, and the backward pass reads
    each layer's input split so. The first layer's input is the scan's input,
    which came in whole over y: until the lowering boxed it itself after the loop
    (lower.roll's placeholders), the rolled loop handed on the zeros holding the
    place of its split carry, and the first layer's weight gradient was zero."""
    step = _tanh_layers(with_sums)
    pl = sj.placement((2, 4), ("x", "y"))
    f = sj.jit(step, placement=pl, in_sbp=((B, S(2)), (B, S(1)), (S(0), B)))
    want = jax.jit(step)(W, BS, X)
    for got, w in zip(f(W, BS, X), want):
        assert_close(got.numpy(), np.asarray(w), rtol=1e-4)
    e = f.explain(W, BS, X)
    assert "loops: 2 of 2 scans kept as loops" in str(e)
    compiled = f.lower(W, BS, X).compile()
    assert compiled.as_text().count(" while(") == 2
    assert sum(c.bytes for c in sj.collectives(compiled)) == e.bytes


def test_what_the_iterations_share_is_made_once_and_the_rolled_loops_once_per_plan():
    """Plan-time memos (a plan cache hit of a 32-layer scan took twice as long
    without them): the nodes of one body equation share one EqnText (its
    params' text, the op keys' and the plan cache's), and plan_runs finds the
    rolled loops once per plan and options, the same loops it finds afresh,
    and again after add_regathers adds boxings."""
    from sbpjax.compiler.loops import _plan_runs, plan_runs
    from sbpjax.compiler.regather import add_regathers

    step = _tanh_layers(True)
    pl = sj.placement((2, 4), ("x", "y"))
    f = sj.jit(step, placement=pl, in_sbp=((B, S(2)), (B, S(1)), (S(0), B)))
    prop = f.explain(W, BS, X).propagation
    by_eqn: dict = {}
    for n in prop.program.nodes:
        by_eqn.setdefault(id(n.eqn), set()).add(id(n.texts))
        assert n.params_text == repr(sorted(n.eqn.params.items(), key=lambda kv: kv[0]))
    assert all(len(texts) == 1 for texts in by_eqn.values())
    assert max(sum(1 for n in prop.program.nodes if id(n.eqn) == e) for e in by_eqn) >= 6  # 6 layers

    def shape(runs):
        return [(r.first, r.last, r.positions, r.bodies) for r in runs]

    runs = plan_runs(prop)
    assert len(runs) == 2 and plan_runs(prop) is runs
    assert shape(_plan_runs(prop)) == shape(runs)
    prop.options = sj.CompileOptions(roll_loops=False)  # other options: found again
    assert plan_runs(prop) == []
    # regathers add boxings (test_regather's FSDP layers, written out: no loop holds them)
    from test_regather import WEIGHTS, fsdp
    from test_regather import X as RX

    prop = fsdp(False).explain(WEIGHTS, RX).propagation
    assert plan_runs(prop) == [] and prop.runs is not None
    add_regathers(prop, True)
    assert prop.regathered is not None and prop.runs is None  # found again when asked


def test_a_loop_nothing_reads_is_dead_code():
    """A ``fori_loop`` (and a scan) whose results nothing reads is dropped,
    as XLA drops it: nothing planned, ``explain()`` counts 0 B as the
    compiled program moves 0 B. The live loop beside it (its carry
    returned) is kept, its last carries too."""
    x, w = RNG.normal(size=(16, 64)).astype(np.float32), RNG.normal(size=(64, 64)).astype(np.float32) / 8

    def dead(x, w):
        jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x)
        jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)
        return x * 2

    def live_beside_dead(x, w):
        jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x)
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)

    pl = sj.placement(8, "d")
    f = sj.jit(dead, placement=pl, in_sbp=((S(1),), (S(0),)))
    assert f.explain(x, w).bytes == moved_bytes(f, x, w) == 0
    assert not any(n.name == "dot_general" for n in f.explain(x, w).propagation.program.nodes)
    assert_close(f(x, w).numpy(), np.asarray(jax.jit(dead)(x, w)), rtol=1e-6)
    g = sj.jit(live_beside_dead, placement=pl, in_sbp=((S(1),), (S(0),)), out_sbp=(S(1),))
    dots = [n for n in g.explain(x, w).propagation.program.nodes if n.name == "dot_general"]
    assert len(dots) == 3  # the live loop's three iterations, none of the dead one's four
    assert g.explain(x, w).bytes == moved_bytes(g, x, w) > 0
    assert_close(g(x, w).numpy(), np.asarray(jax.jit(live_beside_dead)(x, w)), rtol=1e-5)


def test_a_decode_loops_positions_stay_whole():
    """A decode loop writing a KV cache at its step's position: JAX makes the
    position non-negative with scalar integer arithmetic, which stays whole on
    every device (as a partial sum, each step all-reduced its position:
    15 collectives where GSPMD runs 8; held-out sweep). Only the float
    activations' reductions run, and the plan's bytes are the compiled
    program's."""
    r = np.random.default_rng(3)
    w, wo, x0 = (r.normal(size=s).astype(np.float32) * 0.3 for s in [(16, 16), (16, 16), (2, 16)])

    def decode(w, wo, x0):
        def body(i, st):
            x, kc, out = st
            kc = jax.lax.dynamic_update_slice(kc, (x @ w)[:, None, :], (0, i, 0))
            scores = jax.nn.softmax(jnp.einsum("bd,btd->bt", x @ w, kc), -1)
            x = jnp.tanh(jnp.einsum("bt,btd->bd", scores, kc) @ wo)
            return x, kc, out.at[:, i].set(x[:, 0])

        return jax.lax.fori_loop(0, 8, body, (x0, jnp.zeros((2, 8, 16)), jnp.zeros((2, 8))))[2]

    f = sj.jit(decode, placement=sj.placement(4, "t"), in_sbp=((S(1),), (S(0),), (B,)))
    assert_close(f(w, wo, x0).numpy(), np.asarray(jax.jit(decode)(w, wo, x0)), rtol=1e-5)
    collectives = sj.collectives(f.lower(w, wo, x0).compile())
    assert all(c.shape.startswith("f32") for c in collectives), collectives
    assert sum(c.bytes for c in collectives) == f.explain(w, wo, x0).bytes


def test_a_carry_only_its_own_chain_reads_is_dead_code():
    """A ``fori_loop`` carrying a sum the program returns and an ``h`` that
    only makes the next ``h``: XLA drops ``h`` from the loop, and so does
    the plan (it counted the chain's exchanges where the compiled program
    moved none). The carry the program reads is kept, in every iteration."""
    x, w = RNG.normal(size=(16, 64)).astype(np.float32), RNG.normal(size=(64, 64)).astype(np.float32) / 8

    def fn(x, w):
        def body(i, carry):
            acc, h = carry
            return acc + x * i, jnp.tanh(h @ w)

        return jax.lax.fori_loop(0, 4, body, (jnp.zeros_like(x), x))[0]

    f = sj.jit(fn, placement=sj.placement(8, "d"), in_sbp=((S(1),), (S(0),)), out_sbp=(S(1),))
    assert f.explain(x, w).bytes == moved_bytes(f, x, w) == 0
    nodes = f.explain(x, w).propagation.program.nodes
    assert not any(n.name == "dot_general" for n in nodes)
    assert sum(n.name == "add" for n in nodes) >= 4  # the sum's four iterations
    assert_close(f(x, w).numpy(), np.asarray(jax.jit(fn)(x, w)), rtol=1e-6)


@pytest.mark.parametrize("out_sbp", [None, (P,), (S(1),), (B,)], ids=["free", "P", "S1", "B"])
def test_a_stack_read_as_made_beside_its_boxing_stays_made(pl8, out_sbp):
    """A rolled scan's stacked outputs, whose one boxing (zero-filled into a
    partial for ``a - a.mean()``) the loop runs slice by slice
    (``loop_exits.pushed_boxings``), while the mean reads the stack as it is
    made: the stack must then exist in that layout too. It did not (a PPO
    loss's advantages after a GAE scan raised ``AttributeError: 'Var' object
    has no attribute 'value'``); such a stack is boxed after the loop."""
    r = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)

    def centred(r):
        a = jax.lax.scan(lambda c, d: (d + 0.9 * c, d + 0.9 * c), jnp.zeros_like(r[0]), r)[1]
        return a - a.mean()

    f = sj.jit(centred, placement=pl8, in_sbp=(S(1),), out_sbp=out_sbp)
    assert_close(f(r).numpy(), np.asarray(jax.jit(centred)(r)), rtol=1e-5)
    assert moved_bytes(f, r) == f.explain(r).bytes
