"""Chrome trace events of every collective: ``RINGCORE_TIMELINE=path.json``.

Each rank writes its own file (``path`` with ``{rank}`` replaced, or
``.rank<r>`` inserted before the suffix when there is no placeholder), in the
JSON array format that chrome://tracing and Perfetto load. Per collective
there is one complete event (``"ph": "X"``) on the rank's track 0, with the
bytes it moved and the time it spent waiting for peers, and within its time
span one event per step of its schedule (``scatter-reduce``, ``allgather``,
``broadcast``...) on track 1 + step: pipelined steps overlap in time, so each
gets its own row, and events on one row never overlap. ``python -m ringcore.timeline merge out.json in...``
concatenates ranks' files into one.

Recording costs two clock reads per step and nothing when the variable is
unset.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO


def rank_path(template: str, rank: int, size: int) -> Path:
    """Where ``rank`` writes its trace."""
    if "{rank}" in template:
        return Path(template.replace("{rank}", str(rank)))
    path = Path(template)
    if size == 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix or '.json'}")


class Timeline:
    """Appends trace events to one file; thread-safe; closes the JSON array on ``close()``."""

    def __init__(self, path: Path, rank: int) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO | None = path.open("w")
        self.first = True
        self.file.write("[\n")
        self._write(
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}
        )

    @staticmethod
    def now_us() -> float:
        return time.perf_counter_ns() / 1000.0

    def complete(
        self, name: str, category: str, start_us: float, end_us: float, args: dict[str, Any], track: int = 0
    ) -> None:
        """One complete event from ``start_us`` to ``end_us`` (``now_us()`` clock) on ``track``."""
        self._write(
            {
                "name": name,
                "cat": category,
                "ph": "X",
                "ts": round(start_us, 3),
                "dur": round(max(0.0, end_us - start_us), 3),
                "pid": self.rank,
                "tid": track,
                "args": args,
            }
        )

    def _write(self, event: dict[str, Any]) -> None:
        with self.lock:
            if self.file is None:
                return
            self.file.write(("" if self.first else ",\n") + json.dumps(event))
            self.first = False

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                self.file.write("\n]\n")
                self.file.close()
                self.file = None


def merge(out: str, inputs: list[str]) -> int:
    """Concatenate ranks' trace files into one array; returns the number of events."""
    events: list[Any] = []
    for name in inputs:
        text = Path(name).read_text().rstrip()
        if not text.endswith("]"):  # a rank that died before closing its file
            text = text.rstrip(",") + "]"
        events.extend(json.loads(text))
    Path(out).write_text(json.dumps(events))
    return len(events)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[0] != "merge":
        print("usage: python -m ringcore.timeline merge OUT.json IN.json [IN.json ...]", file=sys.stderr)
        return 2
    count = merge(args[1], args[2:])
    print(f"wrote {count} events from {len(args) - 2} file(s) to {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
