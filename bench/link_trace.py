"""A network link's busy and idle spells, from its byte counters sampled every millisecond.

    bench/netns_cluster.sh exec 0 .venv/bin/python bench/link_trace.py record /tmp/h0.npy --seconds 5
    .venv/bin/python bench/link_trace.py show /tmp/h0.npy [--bin-ms 10] [--busy-mbs 5]

``record`` reads ``/sys/class/net/IFACE/statistics/{tx,rx}_bytes`` (inside a
network namespace, ``ip netns exec`` shows that namespace's devices) every
millisecond until ``--seconds`` pass or SIGTERM / Ctrl-C, then saves rows of
``(time.perf_counter(), tx_bytes, rx_bytes)``. ``perf_counter`` is the
monotonic clock ``RINGCORE_TIMELINE`` stamps its events with, so a rank's
timeline lines up with the trace. ``show`` cuts the transmit side into bins
and prints every busy span (bins above ``--busy-mbs``): its length, bytes,
mean rate, and the bins in it that ran below ``--slow-mbs``. This is how the
idle spells at the start and end of each hierarchical slice were found
(``bench/HISTORY.md``, "Target 4 met").
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np


class Span(NamedTuple):
    """A run of busy bins: seconds from the first sample, bytes sent, mean MB/s, rates of its slow bins."""

    start: float
    end: float
    sent: float
    rate: float
    slow: list[float]


def record(out: Path, iface: str, seconds: float | None, interval: float = 0.001) -> int:
    """Sample ``iface``'s counters into ``out`` (.npy) until ``seconds`` pass or SIGTERM; returns the row count."""
    stats = Path("/sys/class/net") / iface / "statistics"
    rows: list[tuple[float, int, int]] = []
    stop = False

    def finish(*_: object) -> None:
        nonlocal stop
        stop = True

    previous = signal.signal(signal.SIGTERM, finish)
    deadline = None if seconds is None else time.perf_counter() + seconds
    try:
        with open(stats / "tx_bytes") as tx, open(stats / "rx_bytes") as rx:
            while not stop and (deadline is None or time.perf_counter() < deadline):
                tx.seek(0)
                rx.seek(0)
                rows.append((time.perf_counter(), int(tx.read()), int(rx.read())))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    np.save(out, np.array(rows, dtype=np.float64).reshape(-1, 3))
    return len(rows)


def busy_spans(
    rows: np.ndarray, bin_s: float = 0.01, busy_mbs: float = 5.0, slow_mbs: float = 100.0
) -> list[Span]:
    """The transmit side's busy spans: bins of ``bin_s`` seconds whose rate exceeds ``busy_mbs`` MB/s."""
    times, sent = rows[:, 0] - rows[0, 0], rows[:, 1]
    edges = np.arange(0.0, times[-1] + bin_s / 2, bin_s)
    at_edges = np.interp(edges, times, sent)
    rates = np.diff(at_edges) / bin_s / 1e6
    spans, first = [], None
    for index, busy in enumerate([*(rates > busy_mbs), False]):
        if busy and first is None:
            first = index
        elif not busy and first is not None:
            inside = rates[first:index]
            spans.append(
                Span(
                    first * bin_s,
                    index * bin_s,
                    float(at_edges[index] - at_edges[first]),
                    float(inside.mean()),
                    [float(r) for r in inside[inside < slow_mbs]],
                )
            )
            first = None
    return spans


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample a link's byte counters every millisecond")
    rec.add_argument("out", type=Path, help="where to save the samples (.npy)")
    rec.add_argument("--iface", default="eth0", help="network interface (default eth0)")
    rec.add_argument("--seconds", type=float, default=None, help="stop after this long (default: at SIGTERM)")
    show = sub.add_parser("show", help="print a recorded trace's busy spans")
    show.add_argument("trace", type=Path, help="a file `record` wrote")
    show.add_argument("--bin-ms", type=float, default=10.0, help="bin width (default 10 ms)")
    show.add_argument("--busy-mbs", type=float, default=5.0, help="a bin above this many MB/s is busy")
    show.add_argument("--slow-mbs", type=float, default=100.0, help="list busy bins below this many MB/s")
    args = parser.parse_args()
    if args.command == "record":
        print(f"{record(args.out, args.iface, args.seconds)} samples in {args.out}")
        return
    for span in busy_spans(np.load(args.trace), args.bin_ms / 1e3, args.busy_mbs, args.slow_mbs):
        slow = " ".join(f"{r:.0f}" for r in span.slow[:20])
        print(
            f"{span.start * 1e3:8.0f}-{span.end * 1e3:8.0f} ms: {(span.end - span.start) * 1e3:6.0f} ms, "
            f"{span.sent / 1e6:7.1f} MB, {span.rate:6.1f} MB/s; {len(span.slow)} slow bins {slow}"
        )


if __name__ == "__main__":
    main()
