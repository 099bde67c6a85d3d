"""The one exception type users see.

Every message says what is wrong, where, and how to fix it.
"""


class SBPError(ValueError):
    """Bad SBP input: a layout, placement, shape or request that cannot work."""


class SBPWarning(UserWarning):
    """Something sbpjax handled in a slower or less precise way than asked:
    an unknown primitive run whole on every device, a loop forced to B."""
