"""The result of a search: per-layer layouts, their costs, and the annotations that
make ``sj.jit`` run them.

    strategy = sbpjax.search.search(ops, Grid.from_placement(pl), placement=pl)
    print(strategy)                                    # one row per layer, totals
    fine = strategy.placement                          # pl refined onto fine axes
    def loss(params, x, y):
        for name in names:
            x = act(strategy.matmul(x, params[name], name))
        ...
    def step(params, x, y):
        grads = strategy.synced(jax.grad(loss)(params, x, y))
        ...
    f = sj.jit(step, placement=fine, in_sbp=(strategy.param_sbp(params), strategy.input_sbp(), ...))

``rules()`` gives ``{parameter path pattern: nd-SBP}`` for annotating a Flax model.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.plan import human_bytes
from sbpjax.sbp import format_sbp
from sbpjax.search.cost import Price, Tables
from sbpjax.search.space import Choice, Grid


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One op of the strategy: its choice, output dim (None: all-reduced), layouts
    (nd-SBPs over the grid's fine axes) and prices."""

    name: str
    param: str | None
    choice: Choice
    out_dim: int | None
    x_sbp: tuple
    w_sbp: tuple
    out_sbp: tuple
    redistribution: Price  # this op's output reduction and the boxing to the next op, both passes
    sync: Price
    memory: float


