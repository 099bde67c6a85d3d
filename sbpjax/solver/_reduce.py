"""Exact reductions: smaller models with the same optimum.

- *Pruning* removes a strategy no solution of finite cost within the usage limit can use:
  a cost of inf; a strategy that every allowed strategy of some neighbour prices at inf
  (arc consistency); a usage that overflows the limit even with every other live piece at
  its smallest usage. An empty domain proves there is no solution.
- *Merging dependencies*: when every strategy of u leaves exactly one finite entry in its
  matrix with v, v's strategy is a function of u's in every finite solution. v then joins
  u's model node: its costs, pairs and memory are re-indexed by u's strategies. Sharding
  problems are full of such pairs (an op that must follow its operand's layout; a node
  with one strategy): the IOPDDL instances shrink from 816-34,932 nodes to 124-4,910.
- *Additive pairs*: a matrix ``M[a, b] = r[a] + c[b]`` is two unary costs.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver._model import Memory, Model, local_index, offsets


def reduce(model: Model, rounds: int = 64) -> Model:
    """Prune and merge until nothing changes (or ``rounds``, a safety bound never reached
    in practice: each round merges at least one node)."""
    for _ in range(rounds):
        model = prune(model)
        if model.infeasible is not None:
            return model
        merged = merge_dependencies(model)
        if merged is None:
            break
        model = merged
    return split_additive(model)


def prune(model: Model) -> Model:
    allowed = np.isfinite(model.unary)
    if model.memory is None and allowed.all() and np.isfinite(model.pflat).all():
        return model  # nothing is forbidden: nothing to prune
    rows, cols = model.entry_index()
    rkey, ckey, rpos, cpos = model.line_index()
    finite = np.isfinite(model.pflat)
    node = model.node_of()
    mem = model.memory
    qpos = mem.positions(model.noff) if mem is not None else None
    while True:
        changed = False
        for key, pos in ((rkey, rpos), (ckey, cpos)):
            ok = finite & allowed[rows] & allowed[cols]
            support = np.bincount(key, weights=ok, minlength=len(pos)) > 0
            drop = np.zeros_like(allowed)
            drop[pos[~support]] = True
            drop &= allowed
            if drop.any():
                allowed &= ~drop
                changed = True
        count = np.bincount(node, weights=allowed, minlength=model.n)
        if (count == 0).any():
            i = int(np.flatnonzero(count == 0)[0])
            return _infeasible(
                model, f"node {int(np.flatnonzero(model.mroot == i)[0])} has no strategy of finite cost"
            )
        if mem is not None and len(mem.qnode):
            assert qpos is not None
            masked = np.where(allowed[qpos], mem.qusage, np.inf)
            least = np.minimum.reduceat(masked, mem.qoff[:-1])
            base = mem.sum_live(least)
            if base.size and base.max() > mem.limit:
                return _infeasible(
                    model, f"even the smallest usages need {base.max():.6g} > usage_limit {mem.limit:.6g}"
                )
            room = mem.limit - range_max(base, mem.qlo, mem.qhi)
            over = mem.qusage - np.repeat(least, np.diff(mem.qoff)) > np.repeat(room, np.diff(mem.qoff))
            drop = np.zeros_like(allowed)
            drop[qpos[over]] = True
            drop &= allowed
            if drop.any():
                allowed &= ~drop
                changed = True
        if not changed:
            return restrict(model, allowed)


def _infeasible(model: Model, why: str) -> Model:
    model.infeasible = why
    return model


def range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``max(values[lo[i]:hi[i]])`` for every i (lo < hi), by a sparse table."""
    out = np.zeros(len(lo))
    if not len(lo):
        return out
    table = [values.astype(np.float64)]
    span = 1
    while 2 * span <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[:-span], prev[span:]))
        span *= 2
    length = hi - lo
    level = np.zeros(len(lo), dtype=np.int64)
    while True:  # the largest level with 2**level <= length, in exact integer steps
        up = (1 << (level + 1)) <= length
        if not up.any():
            break
        level += up
    for lv in np.unique(level):
        sel = level == lv
        t = table[lv]
        out[sel] = np.maximum(t[lo[sel]], t[hi[sel] - (1 << lv)])
    return out


def restrict(model: Model, allowed: np.ndarray) -> Model:
    """The model with only the ``allowed`` flat strategies."""
    if allowed.all():
        return model
    k = np.bincount(model.node_of(), weights=allowed, minlength=model.n).astype(np.int64)
    rows, cols = model.entry_index()
    msizes = np.diff(model.moff)
    mpos = np.repeat(model.noff[model.mroot], msizes) + local_index(msizes)
    mem = model.memory
    if mem is not None:
        qkeep = allowed[mem.positions(model.noff)]
        mem = Memory(
            mem.qnode, mem.qlo, mem.qhi, offsets(k[mem.qnode]), mem.qusage[qkeep], mem.nseg, mem.limit
        )
    return Model(
        k=k,
        noff=offsets(k),
        unary=model.unary[allowed],
        pu=model.pu,
        pv=model.pv,
        poff=offsets(k[model.pu] * k[model.pv]),
        pflat=model.pflat[allowed[rows] & allowed[cols]],
        mroot=model.mroot,
        moff=offsets(k[model.mroot]),
        mmap=model.mmap[allowed[mpos]],
        memory=mem,
    )


