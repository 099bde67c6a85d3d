"""The candidate screen's index: which candidates read each operand in each layout.

:class:`sbpjax.compiler.domains.Domains` keeps an op's candidates whose
operands are each read in a layout the operand may be in; the lists are
shared by many ops, so each is indexed once, as bitsets.
"""

from __future__ import annotations


class OperandIndex:
    """Which candidates of a list read each operand in each layout, as bitsets.

    Candidate lists are shared by the ops of one ``op_key`` (every iteration of a
    written-out scan, every alike layer), so each list's index is built once and
    read by thousands of ops: screening a 32-layer scanned GPT's 8,700 ops took
    630,000 membership tests candidate by candidate."""

    def __init__(self):
        # id(candidate list) -> (the list, per operand {layout: bitset of its readers})
        self._lists: dict = {}

    def _index(self, cs) -> list:
        hit = self._lists.get(id(cs))
        if hit is None or hit[0] is not cs:
            index: list = [{} for _ in (cs[0][0] if cs else ())]
            for i, c in enumerate(cs):
                for k, nd in enumerate(c[0]):
                    index[k][nd] = index[k].get(nd, 0) | (1 << i)
            hit = self._lists[id(cs)] = (cs, index)
        return hit[1]

    def reading(self, cs, allow) -> list:
        """The candidates of ``cs`` that read each operand in a layout of its
        ``allow`` set (None: any), in their order."""
        index = self._index(cs)
        mask = (1 << len(cs)) - 1
        for k, al in enumerate(allow):
            if al is not None and mask:
                # a candidate reads an operand in one layout: the layouts' sets are disjoint
                mask &= sum(bits for nd, bits in index[k].items() if nd in al)
        out = []
        while mask:
            low = mask & -mask
            out.append(cs[low.bit_length() - 1])
            mask ^= low
        return out
