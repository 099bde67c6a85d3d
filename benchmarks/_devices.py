"""The simulated CPU devices a benchmark runs on, set before JAX starts.

One definition for every benchmark and the child processes they start: the
caller's other XLA flags are kept (a test's fast compile settings, a dump
directory). Before, a caller with any XLA_FLAGS of their own got one device
and an error. A benchmark keeps a device count the caller gave (a parent
process sets its children's); a child it starts gets its own count.
"""

from __future__ import annotations

import os
import re

_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


def xla_flags_with_devices(n: int, flags: str | None = None) -> str:
    """``flags`` (default: ``$XLA_FLAGS``) with JAX's CPU backend showing ``n`` devices."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    return f"{_COUNT.sub('', flags).strip()} --xla_force_host_platform_device_count={n}".strip()


def simulate_devices(n: int) -> None:
    """Set ``$XLA_FLAGS`` for ``n`` simulated CPU devices unless it names a
    count already (call before importing JAX)."""
    if not _COUNT.search(os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = xla_flags_with_devices(n)