@dataclasses.dataclass
class Strategy:
    """Per-layer layouts found by a search, with their cost breakdown."""

    grid: Grid
    layers: list
    method: str
    objective: str
    search_seconds: float
    tie_keys: dict  # op name -> tie key
    placement_: object = None

    # -- totals -------------------------------------------------------------
    @property
    def bytes(self) -> float:
        """Predicted bytes of one training step (received, summed over devices)."""
        return float(sum(lp.redistribution.bytes + lp.sync.bytes for lp in self.layers))

    @property
    def time(self) -> float:
        """Predicted communication seconds of one training step."""
        return float(sum(lp.redistribution.time + lp.sync.time for lp in self.layers))

    @property
    def redistribution_bytes(self) -> float:
        return float(sum(lp.redistribution.bytes for lp in self.layers))

    @property
    def sync_bytes(self) -> float:
        return float(sum(lp.sync.bytes for lp in self.layers))

    @property
    def memory(self) -> float:
        """Predicted peak bytes per device (parameters, gradients, optimizer state,
        saved activations)."""
        return float(sum(lp.memory for lp in self.layers))

    @property
    def cost(self) -> float:
        return self.time if self.objective == "time" else self.bytes

    # -- annotations for sj.jit ----------------------------------------------
    def __getitem__(self, name: str) -> LayerPlan:
        for lp in self.layers:
            if lp.name == name:
                return lp
        raise SBPError(f"Strategy: no layer {name!r}; the layers are {[lp.name for lp in self.layers]}.")

    @property
    def placement(self):
        """The placement the strategy was searched for, refined onto fine axes:
        pass it to ``sj.jit`` (layouts name one SBP per fine axis)."""
        if self.placement_ is None:
            raise SBPError(
                "Strategy.placement: this strategy was searched on an abstract Grid; call "
                "strategy.on(placement) with a placement of shape "
                f"{self.grid.shape} to apply it."
            )
        return self.grid.fine_placement(self.placement_)

    def on(self, placement) -> Strategy:
        """The same strategy bound to a real placement of the grid's shape."""
        self.grid.fine_placement(placement)  # checks the shape
        return dataclasses.replace(self, placement_=placement)

    def input_sbp(self, name: str | None = None) -> tuple:
        """The input layout of layer ``name`` (default: the first layer, the data)."""
        return (self[name] if name else self.layers[0]).x_sbp

    def output_sbp(self, name: str | None = None) -> tuple:
        """The output layout of layer ``name`` (default: the last layer)."""
        return (self[name] if name else self.layers[-1]).out_sbp

    def param_sbp(self, params=None):
        """``{param path: nd-SBP}``, or, given a parameter pytree, an ``in_sbp`` tree
        for it: leaves named by a layer's ``param`` take its weight layout, all
        others (biases, norms) broadcast."""
        flat = {lp.param: lp.w_sbp for lp in self.layers if lp.param}
        if params is None:
            return flat
        import jax

        from sbpjax.sbp import B

        replicated = (B,) * len(self.grid.fine_sizes)
        paths = {}

        def pick(path, _leaf):
            key = jax.tree_util.keystr(path)
            for name in (key, _plain(key)):
                if name in flat:
                    paths[name] = True
                    return flat[name]
            return replicated

        tree = jax.tree_util.tree_map_with_path(pick, params)
        missing = [p for p in flat if p not in paths]
        if missing:
            raise SBPError(
                f"Strategy.param_sbp: no parameter at {missing} in the given tree; its paths are "
                f"{[jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]}."
            )
        return tree

    def rules(self) -> dict:
        """``{parameter path pattern: nd-SBP}`` for annotating a model: tied layers
        give one pattern with ``*`` where their index differs (``layers.*.attn.qkv``)."""
        out = {}
        for lp in self.layers:
            if not lp.param:
                continue
            key = self.tie_keys.get(lp.name)
            pattern = lp.param
            if key and "*" in key:
                prefix = key.split("*")[0]
                pattern = re.sub(r"^" + re.escape(prefix) + r"\d+", prefix + "*", lp.param)
            out[pattern] = lp.w_sbp
        return out

    def matmul(self, x, w, name: str):
        """Inside a function given to ``sj.jit``: ``x @ w`` of layer ``name`` laid out as
        the strategy says, forward and backward. Every value whose layout the
        strategy priced is pinned (input, weight, product, output, and their
        gradients), so the program moves exactly the predicted bytes."""
        lp = self[name]
        c = lp.choice
        i = self.layers.index(lp)
        # the input gradient is boxed to the previous output's layout right here,
        # before the activation's derivative multiplies it (as priced)
        back = (c.dx_sbp(), self.layers[i - 1].out_sbp) if i else (c.dx_sbp(),)
        y = _pinned(c.x_sbp(), *back)(x) @ _pinned(c.w_sbp(), c.dw_sbp())(w)
        return _pinned(lp.out_sbp, lp.out_sbp)(_pinned(c.y_sbp(), c.dy_sbp())(y))

    def synced(self, grads):
        """The weight gradients (a tree like ``params``) boxed to their weights'
        layouts: the gradient all-reduce over the data axes happens here."""
        import jax

        from sbpjax.compiler.api import constrain

        return jax.tree.map(constrain, grads, self.param_sbp(grads))

    # -- reports --------------------------------------------------------------
    def table(self) -> str:
        rows = [("layer", "choice", "X", "W", "out", "redistribution", "grad sync", "memory/dev")]
        for lp in self.layers:
            rows.append(
                (
                    lp.name,
                    lp.choice.label(self.grid),
                    format_sbp(lp.x_sbp),
                    format_sbp(lp.w_sbp),
                    format_sbp(lp.out_sbp),
                    human_bytes(lp.redistribution.bytes),
                    human_bytes(lp.sync.bytes),
                    human_bytes(lp.memory),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        head = (
            f"Strategy on {self.grid!r} ({self.method}, objective {self.objective}, "
            f"search {self.search_seconds:.3g} s); layouts over fine axes {', '.join(self.grid.fine_names)}"
        )
        lines = [head]
        lines += ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.append(
            f"  total {human_bytes(self.bytes)} per step "
            f"(redistribution {human_bytes(self.redistribution_bytes)}, "
            f"grad sync {human_bytes(self.sync_bytes)}), est. {self.time * 1e3:.4g} ms, "
            f"memory {human_bytes(self.memory)} per device"
        )
        return "\n".join(lines)

    __str__ = table


def _plain(keystr: str) -> str:
    """``"['w1']"`` -> ``"w1"``; ``"['a']['b']"`` -> ``"a.b"`` (dict and attribute keys)."""
    parts = re.findall(r"\[['\"]?([^'\"\]]+)['\"]?\]|\.([A-Za-z_]\w*)", keystr)
    return ".".join(a or b for a, b in parts)


_PINNED: dict = {}


def _pinned(forward, *backward):
    """``sj.constrain`` to ``forward`` on the value and to each of ``backward`` in
    turn on its cotangent."""
    key = (forward, backward)
    if key not in _PINNED:
        import jax

        from sbpjax.compiler.api import constrain

        @jax.custom_vjp
        def pin(x):
            return constrain(x, forward)

        def pin_backward(_, g):
            for sbp in backward:
                g = constrain(g, sbp)
            return (g,)

        pin.defvjp(lambda x: (constrain(x, forward), None), pin_backward)
        _PINNED[key] = pin
    return _PINNED[key]


def build(tables: Tables, assign, grid: Grid, method: str, seconds: float, placement=None) -> Strategy:
    """The strategy of one assignment of the tables' groups."""
    ops = tables.ops
    layers = []
    for i, op in enumerate(ops):
        a = assign[tables.op_group[i]]
        c = tables.options[tables.op_group[i]][a]
        if i + 1 < len(ops):
            b = assign[tables.op_group[i + 1]]
            dim = tables.dims[i][a, b]
            o, e = tables.parts["edge"][i][a, b]
            redis = o + e
        else:
            redis, dim = tables.parts["output"][i][a]
        out = c.out_sbp(dim) if dim is not None else c.dy_sbp()
        layers.append(
            LayerPlan(
                op.name,
                op.param,
                c,
                dim,
                c.x_sbp(),
                c.w_sbp(),
                out,
                redis,
                tables.parts["sync"][i][a],
                float(tables.memory[i][a]),
            )
        )
    return Strategy(
        grid, layers, method, tables.objective, seconds, {op.name: op.tie for op in ops if op.tie}, placement
    )


def spearman(a, b) -> float:
    """Spearman rank correlation (average ranks for ties)."""

    def ranks(v):
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for x in np.unique(v):
            r[v == x] = r[v == x].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])
