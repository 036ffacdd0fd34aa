"""Hit rate vs cache capacity, one line per policy (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_STYLES = {"belady": "k--", "infinite": "k:"}


def plot_sweep(
    fractions: Sequence[float],
    curves: dict[str, list[float]],
    unique_blocks: int,
    title: str,
    out: Path,
) -> Path:
    """Write a PNG of every curve over capacity (% of unique blocks, log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [100 * f for f in fractions]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for name, ys in curves.items():
        style = _STYLES.get(name, "o-")
        ax.plot(xs, [100 * y for y in ys], style, label=name, markersize=4, linewidth=1.6)
    ax.set_xscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x:.3g}" for x in xs])
    ax.set_xlabel(f"cache capacity (% of {unique_blocks:,} unique blocks, log scale)")
    ax.set_ylabel("prefix hit rate (% of input blocks)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
