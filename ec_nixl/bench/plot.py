"""``--plot`` (or results.png in a default run's folder): p50 latency against bytes per operation, one line per path (needs matplotlib).

Without matplotlib the plot is skipped with a one-line reason; the run's exit status does not change.
"""

from __future__ import annotations

import os

from ec_nixl.bench import optional
from ec_nixl.bench.paths import ALL_PATHS


def plot(path: str, rows: list, cfg: dict, env: dict) -> bool:
    matplotlib, why = optional.load("matplotlib")
    if matplotlib is None:
        print(f"plot skipped: {why}")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    for p in ALL_PATHS:
        pts = sorted((r["bytes"], r["p50_us"], r["items"]) for r in rows if r["path"] == p)
        if not pts:
            continue
        line, = ax.plot([x[0] for x in pts], [x[1] for x in pts], marker="o", label=p)
        for b, us, n in pts:
            if n > 1:
                ax.plot([b], [us], marker="s", markersize=10, mfc="none", color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per operation (square: a batch step of several items)")
    ax.set_ylabel("p50 latency, µs (post -> barrier passed / copy + sync)")
    ax.set_title(f"ec-nixl bench — {env.get('gpu') or 'CPU'} ({cfg['device']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
