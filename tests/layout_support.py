"""Whether this kernel lets a program be started without address-space randomization (``--aslr``)."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

REFUSED = "the kernel refuses ADDR_NO_RANDOMIZE here (a seccomp profile, e.g. Docker's)"


@functools.cache
def layout_settable() -> bool:
    """Tried once, in a child process: the flag set on its thread."""
    code = "from ringcore.rank_agent import set_layout; set_layout(True)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def skip_unless_layout_settable() -> None:
    if not layout_settable():
        pytest.skip(REFUSED)
