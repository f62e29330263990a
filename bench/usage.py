"""``-h``/``--help`` for the bench scripts that take positional arguments: their docstring, which
shows how to run them."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def answer_help(doc: str | None, argv: Sequence[str] | None = None) -> None:
    """Print ``doc`` and exit 0 when ``argv`` (default: the command line's) asks for help."""
    args = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in args):
        print((doc or "").strip())
        raise SystemExit(0)
