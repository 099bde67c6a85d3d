"""The one exception type users see.

Every message says what is wrong, where, and how to fix it.
"""


class SBPError(ValueError):
    """Bad SBP input: a layout, placement, shape or request that cannot work."""


def is_count(value, least: int = 1) -> bool:
    """An integer (Python's or NumPy's, not a bool) of at least ``least``: how
    counts (microbatches, stages, slots, batch sizes) are checked, so that
    ``np.int64(4)`` from an array's shape is accepted and ``True`` is not
    taken for 1."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= least


def is_positive_amount(value) -> bool:
    """A finite number (Python's or NumPy's, not a bool) above 0: how
    amounts such as memory budgets in bytes are checked (an infinite budget
    is no budget: the callers take None for that)."""
    import math
    import numbers

    import numpy as np

    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(float(value))
        and float(value) > 0
    )


class SBPWarning(UserWarning):
    """Something sbpjax handled in a slower or less precise way than asked:
    an unknown primitive run whole on every device, a loop forced to B."""
