"""The pairwise form of the layout choice (sbpjax.compiler.formulate): alike
hubs share one node, and the form with one hub per value has the same optimum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler import choose
from sbpjax.compiler.folding import Folded
from sbpjax.solver import Problem, solve

RNG = np.random.default_rng(0)
W = (RNG.normal(size=(6, 32, 32)) / 6).astype(np.float32)
X = RNG.normal(size=(16, 32)).astype(np.float32)


def loss(w, x):
    def body(h, w_i):
        return jnp.tanh(h @ w_i) + h, None

    h, _ = jax.lax.scan(body, x, w)
    return (h**2).mean()


def _formulations(monkeypatch, fn, shape, in_sbp, args):
    """The formulations ``sj.jit`` solves for ``fn`` (a spy: each is built and used as always)."""
    made = []
    real = choose.formulate

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(choose, "formulate", spy)
    pl = sj.placement(shape, ("x", "y")[: len(shape)])
    sj.jit(fn, placement=pl, in_sbp=in_sbp, plan_cache=False).explain(*args)
    return made


def _one_hub_per_value(form):
    """``form``'s nodes and links with every shared hub split back into one node per
    value: the links of a hub's values were added value by value, each value's
    the same number, so the j-th run of them is the j-th value's."""
    own = list(form.own)
    split: dict = {}  # hub node -> its node per value
    for hub, (atoms, _) in form.hubs.items():
        split[hub] = [hub] + [len(own) + j for j in range(len(atoms) - 1)]
        own += [np.zeros_like(form.own[hub]) for _ in atoms[1:]]
    per_value = {
        hub: sum(hub in (u, v) for _, u, v, _ in form.links) // len(atoms)
        for hub, (atoms, _) in form.hubs.items()
    }
    seen = dict.fromkeys(split, 0)
    links = []
    for table, u, v, w in form.links:
        hub = u if u in split else v if v in split else None
        if hub is None:
            links.append((table, u, v, w))
            continue
        node = split[hub][seen[hub] // per_value[hub]]
        seen[hub] += 1
        links.append((table, node if u == hub else u, node if v == hub else v, w))
    return own, links


def _best_given_the_rest(own, const, links, hubs, rng, draws=200) -> np.ndarray:
    """For ``draws`` random strategies of every node that is not a hub, the
    cheapest total over the hubs' strategies (a hub links only to nodes that
    are not hubs, so each hub's best is its own minimum)."""
    folded = Folded(own, const, links)
    costs, edges = folded.costs, folded.edges
    rest = [n for n in range(len(costs)) if n not in hubs]
    out = []
    for _ in range(draws):
        x = {n: int(rng.integers(len(costs[n]))) for n in rest}
        total = folded.const + sum(costs[n][x[n]] for n in rest)
        per_hub = {h: costs[h].copy() for h in hubs}
        for (u, v), t in edges.items():
            if u in x and v in x:
                total += t[x[u], x[v]]
            elif u in per_hub:
                per_hub[u] += t[:, x[v]]
            else:
                per_hub[v] += t[x[u], :]
        out.append(total + sum(c.min() for c in per_hub.values()))
    return np.array(out)


def _optimum(own, const, links) -> float:
    folded = Folded(own, const, links)
    sol = solve(Problem._prechecked(folded.costs, list((u, v, t) for (u, v), t in folded.edges.items())))
    assert sol.optimal
    return sol.cost + folded.const


@pytest.mark.parametrize(
    "fn, shape, in_sbp",
    [
        (jax.grad(loss, argnums=(0, 1)), (2, 4), ((B, S(2)), (S(0), B))),
        (jax.grad(loss, argnums=(0, 1)), (8,), (S(1), S(0))),
        (jax.grad(loss, argnums=(0, 1)), (2, 4), ((S(1), S(2)), (S(0), S(1)))),
    ],
    ids=["megatron", "kernels_split_8", "both_split_2x4"],
)
def test_alike_hubs_share_a_node_and_the_optimum(monkeypatch, fn, shape, in_sbp):
    forms = _formulations(monkeypatch, fn, shape, in_sbp, (W, X))
    assert forms
    for form in forms:
        shared = [atoms for atoms, _ in form.hubs.values() if len(atoms) > 1]
        if not shared:
            continue
        own, links = _one_hub_per_value(form)
        assert len(own) == len(form.own) + sum(len(a) - 1 for a in shared)
        split = _optimum(own, form.own_const, links)
        merged = _optimum(list(form.own), form.own_const, form.links)
        assert merged == pytest.approx(split, rel=1e-12, abs=1e-6 * max(abs(split), 1.0))
        # and the same cost given any strategies of the other nodes, not only the optimum's
        hubs = [n for n, kind in enumerate(form.kinds) if kind == "hub"]
        split_hubs = set(hubs) | set(range(len(form.own), len(own)))
        a = _best_given_the_rest(own, form.own_const, links, split_hubs, np.random.default_rng(1))
        b = _best_given_the_rest(
            list(form.own), form.own_const, form.links, set(hubs), np.random.default_rng(1)
        )
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-6 * np.abs(a).max())
    # the hubs of the scan's six iterations share nodes, five or six values to a node
    assert any(len(atoms) >= 5 for form in forms for atoms, _ in form.hubs.values())
