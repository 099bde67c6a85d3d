"""The whole-program SBP compiler (``sj.jit``): trace, propagate, lower, explain."""
