"""``dot_general``: matrix products with batch and contracting dims.

Per device: ``Y_i = dot(X_i, W_i)``. With ``X`` and ``W`` split on a shared
batch dim, or one operand split on a free dim and the other broadcast, each
device computes its piece of ``Y``. Split on the contracting dims of both,
``Y = sum_i dot(X_i, W_i)``: a partial sum. A partial operand times a broadcast
one stays partial. OneFlow Table 1 (``Y = X W``): (S(0),B)->S(0), (B,S(1))->S(1),
(S(1),S(0))->P, (P,B)->P, (B,P)->P, (B,B)->B; nd signatures (Tables 3 and
AutoDDL's 3-D matmul) combine these per placement axis.
"""

from __future__ import annotations

from sbpjax.rules import B, P, Sig, rank, register
from sbpjax.sbp import Split


@register("dot_general")
def dot_general(eqn, in_avals):
    """Batch splits, free-dim splits, contracting splits -> P(sum), P x B -> P."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lr, rr = rank(in_avals[0]), rank(in_avals[1])
    l_free = [d for d in range(lr) if d not in lc and d not in lb]
    r_free = [d for d in range(rr) if d not in rc and d not in rb]
    sigs = []
    for k, (a, b) in enumerate(zip(lb, rb)):
        sigs.append(Sig((Split(a), Split(b)), (Split(k),)))
    for k, d in enumerate(l_free):
        sigs.append(Sig((Split(d), B), (Split(len(lb) + k),)))
    for k, d in enumerate(r_free):
        sigs.append(Sig((B, Split(d)), (Split(len(lb) + len(l_free) + k),)))
    for a, b in zip(lc, rc):
        sigs.append(Sig((Split(a), Split(b)), (P(),)))
    sigs += [Sig((P(), B), (P(),)), Sig((B, P()), (P(),)), Sig((B, B), (B,))]
    return sigs


@register("conv_general_dilated")
def conv(eqn, in_avals):
    """Per device ``y_i = conv(x_i, k_i)``: a batch split of ``x`` gives a batch
    split of ``y``; a split of the kernel's output channels gives a channel split
    of ``y``; splitting the input channels of both gives ``y = sum_i y_i``
    (P(sum)) when there are no feature groups. Spatial dims are not split
    (windows would cross pieces)."""
    dn = eqn.params["dimension_numbers"]
    lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    sigs = []
    if eqn.params.get("batch_group_count", 1) == 1:
        sigs.append(Sig((Split(lhs[0]), B), (Split(out[0]),)))
    if eqn.params.get("feature_group_count", 1) == 1 and eqn.params.get("batch_group_count", 1) == 1:
        sigs.append(Sig((B, Split(rhs[0])), (Split(out[1]),)))
        sigs.append(Sig((Split(lhs[1]), Split(rhs[1])), (P(),)))
    return sigs + [Sig((P(), B), (P(),)), Sig((B, P()), (P(),)), Sig((B, B), (B,))]
