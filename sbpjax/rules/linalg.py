"""Transforms over a value's trailing dims, batched over the leading ones:
FFTs and the matrix decompositions and solves of ``jnp.linalg`` and
``jax.scipy.linalg``.

Each works on its last dims (an FFT's ``len(fft_lengths)``, a matrix's two)
and on every leading index alike, so a split of a leading dim stays split:
the FFT of each row of a row-split signal, the Cholesky factor of each matrix
of a split batch, with nothing moved. A split of a transformed dim is boxed
to B first (the rule offers no signature for it), as for a sort's sorted dim.
"""

from __future__ import annotations

from sbpjax.rules import B, Sig, rank, register
from sbpjax.sbp import Split

# decompositions and solves whose operands are all matrices: batched over the
# dims before the last two
MATRIX = (
    "cholesky",
    "lu",
    "qr",
    "svd",
    "eigh",
    "eig",
    "schur",
    "hessenberg",
    "tridiagonal",
    "geqrf",
    "triangular_solve",
    "symmetric_product",
)
# those with a vector per matrix among their operands (Householder scalars,
# pivots, diagonals, an update): batched over the dims before that vector's last
WITH_VECTORS = (
    "householder_product",
    "ormqr",
    "geqp3",
    "lu_pivots_to_permutation",
    "tridiagonal_solve",
    "cholesky_update",
)


def _batched(eqn, in_avals, transformed: int) -> list:
    """S(d) on every operand and result for each leading dim ``d`` (the
    operands' rank less ``transformed``), and B."""
    n_in, n_out = len(in_avals), len(eqn.outvars)
    leading = min(rank(a) for a in in_avals) - transformed
    sigs = [Sig((Split(d),) * n_in, (Split(d),) * n_out) for d in range(max(leading, 0))]
    return sigs + [Sig((B,) * n_in, (B,) * n_out)]


@register("fft")
def fft(eqn, in_avals):
    """``fft_i = fft(x_i)`` for splits of the dims before the transformed ones
    (the last ``len(fft_lengths)``)."""
    return _batched(eqn, in_avals, len(eqn.params["fft_lengths"]))


@register(*MATRIX)
def matrix(eqn, in_avals):
    """A decomposition or triangular solve of each matrix (the last two dims)
    for splits of the batch dims before them."""
    return _batched(eqn, in_avals, 2)


@register(*WITH_VECTORS)
def with_vectors(eqn, in_avals):
    """The same, for splits of the batch dims before the last dim of the
    operand of least rank (a vector per matrix)."""
    return _batched(eqn, in_avals, 1)
