"""One PNG per scenario: organic share (top) and round credit (bottom) per round, a column per router.

matplotlib is the optional ``plot`` extra; without it :func:`plot_scenario` returns a reason instead.

Example::

    path_or_reason = plot_scenario(scenario, {"project": r1, "deterministic": r2}, Path("out"))
"""

from __future__ import annotations

from pathlib import Path

from .harness import RunResult
from .scenarios import Scenario


def plot_scenario(sc: Scenario, results: dict[str, RunResult], out_dir: Path) -> tuple[Path | None, str]:
    """Write ``soak_<scenario>.png``; returns (path, "") or (None, why it was skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install 'tensorgate[plot]'): plot skipped"
    routers = list(results)
    fig, axes = plt.subplots(2, len(routers), figsize=(5.2 * len(routers), 6.4), squeeze=False, sharex=True)
    for col, router in enumerate(routers):
        res = results[router]
        xs = list(range(res.rounds))
        for label in sc.labels:
            s = res.series[label]
            axes[0][col].plot(xs, s.share, marker="o", ms=3, label=label)
            cx = [x for x, c in zip(xs, s.credit, strict=True) if c is not None]
            cy = [c for c in s.credit if c is not None]
            axes[1][col].plot(cx, cy, marker="o", ms=3, label=label)
        for ev in sc.events:
            for row in (0, 1):
                axes[row][col].axvline(ev.round - 0.5, color="grey", ls=":", lw=1)
                axes[row][col].text(ev.round - 0.4, 1.02, f"{ev.action} ({ev.label})", fontsize=7, color="grey")
        axes[0][col].set_title(f"{sc.name}: router={router}")
        axes[0][col].set_ylabel("organic share")
        axes[1][col].set_ylabel("round credit")
        axes[1][col].set_xlabel(f"round ({sc.round_s:.0f} s simulated)")
        for row in (0, 1):
            axes[row][col].set_ylim(-0.03, 1.08)
            axes[row][col].grid(alpha=0.3)
        axes[0][col].legend(fontsize=8, loc="best")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"soak_{sc.name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path, ""
