"""sbpjax: OneFlow's SBP (Split / Broadcast / Partial-value) layouts for JAX.

    import sbpjax as sj
    pl = sj.placement((2, 4), ("x", "y"))
    t = sj.to_global(x, pl, (sj.S(0), sj.B))
    u = t.to_global(sbp=(sj.B, sj.S(1)))      # boxing with the cheapest collectives
    print(sj.plan_boxing(x.shape, x.dtype, pl, t.sbp, u.sbp))

The documentation (concepts, tutorial, guides, API reference) is built from
docs/ in the source tree: ``bash scripts/docs.sh``.
"""

from sbpjax._errors import SBPError, SBPWarning
from sbpjax._version import __version__
from sbpjax.boxing.cost import CostModel, calibrate
from sbpjax.boxing.plan import BoxingPlan, Step, plan_boxing
from sbpjax.comm import Collective, collectives
from sbpjax.placement import Placement, placement
from sbpjax.sbp import (
    B,
    P,
    P_max,
    P_min,
    S,
    Broadcast,
    Partial,
    Split,
    broadcast,
    format_sbp,
    parse_sbp,
    partial_max,
    partial_min,
    partial_sum,
    split,
)
from sbpjax.local_tensors import from_local_tensors
from sbpjax.tensor import GlobalTensor, to_global
from sbpjax.show import layout_text, show
from sbpjax.compiler.api import AUTO, CompiledFunction, constrain, jit
from sbpjax.compiler.options import CompileOptions

__all__ = [
    "__version__",
    "SBPError",
    "SBPWarning",
    "S",
    "B",
    "P",
    "P_max",
    "P_min",
    "split",
    "broadcast",
    "partial_sum",
    "partial_max",
    "partial_min",
    "Split",
    "Broadcast",
    "Partial",
    "parse_sbp",
    "format_sbp",
    "Placement",
    "placement",
    "GlobalTensor",
    "to_global",
    "from_local_tensors",
    "plan_boxing",
    "BoxingPlan",
    "Step",
    "CostModel",
    "calibrate",
    "collectives",
    "Collective",
    "jit",
    "constrain",
    "AUTO",
    "CompileOptions",
    "CompiledFunction",
    "show",
    "layout_text",
]
