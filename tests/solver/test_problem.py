"""The problem form: reading, writing, validating and pricing."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from solver_cases import INSTANCES, random_problem

from sbpjax import SBPError
from sbpjax.solver import FORBIDDEN_COST, Problem, load_problem


def reference_price(problem: Problem, s) -> tuple[float, float]:
    """Cost and peak usage straight from the definition, one term at a time."""
    cost = sum(float(problem.costs[i][s[i]]) for i in range(problem.num_nodes))
    for e in problem.edges:
        cost += float(e.costs[s[e.u], s[e.v]])
    peak = 0.0
    if problem.usages is not None:
        times = range(int(problem.intervals.min()), int(problem.intervals.max()) + 1)
        for t in times:
            live = [
                i for i in range(problem.num_nodes) if problem.intervals[i][0] <= t < problem.intervals[i][1]
            ]
            peak = max(peak, sum(float(problem.usages[i][s[i]]) for i in live))
    return cost, peak


def test_evaluate_matches_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = random_problem(
            rng, int(rng.integers(1, 9)), int(rng.integers(0, 14)), memory=bool(rng.random() < 0.7)
        )
        s = np.array([rng.integers(0, k) for k in p.num_strategies])
        cost, feasible, peak = p.evaluate(s)
        ref_cost, ref_peak = reference_price(p, s)
        assert cost == ref_cost or np.isclose(cost, ref_cost, rtol=1e-12, atol=1e-9)
        assert peak == ref_peak
        assert feasible == (
            bool(np.isfinite(ref_cost)) and (p.usage_limit is None or ref_peak <= p.usage_limit)
        )


def test_json_round_trip_keeps_every_price(tmp_path):
    rng = np.random.default_rng(1)
    for j in range(30):
        p = random_problem(rng, int(rng.integers(2, 8)), int(rng.integers(0, 10)), memory=j % 2 == 0)
        obj = json.loads(json.dumps(p.to_json()))  # through real JSON text
        q = Problem.from_json(obj)
        for _ in range(10):
            s = np.array([rng.integers(0, k) for k in p.num_strategies])
            assert p.evaluate(s) == q.evaluate(s)
    assert p.to_json() == q.to_json()


def test_plain_and_gzipped_files_read_the_same(tmp_path):
    p = random_problem(np.random.default_rng(2), 6, 9, memory=True)
    text = json.dumps(p.to_json())
    (tmp_path / "p.json").write_text(text)
    (tmp_path / "p.json.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "gz_without_suffix").write_bytes(gzip.compress(text.encode()))
    loaded = [load_problem(tmp_path / name) for name in ("p.json", "p.json.gz", "gz_without_suffix")]
    assert all(q.to_json() == p.to_json() for q in loaded)


def test_instance_g_loads_with_the_contest_figures():
    p = load_problem(INSTANCES / "asplos-2025-iopddl-G.json.gz")
    assert (p.num_nodes, len(p.edges), p.usage_limit) == (816, 1023, 14392528.0)
    assert int(p.num_strategies.sum()) == 10071
    # 1e18 marks what is not allowed: read as inf, written back as 1e18
    assert any(np.isinf(c).any() for c in p.costs)
    assert (
        FORBIDDEN_COST
        in p.to_json()["problem"]["nodes"]["costs"][
            int(np.flatnonzero([np.isinf(c).any() for c in p.costs])[0])
        ]
    )


def test_arrays_are_read_only():
    p = Problem([[1.0, 2.0], [3.0]], [(0, 1, [[1.0], [2.0]])])
    with pytest.raises(ValueError):
        p.costs[0][0] = 5.0
    with pytest.raises(ValueError):
        p.edges[0].costs[0, 0] = 5.0


BAD = [
    (
        lambda: Problem([[1.0, 2.0], [1.0]], [(0, 1, [1.0, 2.0, 3.0])]),
        "edge 0 (0, 1): its cost matrix has shape (3,)",
    ),
    (
        lambda: Problem([[1.0], [1.0]], [(0, 2, [0.0])]),
        "edge 0: joins nodes 0 and 2, but the nodes are 0 .. 1",
    ),
    (lambda: Problem([[1.0], [1.0]], [(1, 1, [0.0])]), "joins node 1 to itself"),
    (lambda: Problem([[1.0], []]), "node 1: costs has shape (0,)"),
    (lambda: Problem([[1.0, float("nan")]]), "node 0: a cost is NaN"),
    (lambda: Problem([["a"]]), "node 0: costs must be numbers"),
    (
        lambda: Problem([[1.0]], usages=[[1.0]], intervals=[[3, 2]], usage_limit=5),
        "node 0: interval [3, 2] has lo > hi",
    ),
    (
        lambda: Problem([[1.0, 2.0]], usages=[[1.0]], intervals=[[0, 2]], usage_limit=5),
        "node 0: 2 strategies but 1 usages",
    ),
    (lambda: Problem([[1.0]], usages=[[1.0]]), "usages given without intervals"),
    (lambda: Problem([[1.0]], intervals=[[0, 1]]), "intervals or usage_limit given without usages"),
    (
        lambda: Problem([[1.0]], usages=[[1.0]], intervals=[[0, 1]], usage_limit=float("inf")),
        "usage_limit inf",
    ),
    (lambda: Problem.from_json([1, 2]), "a problem is a JSON object"),
    (lambda: Problem.from_json({"problem": {}}), 'no "nodes" object'),
    (
        lambda: Problem.from_json(
            {"nodes": {"costs": [[1]]}, "edges": {"nodes": [[0, 0, 1]], "costs": [[1]]}}
        ),
        "edges.nodes[0]",
    ),
    (
        lambda: Problem.from_json({"nodes": {"costs": [[1]]}, "edges": {"nodes": [[0, 1]], "costs": []}}),
        "edges.nodes has 1 entries but edges.costs 0",
    ),
    (lambda: Problem.from_json({"nodes": {"costs": 5}}), "nodes.costs must be a list"),
]


@pytest.mark.parametrize("make, message", BAD, ids=[m for _, m in BAD])
def test_malformed_problems_are_named(make, message):
    with pytest.raises(SBPError) as err:
        make()
    assert message in str(err.value)


def test_malformed_files_are_named(tmp_path):
    (tmp_path / "text.json").write_text("{not json")
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 20)
    for name, message in [
        ("text.json", "is not JSON"),
        ("broken.gz", "a broken gzip file"),
        ("none.json", "cannot read"),
    ]:
        with pytest.raises(SBPError, match=message):
            load_problem(tmp_path / name)


def test_strategies_are_checked():
    p = Problem([[1.0, 2.0], [3.0]])
    with pytest.raises(SBPError, match=r"strategies\[1\] = 1, but node 1 has strategies 0 .. 0"):
        p.evaluate([0, 1])
    with pytest.raises(SBPError, match=r"strategies\[0\] = -1"):
        p.evaluate([-1, 0])
    with pytest.raises(SBPError, match="one strategy index per node"):
        p.evaluate([0])
    with pytest.raises(SBPError, match="must be integers"):
        p.evaluate([0.5, 0])
