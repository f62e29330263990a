"""The side-by-side table of ``bench/compare.py``: medians over repeats and ringcore/peer ratios.

Pure functions over the result records compare.py collects, one record per
(repeat, N, engine) run::

    {"engine": "gloo", "n": 4, "rep": 0, "rc": 0, "rows": [{"bytes": 4096, "time_us": .., "busbw": ..}, ..]}

For every N, size and engine the table shows the median busbw over the
repeats (and below :data:`SMALL_BYTES` also the median time, where latency
matters more than bandwidth), then ringcore's busbw divided by the best of
the TCP peers and by each peer. "ringcore" is whichever of ``ringcore`` and
``ringcore-symmetric`` is named first (``--engines
ringcore-symmetric,ringcore,mpi-shm`` compares the symmetric route with the
others); ``ringcore:NAME=VALUE`` variants are peers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SMALL_BYTES = 64 * 1024
BASELINE = "ringcore"
TCP_PEERS = ("gloo", "mpi-tcp")  # "best peer": the ones that move bytes over TCP like ringcore

Cell = dict[str, float]
Summary = dict[int, dict[str, dict[int, Cell]]]


def summarize(records: Iterable[Mapping[str, Any]]) -> Summary:
    """Median busbw and time over repeats, keyed ``[n][engine][bytes]``.

    Each cell has ``busbw``, ``time_us`` (medians), ``busbw_min``, ``busbw_max``
    and ``repeats``. Records without rows (failed runs) add nothing.
    """
    samples: dict[int, dict[str, dict[int, list[Mapping[str, Any]]]]] = {}
    for rec in records:
        for row in rec.get("rows") or []:
            by_engine = samples.setdefault(int(rec["n"]), {})
            by_engine.setdefault(str(rec["engine"]), {}).setdefault(int(row["bytes"]), []).append(row)
    out: Summary = {}
    for n, by_engine in samples.items():
        for engine, by_size in by_engine.items():
            for nbytes, rows in by_size.items():
                bus = [float(r["busbw"]) for r in rows]
                out.setdefault(n, {}).setdefault(engine, {})[nbytes] = {
                    "busbw": statistics.median(bus),
                    "time_us": statistics.median(float(r["time_us"]) for r in rows),
                    "busbw_min": min(bus),
                    "busbw_max": max(bus),
                    "repeats": len(rows),
                }
    return out


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or ``None`` when either is missing or ``den`` is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def ratios(
    cells: Mapping[str, Cell | None], peers: Sequence[str], baseline: str = BASELINE
) -> dict[str, float | None]:
    """``baseline``'s busbw over the best TCP peer (``best``) and over each peer in ``peers``."""
    mine = cells.get(baseline)
    mine_bw = mine["busbw"] if mine else None
    tcp = [c["busbw"] for name, c in cells.items() if name in TCP_PEERS and c]
    out = {"best": ratio(mine_bw, max(tcp) if tcp else None)}
    for peer in peers:
        cell = cells.get(peer)
        out[peer] = ratio(mine_bw, cell["busbw"] if cell else None)
    return out


def human_size(nbytes: int) -> str:
    """``4096`` -> ``4K``, ``268435456`` -> ``256M``; other values in bytes."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def _cell_text(cell: Cell | None, nbytes: int, spread: bool) -> str:
    if cell is None:
        return "-"
    text = f"{cell['busbw']:.3f}"
    if spread:
        text += f" ({cell['busbw_min']:.3g}..{cell['busbw_max']:.3g})"
    if nbytes < SMALL_BYTES:
        text += f" {cell['time_us']:.0f}us"
    return text


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summary: Summary, n: int, engines: Sequence[str]) -> list[str]:
    """Lines of the busbw table for ``n`` ranks: one row per size, engines then ratios."""
    by_engine = summary.get(n, {})
    sizes = sorted({b for cells in by_engine.values() for b in cells})
    reps = max((c["repeats"] for cells in by_engine.values() for c in cells.values()), default=0)
    spread = reps > 1
    baseline = next((e for e in engines if e in (BASELINE, "ringcore-symmetric")), BASELINE)
    peers = [e for e in engines if e != baseline]
    show_ratios = baseline in engines and bool(peers)
    width = 24 if spread else 15
    what = f"median of {reps} repeats (min..max)" if spread else f"{reps} repeat"
    head = f"{'size':>6} " + " ".join(f"{e:>{width}}" for e in engines)
    if show_ratios:
        head += "  " + " ".join(f"{'rc/' + x:>10}" for x in ["best", *peers])
    title = f"# N={n}: busbw (GB/s), {what}; time (us) for sizes < {human_size(SMALL_BYTES)}"
    if show_ratios and baseline != BASELINE:
        title += f"; rc: {baseline}"
    lines = [title, head]
    for nbytes in sizes:
        cells = {e: by_engine.get(e, {}).get(nbytes) for e in engines}
        line = f"{human_size(nbytes):>6} " + " ".join(
            f"{_cell_text(cells[e], nbytes, spread):>{width}}" for e in engines
        )
        if show_ratios:
            r = ratios(cells, peers, baseline)
            line += "  " + " ".join(f"{_ratio_text(r[x]):>10}" for x in ["best", *peers])
        lines.append(line)
    return lines
