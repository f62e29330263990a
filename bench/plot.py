"""The PNG of ``bench/compare.py``: busbw against size, one line per engine, one panel per N."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ringcore.bench.summary import Summary, human_size


def busbw_plot(summary: Summary, engines: Sequence[str], path: Path, title: str = "") -> Path | None:
    """Draw the median busbw of every engine against size (log x) and save it as ``path``.

    Returns:
        ``path``, or ``None`` when matplotlib is not installed or there is nothing to draw.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ns = sorted(summary)
    if not ns:
        return None
    fig, axes = plt.subplots(1, len(ns), figsize=(6 * len(ns), 4.5), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], ns, strict=True):
        for engine in engines:
            cells = summary[n].get(engine)
            if not cells:
                continue
            sizes = sorted(cells)
            ax.plot(sizes, [cells[s]["busbw"] for s in sizes], marker="o", label=engine)
        ax.set_xscale("log", base=2)
        ticks = sorted({s for cells in summary[n].values() for s in cells})
        ax.set_xticks(ticks, [human_size(s) for s in ticks])
        ax.set_xlabel("size (bytes)")
        ax.set_title(f"N = {n}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][-1].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
