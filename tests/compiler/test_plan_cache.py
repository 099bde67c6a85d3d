"""The plan cache (sbpjax/compiler/plan_cache.py): a hit gives the same plan
and values, a corrupt, tampered or stale entry is ignored with a warning and
rewritten, entries are JSON data, and processes share a directory safely."""

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sbpjax as sj
from sbpjax import B, S
from sbpjax.compiler import plan_cache

# on both CI legs (pyproject.toml's markers): the cache key holds the JAX version
pytestmark = pytest.mark.jax_versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a Megatron MLP step on 2x4: small, but with real choices to make
RNG = np.random.default_rng(0)
W1 = (RNG.normal(size=(16, 64)) / 4).astype(np.float32)
W2 = (RNG.normal(size=(64, 16)) / 8).astype(np.float32)
X = RNG.normal(size=(32, 16)).astype(np.float32)
IN_SBP = ((B, S(1)), (B, S(0)), (S(0), B))


def step(w1, w2, x):
    def loss(w1, w2):
        return jnp.mean((jnp.tanh(x @ w1) @ w2 - x) ** 2)

    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
    return value, w1 - 0.1 * g1, w2 - 0.1 * g2


def compiled(pl, cache, **kw):
    f = sj.jit(
        step, placement=pl, in_sbp=IN_SBP, out_sbp=(None, IN_SBP[0], IN_SBP[1]), plan_cache=cache, **kw
    )
    return f, f.explain(W1, W2, X)


def signatures(e):
    return [(tuple(d.in_sbp), tuple(d.out_sbp)) for d in e.propagation.decisions]


def entries(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".json"))


def test_a_hit_gives_the_same_plan_and_values(pl24, tmp_path):
    f, first = compiled(pl24, str(tmp_path))
    assert first.choice.source == "solved"
    (name,) = entries(tmp_path)
    record = json.loads((tmp_path / name).read_text())  # plain data: JSON, no code
    assert record["schema"] == plan_cache.SCHEMA and record["ops"] == len(first.propagation.decisions)
    g, again = compiled(pl24, tmp_path)  # a new function object, the same program: read back
    assert again.choice.source == "plan cache" and "from the plan cache" in str(again)
    assert signatures(again) == signatures(first) and again.bytes == first.bytes
    assert [(b.src, b.dst) for b in again.boxings] == [(b.src, b.dst) for b in first.boxings]
    for a, b in zip(f(W1, W2, X), g(W1, W2, X)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert sum(c.bytes for c in sj.collectives(g.lower(W1, W2, X).compile())) == again.bytes
    # another placement, layout or setting is another key
    compiled(sj.placement((4, 2), ("x", "y")), tmp_path)
    compiled(pl24, tmp_path, options=sj.CompileOptions(latency=False))
    assert len(entries(tmp_path)) == 3
    # off: no directory written
    _, off = compiled(pl24, False)
    assert off.choice.source == "solved"


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "truncated",
        "not an object",
        "other program",
        "bad signature",
        "wrong layout",
        "old version",
        "not UTF-8",
        "deeply nested",
        "empty choice",
        "layouts not a list",
        "choice field of another type",
    ],
)
def test_a_corrupt_tampered_or_stale_entry_is_ignored_and_rewritten(pl24, tmp_path, damage):
    _, first = compiled(pl24, tmp_path)
    (name,) = entries(tmp_path)
    path = tmp_path / name
    good = path.read_text()
    record = json.loads(good)
    if damage == "garbage":
        text = "\x00\x01 not json"
    elif damage == "truncated":
        text = good[: len(good) // 2]
    elif damage == "not an object":
        text = json.dumps([1, 2, 3])
    elif damage == "other program":
        record["ops"] += 1
        text = json.dumps(record)
    elif damage == "bad signature":  # an nd-SBP that does not parse
        record["signatures"][0][0][0] = "import os; os.system('echo pwned')"
        text = json.dumps(record)
    elif damage == "wrong layout":  # parses, but splits a dim the operand does not have
        k = next(i for i, (ins, _) in enumerate(record["signatures"]) if ins)
        record["signatures"][k][0] = ["(S(9), S(9))"] * len(record["signatures"][k][0])
        text = json.dumps(record)
    elif damage == "old version":
        record["sbpjax"] = "0.0.0"
        text = json.dumps(record)
    elif damage == "not UTF-8":
        text = b"\xff\xfe" + good.encode()[2:]
    elif damage == "deeply nested":  # deeper than the JSON parser recurses
        text = "[" * 100_000 + "]" * 100_000
    elif damage == "empty choice":
        record["choice"] = {}
        text = json.dumps(record)
    elif damage == "layouts not a list":
        record["in_sbp"] = 5
        text = json.dumps(record)
    else:  # explain() formats the gap as a number
        record["choice"]["gap"] = "x"
        text = json.dumps(record)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.warns(plan_cache.PlanCacheWarning):
        _, again = compiled(pl24, tmp_path)
    assert again.choice.source == "solved" and signatures(again) == signatures(first)
    # rewritten: the next one reads it back without a warning
    assert json.loads(path.read_text())["signatures"] == json.loads(good)["signatures"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", plan_cache.PlanCacheWarning)
        _, third = compiled(pl24, tmp_path)
    assert third.choice.source == "plan cache"


def test_a_new_version_is_a_new_key(pl24, tmp_path, monkeypatch):
    compiled(pl24, tmp_path)
    monkeypatch.setattr(plan_cache, "__version__", "999.0")
    _, e = compiled(pl24, tmp_path)
    assert e.choice.source == "solved" and len(entries(tmp_path)) == 2


def test_the_directory_comes_from_the_option_the_environment_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_cache.cache_dir() == str(tmp_path / "xdg" / "sbpjax" / "plans")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert plan_cache.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "sbpjax", "plans")
    monkeypatch.setenv(plan_cache.ENV, str(tmp_path / "env"))
    assert plan_cache.cache_dir() == str(tmp_path / "env")
    assert plan_cache.cache_dir(tmp_path / "opt") == str(tmp_path / "opt")
    assert plan_cache.cache_dir(False) is None
    assert plan_cache.cache_dir("") is None and plan_cache.cache_dir(" ") is None  # off, as the variable's
    for off in ("0", "off", "false"):
        monkeypatch.setenv(plan_cache.ENV, off)
        assert plan_cache.cache_dir() is None
    with pytest.raises(sj.SBPError, match="plan_cache must be a directory"):
        sj.jit(step, placement=sj.placement(8, "x"), plan_cache=3)


def test_an_unwritable_directory_warns_and_still_compiles(pl24, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.warns(plan_cache.PlanCacheWarning, match="not written"):
        f, e = compiled(pl24, blocked / "plans")
    assert e.choice.source == "solved"


_WORKER = """
import os, sys, json, hashlib
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {tests!r})
import test_plan_cache as t
import sbpjax as sj
f, e = t.compiled(sj.placement((2, 4), ("x", "y")), sys.argv[1])
print("PLAN", hashlib.sha256(repr(t.signatures(e)).encode()).hexdigest())
"""


@pytest.mark.slow
def test_two_processes_share_one_directory(tmp_path):
    """Two processes compile the same program at once into one directory:
    both succeed with the same plan, and one whole entry is left."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = _WORKER.format(tests=os.path.join(ROOT, "tests", "compiler"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-3000:]
    plans = {line for out, _ in outs for line in out.decode().splitlines() if line.startswith("PLAN")}
    assert len(plans) == 1, plans
    (name,) = entries(tmp_path)
    json.loads((tmp_path / name).read_text())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
