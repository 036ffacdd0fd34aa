"""The report of one scenario run: a JSON-able dict and an optional PNG timeline.

The timeline plots each request at its start time with its latency, ok in
one colour and errored in another, with the fault window shaded.
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.chaos.load import Outcome


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    ok = sum(1 for o in outcomes if o.ok)
    return {"sent": len(outcomes), "ok": ok, "errored": len(outcomes) - ok}


def plot(path: Path, name: str, outcomes: list[Outcome], t0: float, fault: tuple[float, float]) -> Path:
    """Write the PNG timeline to path (matplotlib Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for ok, colour, label in ((True, "tab:green", "ok"), (False, "tab:red", "error")):
        pts = [(o.started - t0, o.latency_ms) for o in outcomes if o.ok is ok]
        if pts:
            ax.scatter(*zip(*pts), s=12, c=colour, label=label)
    ax.axvspan(fault[0] - t0, max(fault[1], fault[0] + 0.05) - t0, color="tab:orange", alpha=0.25, label="fault")
    ax.set(xlabel="request start (s)", ylabel="latency (ms)", title=f"kvmesh chaos: {name}")
    ax.legend(loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