def _functions(model: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Which pairs make v a function of u (``u_to_v``) or u of v, and the functions: row a of
    pair p maps to column ``frow[roff[p] + a]``; column b to row ``fcol[coff[p] + b]``."""
    rkey, ckey, _, _ = model.line_index()
    finite = np.isfinite(model.pflat)
    ku, kv = model.k[model.pu], model.k[model.pv]
    roff, coff = offsets(ku), offsets(kv)
    sizes = ku * kv
    loc = local_index(sizes)
    kv_e = np.repeat(kv, sizes)
    rowcnt = np.bincount(rkey, weights=finite, minlength=int(roff[-1]))
    colcnt = np.bincount(ckey, weights=finite, minlength=int(coff[-1]))
    u_to_v = np.logical_and.reduceat(rowcnt == 1, roff[:-1]) if len(ku) else np.zeros(0, bool)
    v_to_u = np.logical_and.reduceat(colcnt == 1, coff[:-1]) if len(kv) else np.zeros(0, bool)
    frow = np.zeros(int(roff[-1]), dtype=np.int64)
    fcol = np.zeros(int(coff[-1]), dtype=np.int64)
    frow[rkey[finite]] = (loc % kv_e)[finite]
    fcol[ckey[finite]] = (loc // kv_e)[finite]
    return u_to_v, v_to_u, frow, fcol


def merge_dependencies(model: Model) -> Model | None:
    """Model nodes joined by functional pairs merged into one (None: no such pair)."""
    u_to_v, v_to_u, frow, fcol = _functions(model)
    candidates = np.flatnonzero(u_to_v | v_to_u)
    if not len(candidates):
        return None
    n = model.n
    roff, coff = offsets(model.k[model.pu]), offsets(model.k[model.pv])
    parent = [-1] * n
    link: list = [None] * n  # the map from the parent's strategies to the node's
    uf = list(range(n))

    def find(a: int) -> int:
        while uf[a] != a:
            uf[a] = uf[uf[a]]
            a = uf[a]
        return a

    pu, pv = model.pu.tolist(), model.pv.tolist()
    for p in candidates.tolist():
        u, v = pu[p], pv[p]
        ru, rv = find(u), find(v)
        if ru == rv:
            continue
        if u_to_v[p] and parent[v] < 0:
            parent[v], link[v] = u, frow[roff[p] : roff[p + 1]]
        elif v_to_u[p] and parent[u] < 0:
            parent[u], link[u] = v, fcol[coff[p] : coff[p + 1]]
        else:
            continue
        uf[rv] = ru
    return _collapse(model, parent, link)


def _collapse(model: Model, parent: list, link: list) -> Model:
    """The model with each tree of ``parent`` one node, its root's: a
    member's strategy is ``link``'s function of its parent's."""
    rid, k, gflat, goff = _root_maps(model, parent, link)
    noff = offsets(k)
    gsizes = k[rid]
    # unary: each member's costs at its mapped strategies
    newpos = np.repeat(noff[rid], gsizes) + local_index(gsizes)
    oldpos = np.repeat(model.noff[:-1], gsizes) + gflat
    unary = np.bincount(newpos, weights=model.unary[oldpos], minlength=int(noff[-1]))
    unary += _inner_pairs(model, rid, k, noff, gflat, goff, len(unary))
    pu, pv, poff, pflat = _outer_pairs(model, rid, k, gflat, goff)
    # members and memory pieces follow their model node
    mroot = rid[model.mroot]
    msizes = k[mroot]
    mmap = model.mmap[
        np.repeat(model.moff[:-1], msizes) + gflat[np.repeat(goff[model.mroot], msizes) + local_index(msizes)]
    ]
    mem = model.memory
    if mem is not None:
        qsz = k[rid[mem.qnode]]
        qold = np.repeat(mem.qoff[:-1], qsz) + gflat[np.repeat(goff[mem.qnode], qsz) + local_index(qsz)]
        mem = Memory(rid[mem.qnode], mem.qlo, mem.qhi, offsets(qsz), mem.qusage[qold], mem.nseg, mem.limit)
    return Model(k, noff, unary, pu, pv, poff, pflat, mroot, offsets(msizes), mmap, mem)


def _root_maps(model: Model, parent: list, link: list):
    """``(rid, k, gflat, goff)``: each node's root (numbered), each root's
    strategy count, and flat, per node, the node's strategy for each of its
    root's (``gflat[goff[x] + a]``)."""
    n = model.n
    children: list = [[] for _ in range(n)]
    for x, p in enumerate(parent):
        if p >= 0:
            children[p].append(x)
    roots = [x for x in range(n) if parent[x] < 0]
    rid = np.empty(n, dtype=np.int64)
    g: list = [None] * n  # g[x][a]: x's strategy when its root takes strategy a
    for i, r in enumerate(roots):
        g[r] = np.arange(model.k[r])
        stack = [r]
        while stack:
            x = stack.pop()
            rid[x] = i
            for c in children[x]:
                g[c] = link[c][g[x]]
                stack.append(c)
    k = model.k[roots]
    return rid, k, np.concatenate(g), offsets(k[rid])


def _inner_pairs(model: Model, rid, k, noff, gflat, goff, size: int) -> np.ndarray:
    """The pairs inside one tree, as unary costs of its root."""
    ru, rv = rid[model.pu], rid[model.pv]
    p_in = np.flatnonzero(ru == rv)
    sz = k[ru[p_in]]
    a = local_index(sz)
    gu = gflat[np.repeat(goff[model.pu[p_in]], sz) + a]
    gv = gflat[np.repeat(goff[model.pv[p_in]], sz) + a]
    vals = model.pflat[np.repeat(model.poff[p_in], sz) + gu * np.repeat(model.k[model.pv[p_in]], sz) + gv]
    return np.bincount(np.repeat(noff[ru[p_in]], sz) + a, weights=vals, minlength=size)


def _outer_pairs(model: Model, rid, k, gflat, goff):
    """``(pu, pv, poff, pflat)``: the pairs between trees, re-indexed by
    their roots' strategies (the lower root on the row side), those between
    the same two roots summed."""
    ru, rv = rid[model.pu], rid[model.pv]
    p_out = np.flatnonzero(ru != rv)
    if not len(p_out):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.float64)
    swap = ru[p_out] > rv[p_out]
    lo_node = np.where(swap, model.pv[p_out], model.pu[p_out])  # the old node on the new row side
    hi_node = np.where(swap, model.pu[p_out], model.pv[p_out])
    rlo, rhi = rid[lo_node], rid[hi_node]
    sizes = k[rlo] * k[rhi]
    loc = local_index(sizes)
    kc = np.repeat(k[rhi], sizes)
    ga = gflat[np.repeat(goff[lo_node], sizes) + loc // kc]
    gb = gflat[np.repeat(goff[hi_node], sizes) + loc % kc]
    sw = np.repeat(swap, sizes)
    old_row, old_col = np.where(sw, gb, ga), np.where(sw, ga, gb)
    vals = model.pflat[
        np.repeat(model.poff[p_out], sizes) + old_row * np.repeat(model.k[model.pv[p_out]], sizes) + old_col
    ]
    _, first, inv = np.unique(rlo * model.n + rhi, return_index=True, return_inverse=True)
    poff = offsets(sizes[first])
    pflat = np.bincount(np.repeat(poff[:-1][inv], sizes) + loc, weights=vals, minlength=int(poff[-1]))
    return rlo[first], rhi[first], poff, pflat


def split_additive(model: Model) -> Model:
    """Pairs whose matrix is ``r[a] + c[b]`` (all finite) moved into the unary costs."""
    if not model.npairs:
        return model
    ku, kv = model.k[model.pu], model.k[model.pv]
    sizes = ku * kv
    loc = local_index(sizes)
    kv_e = np.repeat(kv, sizes)
    base = np.repeat(model.poff[:-1], sizes)
    a, b = loc // kv_e, loc % kv_e
    m = model.pflat
    with np.errstate(invalid="ignore"):
        resid = m - m[base + a * kv_e] - m[base + b] + m[base]
    flat_ok = np.isfinite(m) & (np.abs(resid) <= 1e-9 * (1.0 + np.abs(m)))
    additive = np.logical_and.reduceat(flat_ok, model.poff[:-1])
    if not additive.any():
        return model
    sel = np.repeat(additive, sizes)
    unary = model.unary.copy()
    first_col = sel & (b == 0)  # r[a] = M[a, 0]
    np.add.at(unary, np.repeat(model.noff[model.pu], sizes)[first_col] + a[first_col], m[first_col])
    first_row = sel & (a == 0)  # c[b] = M[0, b] - M[0, 0]
    np.add.at(
        unary,
        np.repeat(model.noff[model.pv], sizes)[first_row] + b[first_row],
        m[first_row] - m[base][first_row],
    )
    keep = ~additive
    return Model(
        model.k,
        model.noff,
        unary,
        model.pu[keep],
        model.pv[keep],
        offsets(sizes[keep]),
        m[~sel],
        model.mroot,
        model.moff,
        model.mmap,
        model.memory,
    )
