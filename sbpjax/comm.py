"""Reading the collectives of a compiled JAX program.

``sj.collectives(compiled)`` parses the optimized HLO text of a compiled
program (``jax.jit(f).lower(...).compile()``, or a ``Lowered`` object, or the
text itself) and lists every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute with its group size and the bytes each
device receives. Collectives inside a ``while`` loop's body are counted once
per iteration when XLA knows the trip count (its condition's once more: the
test that ends the loop), and once when it does not (a loop that stops on a
value it computes: the count is per iteration, as ``explain()`` plans it).

Bytes each device receives, with ``g`` the group size (ring algorithms, the
convention of OneFlow Table 2 summed over devices):

* all-reduce of ``n`` bytes: ``2 (g-1)/g n``;
* all-gather producing ``n`` bytes: ``(g-1)/g n``;
* reduce-scatter producing ``n`` bytes: ``(g-1) n``;
* all-to-all of ``n`` bytes in total: ``(g-1)/g n``;
* collective-permute of ``n`` bytes: ``n`` for each receiving device whose
  source is another device (pairs that send to themselves move nothing).
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

import numpy as np

from sbpjax._errors import SBPError

_DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e4m3": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "f8e3m4": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective in a compiled program.

    ``op``: the HLO kind (all-reduce, all-gather, reduce-scatter, all-to-all,
    collective-permute); ``group_size``; ``num_groups``; ``bytes_per_device``:
    bytes each participating device receives; ``bytes``: summed over devices
    (times ``count`` for loop bodies); ``count``: executions per program run.
    """

    op: str
    group_size: int
    num_groups: int
    bytes_per_device: float
    bytes: int
    count: int = 1
    shape: str = ""
    name: str = ""

    @property
    def dtype(self) -> str:
        """The HLO element type moved (e.g. ``f32``). XLA's CPU backend moves
        bf16 collectives as f32, so compare bytes in one element type."""
        m = _ARRAY.search(self.shape)
        return m.group(1) if m else ""

    @property
    def itemsize(self) -> float:
        return _DTYPE_BYTES.get(self.dtype, 0)

    @property
    def devices(self) -> int:
        return self.group_size * self.num_groups


def _shape_bytes(shape_text: str) -> int:
    total = Fraction(0)
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += Fraction(_DTYPE_BYTES[dtype]) * n
    return int(total)


def _parse_groups(line: str, num_devices: int | None):
    m = re.search(r"replica_groups=(\{[\d,{}\s]*\})", line)
    if m:
        text = m.group(1).strip()
        inner = re.findall(r"\{([\d,\s]*)\}", text[1:-1]) if text != "{}" else []
        groups = [[int(v) for v in g.split(",") if v.strip()] for g in inner]
        groups = [g for g in groups if g]
        if groups:
            return groups
        return [list(range(num_devices))] if num_devices else None
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        out_shape = [int(v) for v in m.group(1).split(",")]
        src_shape = [int(v) for v in m.group(2).split(",")]
        ids = np.arange(int(np.prod(src_shape))).reshape(src_shape)
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(out_shape).tolist()
    if "replica_groups=mesh[" in line or "replica_groups=maximal_mesh[" in line:
        return _mesh_groups(line)
    return None


_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")
_GROUP_AXIS = re.compile(r"'?([^':,{}\s]+)'?(?::\((\d+)\)(\d+))?")


