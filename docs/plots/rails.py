"""Plot GB/s per receiver against the number of rails K from ``weightsync bench --hosts H --rails K --json`` files.

    python docs/plots/rails.py OUT.png RUN_K1.json RUN_K2.json RUN_K4.json

Each file is one bench run on the testbed; every backend found in them gets a line. Two ceilings are drawn: the
sender host's links (``link_limit_gbps``: K rails of ``link_gbps``, no update can leave the sender's host faster),
and this machine's CPU (``limit_gbps``: what its cores copy per receiver, the most any transport can deliver here,
whatever the links). Needs matplotlib (``pip install 'weightsync-cli[plot]'``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(out: str, paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    links: list[tuple[int, float]] = []
    cpu: list[float] = []
    for path in paths:
        with open(path) as handle:
            run = json.load(handle)
        rails = int(run["scenario"].get("rails", 1))
        links.append((rails, float(run["link_limit_gbps"])))
        cpu.append(float(run["limit_gbps"]))
        for result in run["results"]:
            lines[result["backend"]].append((rails, float(result["gbps_p50"])))
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, points in sorted(lines.items()):
        points.sort()
        axes.plot([k for k, _ in points], [g for _, g in points], marker="o", label=label)
    links.sort()
    axes.plot([k for k, _ in links], [g for _, g in links], linestyle="--", color="grey",
              label="links of the sender's host (K x link)")
    axes.axhline(min(cpu), linestyle=":", color="red", label=f"CPU ceiling {min(cpu):.2f} GB/s (copy per receiver)")
    axes.set_xlabel("rails K per host (one stripe per rail)")
    axes.set_ylabel("GB/s per receiver (model size / update time)")
    axes.set_xticks(sorted({k for k, _ in links}))
    axes.set_yscale("log")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