def _mesh_groups(line: str) -> list[list[int]]:
    """Groups of the mesh form XLA prints from jax 0.11 on (Shardy meshes).

    ``replica_groups=mesh['x'=2,'y'=4] {'y'}`` means: the devices of a 2x4
    mesh (logical ids in row-major order unless ``, device_ids=(...)``
    follows the axes), one group for every coordinate of the axes not listed,
    members ordered by the listed axes (``{'y','x'}`` orders y before x). A
    listed axis may be a sub-axis ``'y':(pre)size``: axis y read as
    (pre, size, rest), major first, and only its middle factor grouped.
    ``maximal_mesh[device_id=N]`` is one device.
    """
    m = re.search(r"replica_groups=maximal_mesh\[device_id=(\d+)\]", line)
    if m:
        return [[int(m.group(1))]]
    start = line.index("replica_groups=mesh[") + len("replica_groups=mesh[")
    end = line.index("]", start)
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(line[start:end])]
    shape = [size for _, size in axes]
    rest = line[end + 1 :]
    ids = np.arange(int(np.prod(shape)))
    dm = re.match(r"\s*,\s*device_ids=\(", rest)
    if dm:
        depth, i = 1, dm.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(rest[i], 0)
            i += 1
        ids = _device_id_list(rest[dm.end() : i - 1], int(np.prod(shape)))
        rest = rest[i:]
    gm = re.match(r"\s*\{([^}]*)\}", rest)
    names = [n for n, _ in axes]
    sizes = dict(axes)
    # Each listed (sub-)axis as the range [lo, hi) of pre-sizes it covers: a
    # whole axis is [1, its size); a sub-axis (pre)size is [pre, pre * size).
    listed: list[tuple[str, int, int]] = []
    for n, pre, sz in _GROUP_AXIS.findall(gm.group(1) if gm else ""):
        if n not in sizes:
            raise ValueError(f"collective groups name axis {n!r}, not in mesh {names}: {line.strip()[:200]}")
        listed.append((n, int(pre), int(pre) * int(sz)) if pre else (n, 1, sizes[n]))
    # Each mesh axis becomes its factors, major first (a sub-axis's pre-size
    # is the product of the factors before it), cut where a listed sub-axis
    # starts or ends; a listed (sub-)axis is then a run of factors.
    cuts = {a: {1, size} for a, size in axes}
    for n, lo, hi in listed:
        cuts[n] |= {lo, hi}
    factors: list[int] = []
    first: dict[str, dict[int, int]] = {}  # first[axis][pre-size] = index of that factor
    for n, _ in axes:
        bounds = sorted(cuts[n])
        first[n] = {}
        for lo, hi in zip(bounds, bounds[1:]):
            first[n][lo] = len(factors)
            factors.append(hi // lo)
    grid = ids.reshape(factors)
    grouped = []
    for n, lo, hi in listed:
        grouped += [k for p0, k in sorted(first[n].items()) if lo <= p0 < hi]
    others = [k for k in range(grid.ndim) if k not in grouped]
    size = int(np.prod([grid.shape[k] for k in grouped])) if grouped else 1
    return grid.transpose(others + grouped).reshape(-1, size).tolist()


def _device_id_list(text: str, n: int) -> np.ndarray:
    """A mesh's ``device_ids=(...)``: an iota form (``[2,4]T(1,0)``: iota
    reshaped to [2,4], transposed, read in order; also written
    ``[8]<=[2,4]T(1,0)``) or a flat list of ids."""
    m = re.fullmatch(r"\s*(?:\[[\d,]+\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if m and int(np.prod([int(v) for v in m.group(1).split(",")])) == n:
        src = [int(v) for v in m.group(1).split(",")]
        ids = np.arange(n).reshape(src)
        if m.group(2):
            ids = ids.transpose([int(v) for v in m.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(v) for v in re.findall(r"\d+", text)])


def _computations(text: str) -> dict:
    comps: dict = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?.*\{\s*$", line)
        if head and ("->" in line or head.group(1)) and not line.strip().startswith("ROOT"):
            current = ("ENTRY" if head.group(1) else "") + head.group(2)
            comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    return comps


def _multipliers(comps: dict) -> dict:
    """How many times each computation runs per program run."""
    by_name = {k.replace("ENTRY", "", 1) if k.startswith("ENTRY") else k: k for k in comps}
    entry = next((k for k in comps if k.startswith("ENTRY")), None)
    mult = {k: 0 for k in comps}
    if entry is None:
        return {k: 1 for k in comps}

    def visit(comp, times, depth=0):
        if depth > 64:
            return
        mult[comp] += times
        for line in comps[comp]:
            trip, tests = 1, 1
            if re.search(r"\swhile\(", line):
                tm = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                # the condition runs once more than the body: the test that stops it
                trip, tests = (int(tm.group(1)), int(tm.group(1)) + 1) if tm else (1, 1)
            for key, names in re.findall(
                r"(body|condition|calls|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)", line
            ):
                runs = {"body": trip, "condition": tests}.get(key, 1)
                for callee in re.findall(r"%?([\w.\-]+)", names):
                    if callee in by_name:
                        visit(by_name[callee], times * runs, depth + 1)

    visit(entry, 1)
    return mult


def _hlo_text(compiled) -> str:
    if isinstance(compiled, str):
        if "HloModule" not in compiled and "ENTRY" not in compiled:
            raise SBPError(
                f"sj.collectives: the text given is not an HLO module (no 'HloModule' or 'ENTRY' in "
                f"{compiled[:60]!r}); pass a compiled program (f.lower(*args).compile()) or its as_text()."
            )
        return compiled
    import jax

    if isinstance(compiled, jax.stages.Lowered):
        compiled = compiled.compile()
    if not callable(getattr(compiled, "as_text", None)):
        raise SBPError(
            f"sj.collectives: expected a compiled program, got {type(compiled).__name__}; for an sj.jit or "
            "jax.jit function f, pass f.lower(*args).compile()."
        )
    return compiled.as_text()


def collectives(compiled) -> list[Collective]:
    """The collectives of a compiled program (see the module docstring)."""
    text = _hlo_text(compiled)
    nd = re.search(r"num_partitions=(\d+)", text)
    num_devices = int(nd.group(1)) if nd else None
    comps = _computations(text)
    mult = _multipliers(comps)
    out = []
    for comp, lines in comps.items():
        times = mult.get(comp, 1)
        if times == 0:
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            kind = m.group("kind")
            shape = m.group("shape")
            if m.group("start"):
                # async form: (operands, outputs[, contexts]) -> keep the output part
                parts = _top_level_tuple(shape)
                shape = parts[1] if len(parts) >= 2 else shape
            n = _shape_bytes(shape)
            if kind == "collective-permute":
                pm = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
                pairs = re.findall(r"\{(\d+),(\d+)\}", pm.group(1)) if pm else []
                moving = sum(1 for a, b in pairs if a != b)
                if moving == 0:
                    continue
                out.append(
                    Collective(
                        kind, 2, moving, float(n), int(n * moving * times), times, shape, m.group("name")
                    )
                )
                continue
            groups = _parse_groups(line, num_devices) or [list(range(num_devices or 1))]
            g = len(groups[0])
            if g <= 1:
                continue
            per = {
                "all-reduce": Fraction(2 * (g - 1), g) * n,
                "all-gather": Fraction(g - 1, g) * n,
                "reduce-scatter": Fraction(g - 1) * n,
                "all-to-all": Fraction(g - 1, g) * n,
            }[kind]
            total = per * g * len(groups) * times
            out.append(
                Collective(kind, g, len(groups), float(per), int(total), times, shape, m.group("name"))
            )
    return out


def _top_level_tuple(shape: str) -> list[str]:
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    depth, cur, parts = 0, "", []
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return parts


def total_bytes(compiled) -> int:
    """All bytes received over all devices by one run of the program."""
    return int(sum(c.bytes for c in collectives(compiled)))


def summarize(compiled) -> str:
    """A short table of the program's collectives."""
    rows = collectives(compiled)
    if not rows:
        return "no collectives"
    lines = [f"{'op':<19}{'group':>6}{'groups':>7}{'count':>6}{'bytes/device':>14}{'bytes':>14}"]
    for c in rows:
        lines.append(
            f"{c.op:<19}{c.group_size:>6}{c.num_groups:>7}{c.count:>6}"
            f"{c.bytes_per_device:>14.0f}{c.bytes:>14}"
        )
    lines.append(f"total {sum(c.bytes for c in rows)} B")
    return "\n".join(lines)
